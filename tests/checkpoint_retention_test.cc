// Checkpoint retention and file recycling (SaveOptions keep_last / recycle_files,
// core/zero/checkpoint_retention.h): saves keep the newest N checkpoints, never `latest`; a save
// that retires the oldest reuses its rank files (the same inodes, overwritten in place and
// truncated) and training resumed from it is bit-identical to the uninterrupted run; a recycling
// saver killed at every durable operation (CrashAtEnv: torn writes, renames, fsyncs) never
// leaves a partial checkpoint that loads, and `latest` always loads. Also the StreamWriter's reuse
// mode and the disk reference (ckpt::MeasureDisk). Model and harness: engine_test_model.h.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint_fault_env.h"
#include "core/zero/checkpoint_format.h"
#include "core/zero/checkpoint_io.h"
#include "core/zero/checkpoint_retention.h"
#include "engine_test_model.h"

namespace strata::testing {
namespace {

namespace ckpt = zero::ckpt;

// Stage 3, the optimizer states and params homed on NVMe (swap files under /tmp), bf16.
// `aio_block`: the checkpoint streams' chunk bytes (small: many durable operations).
std::string Config(int aio_block = 1 << 20) {
  return R"({
  "train_micro_batch_size_per_gpu": 3,
  "gradient_accumulation_steps": 1,
  "aio": {"block_size": )" +
         std::to_string(aio_block) + R"(, "queue_depth": 2},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "bf16": {"enabled": true},
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
    "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
    "sub_group_size": 256,
    "stage3_param_persistence_threshold": 64
  }
})";
}

uint64_t Inode(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

std::vector<std::string> Tags(const std::string& dir) {
  auto all = ckpt::ListCheckpoints(dir);
  EXPECT_TRUE(all.ok()) << all.status().ToString();
  std::vector<std::string> out;
  if (all.ok()) {
    for (const auto& c : *all) out.push_back(c.tag);
  }
  return out;
}

TEST(CheckpointRetention, TagsBeyondKeepsTheNewestAndNeverTheProtectedOne) {
  const std::vector<ckpt::CheckpointEntry> all = {{"a", 1}, {"b", 2}, {"c", 3}};
  EXPECT_TRUE(ckpt::TagsBeyond(all, 0, 1, "c").empty());  // keep_last 0: keep everything
  EXPECT_TRUE(ckpt::TagsBeyond(all, 4, 1, "c").empty());
  EXPECT_EQ(ckpt::TagsBeyond(all, 3, 1, "c"), std::vector<std::string>{"a"});
  EXPECT_EQ(ckpt::TagsBeyond(all, 2, 0, "c"), std::vector<std::string>{"a"});
  EXPECT_EQ(ckpt::TagsBeyond(all, 1, 1, "c"), (std::vector<std::string>{"a", "b"}));
  // `latest` is the oldest: the next oldest goes instead.
  EXPECT_EQ(ckpt::TagsBeyond(all, 3, 1, "a"), std::vector<std::string>{"b"});
  EXPECT_EQ(ckpt::TagsBeyond(all, 1, 0, "a"), (std::vector<std::string>{"b", "c"}));
}

// Four steps saved after every one with keep_last 2: two checkpoints remain, each save from the
// third on reuses the files of the one it retires (same inode per rank), no scratch directory is
// left, and a run resumed from `latest` for steps 4..5 ends bit-identical to the uninterrupted
// six-step run. Two ranks, so every rank recycles its own file.
TEST(CheckpointRetention, RecycledSavesResumeBitIdentical) {
  const std::string dir = UniqueTestDir("ckpt_keep");
  RunSpec base;
  base.config_json = Config();
  base.world = 2;
  base.steps = 6;
  RunResult full = RunEngine(base);
  ASSERT_TRUE(full.status.ok()) << full.status.ToString();

  SaveOptions keep;
  keep.keep_last = 2;
  std::vector<std::vector<uint64_t>> inodes(4, std::vector<uint64_t>(2));  // [step][rank]
  RunSpec first = base;
  first.steps = 4;
  first.after_step = [&](int rank, int step, Engine& e) -> Status {
    const std::string tag = "s" + std::to_string(step);
    STRATA_RETURN_IF_ERROR(e.Save(dir, tag, keep));
    inodes[step][rank] = Inode(dir + "/" + tag + "/" + ckpt::Manifest::RankFileName(rank));
    return Status::OK();
  };
  RunResult part = RunEngine(first);
  ASSERT_TRUE(part.status.ok()) << part.status.ToString();
  EXPECT_EQ(Tags(dir), (std::vector<std::string>{"s2", "s3"}));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(inodes[0][r], 0u);
    EXPECT_NE(inodes[1][r], inodes[0][r]) << "s1 had nothing to recycle";
    EXPECT_EQ(inodes[2][r], inodes[0][r]) << "s2 did not reuse s0's file of rank " << r;
    EXPECT_EQ(inodes[3][r], inodes[1][r]) << "s3 did not reuse s1's file of rank " << r;
  }
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_NE(e.path().extension(), ".tmp") << e.path() << " left behind";
  }
  auto m = ckpt::VerifyCheckpoint(dir, "");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->tag, "s3");

  RunSpec resume = base;
  resume.first_step = 4;
  resume.init = [&](int, Engine& e) -> Status { return e.Load(dir, ""); };
  RunResult resumed = RunEngine(resume);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.ToString();
  EXPECT_TRUE(BitEqual(full.master, resumed.master)) << "resumed from a recycled save, diverged";
  std::filesystem::remove_all(dir);
}

// The config's `checkpoint` section is what Engine::Save without SaveOptions applies
// (SaveOptionsFromConfig): with keep_last 2 three saves leave the newest two, the third in the
// first one's file; an explicit SaveOptions replaces it (keep_last 0: nothing removed).
TEST(CheckpointRetention, ConfigKeepLastReachesSave) {
  const std::string dir = UniqueTestDir("ckpt_config_keep");
  std::string config = Config();
  config.insert(config.find("\"aio\""), R"("checkpoint": {"keep_last": 2}, )");
  auto parsed = ParseDeepSpeedConfig(config);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const SaveOptions from = SaveOptionsFromConfig(parsed->config.checkpoint);
  EXPECT_EQ(from.keep_last, 2u);
  EXPECT_TRUE(from.recycle_files);
  RunSpec s;
  s.config_json = config;
  s.steps = 4;
  uint64_t first_inode = 0, third_inode = 0;
  const std::string rank0 = "/" + ckpt::Manifest::RankFileName(0);
  s.after_step = [&](int, int step, Engine& e) -> Status {
    const std::string tag = "c" + std::to_string(step);
    if (step == 3) return e.Save(dir, tag, SaveOptions{});  // explicit: keeps every one
    STRATA_RETURN_IF_ERROR(e.Save(dir, tag));
    if (step == 0) first_inode = Inode(dir + "/c0" + rank0);
    if (step == 2) third_inode = Inode(dir + "/c2" + rank0);
    return Status::OK();
  };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_NE(first_inode, 0u);
  EXPECT_EQ(third_inode, first_inode) << "the config's recycle_files did not reach the save";
  EXPECT_EQ(Tags(dir), (std::vector<std::string>{"c1", "c2", "c3"}));
  std::filesystem::remove_all(dir);
}

// keep_last 1 never recycles (the only candidate is `latest`) and retires the previous one after
// the commit; recycle_files false retires without reusing; `latest` is kept even when it is the
// oldest (the next oldest is recycled instead).
TEST(CheckpointRetention, LatestIsNeverRetiredOrRecycled) {
  const std::string dir = UniqueTestDir("ckpt_latest");
  RunSpec s;
  s.config_json = Config();
  s.steps = 3;
  uint64_t a_inode = 0, b_inode = 0, d_inode = 0;
  s.after_step = [&](int, int step, Engine& e) -> Status {
    const std::string rank0 = "/" + ckpt::Manifest::RankFileName(0);
    if (step == 0) {
      STRATA_RETURN_IF_ERROR(e.Save(dir, "a"));
      STRATA_RETURN_IF_ERROR(e.Save(dir, "b"));
      a_inode = Inode(dir + "/a" + rank0);
      b_inode = Inode(dir + "/b" + rank0);
      // `latest` back to the oldest, as after a rollback.
      return ckpt::WriteSmallFile(dir + "/" + ckpt::kLatestName, "a\n", true);
    }
    if (step == 1) {
      SaveOptions keep;
      keep.keep_last = 2;
      STRATA_RETURN_IF_ERROR(e.Save(dir, "c", keep));
      if (Inode(dir + "/c" + rank0) != b_inode) return Status::Internal("c did not recycle b");
      SaveOptions one;
      one.keep_last = 1;
      STRATA_RETURN_IF_ERROR(e.Save(dir, "d", one));
      d_inode = Inode(dir + "/d" + rank0);
      return Status::OK();
    }
    SaveOptions plain;
    plain.keep_last = 1;
    plain.recycle_files = false;
    return e.Save(dir, "e", plain);
  };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_NE(a_inode, 0u);
  EXPECT_NE(d_inode, 0u);
  EXPECT_EQ(Tags(dir), std::vector<std::string>{"e"});
  EXPECT_NE(Inode(dir + "/e/" + ckpt::Manifest::RankFileName(0)), d_inode);
  auto m = ckpt::VerifyCheckpoint(dir, "");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->tag, "e");
  std::filesystem::remove_all(dir);
}

// One saver per directory: while another process holds the directory's SaveLock (here another
// open file description of this one, which flock treats alike) a save is refused, naming the
// directory, and the other's unfinished `<tag>.tmp` is untouched (it used to be removed as a
// crashed save's, and the other save then committed a damaged checkpoint). Once the lock is
// free, the next save removes every crashed save's `*.tmp`, whatever its tag. A save into a path
// that is a regular file is refused naming it.
TEST(CheckpointRetention, OneSaverPerDirectoryAndCrashedSavesAreCleaned) {
  const std::string dir = UniqueTestDir("ckpt_lock");
  std::filesystem::create_directories(dir + "/other.tmp/recycled");
  std::filesystem::create_directories(dir + "/global_step7.tmp");
  std::ofstream(dir + "/file") << "x";
  RunSpec s;
  s.config_json = Config();
  s.steps = 1;
  s.after_step = [&](int, int, Engine& e) -> Status {
    {
      auto held = ckpt::SaveLock::Acquire(dir);
      STRATA_RETURN_IF_ERROR(held.status());
      const Status busy = e.Save(dir, "a");
      if (busy.code() != Status::Code::kFailedPrecondition ||
          busy.message().find("another process") == std::string_view::npos ||
          busy.message().find(dir) == std::string_view::npos) {
        return Status::Internal("a save beside another saver: " + busy.ToString());
      }
      if (!ckpt::PathExists(dir + "/other.tmp/recycled")) {
        return Status::Internal("the other saver's files were removed");
      }
    }
    STRATA_RETURN_IF_ERROR(e.Save(dir, "a"));
    const Status file = e.Save(dir + "/file", "b");
    if (file.code() != Status::Code::kInvalidArgument ||
        file.message().find("is not a directory") == std::string_view::npos) {
      return Status::Internal("a save into a file: " + file.ToString());
    }
    return Status::OK();
  };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "file", "latest"}));
  EXPECT_TRUE(ckpt::VerifyCheckpoint(dir, "").ok());
  std::filesystem::remove_all(dir);
}

// StreamWriter reuse: the same inode, overwritten, truncated to the new (shorter) content.
TEST(CheckpointRetention, StreamWriterReuseOverwritesAndTruncates) {
  const std::string dir = UniqueTestDir("ckpt_reuse");
  const std::string path = dir + "/f";
  ckpt::StreamOptions o;
  o.kind = IoBackendKind::kPosix;
  o.chunk_bytes = 8192;
  o.depth = 2;
  std::vector<uint8_t> big(40000, 0xAB), small(5000);
  for (size_t i = 0; i < small.size(); ++i) small[i] = static_cast<uint8_t>(i * 13);
  {
    auto w = ckpt::StreamWriter::Create(path, o, big.size());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_TRUE((*w)->Append(big.data(), big.size()).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  const uint64_t inode = Inode(path);
  auto w = ckpt::StreamWriter::Create(path, o, small.size(), /*reuse=*/true);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE((*w)->Append(small.data(), small.size()).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  EXPECT_EQ(Inode(path), inode);
  auto text = ckpt::ReadWholeFile(path);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(*text, std::string(small.begin(), small.end()));
  std::filesystem::remove_all(dir);
}

// The disk reference writes, overwrites and reads the bytes asked for (rounded up to chunks),
// reports three positive rates and leaves no file behind; the simulated backend is refused.
TEST(CheckpointRetention, DiskReferenceMeasuresAndCleansUp) {
  const std::string dir = UniqueTestDir("ckpt_disk");
  ckpt::StreamOptions o;
  o.kind = IoBackendKind::kPosix;
  o.chunk_bytes = 64 << 10;
  o.depth = 4;
  auto d = ckpt::MeasureDisk(dir, 300'000, o);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->bytes, 5u * (64 << 10));
  EXPECT_EQ(d->chunk_bytes, o.chunk_bytes);
  EXPECT_EQ(d->depth, 4u);
  EXPECT_GT(d->write_fresh_bytes_per_s, 0);
  EXPECT_GT(d->write_overwrite_bytes_per_s, 0);
  EXPECT_GT(d->read_bytes_per_s, 0);
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  o.kind = IoBackendKind::kSimulated;
  EXPECT_TRUE(ckpt::MeasureDisk(dir, 300'000, o).status().IsInvalidArgument());
  std::filesystem::remove_all(dir + "/nope");
  auto missing = ckpt::MeasureDisk(dir + "/nope", 4096, ckpt::StreamOptions{});
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find(dir + "/nope"), std::string::npos)
      << missing.status().ToString();
  std::filesystem::remove_all(dir);
}

// --- crashes ---------------------------------------------------------------------------------

// The saver, in a forked child: loads `latest`, saves it as `tag` with keep_last 2 (recycling
// the oldest non-latest checkpoint) in 4 KiB chunks through a CrashAtEnv dying at its
// `crash_at`-th durable operation (checkpoint_fault_env.h), then _exits 0, or 1 when that failed.
[[noreturn]] void ChildLoadAndRecycle(const std::string& dir, const std::string& tag,
                                      int crash_at) {
  CrashAtEnv crash(crash_at);
  RunSpec s;
  s.config_json = Config(4096);
  s.steps = 0;
  s.init = [&](int, Engine& e) -> Status {
    STRATA_RETURN_IF_ERROR(e.Load(dir, ""));
    SaveOptions keep;
    keep.keep_last = 2;
    keep.env = &crash;
    return e.Save(dir, tag, keep);
  };
  RunResult r = RunEngine(s);
  ::_exit(r.status.ok() ? 0 : 1);
}

// Copies checkpoint `from` of dir to `to` (its manifest renamed): a spare for the next save to
// recycle (it is newer than `latest` by mtime, but never `latest`).
void CopyCheckpoint(const std::string& dir, const std::string& from, const std::string& to) {
  std::filesystem::copy(dir + "/" + from, dir + "/" + to, std::filesystem::copy_options::recursive);
  const std::string path = dir + "/" + to + "/" + ckpt::kManifestName;
  auto text = ckpt::ReadWholeFile(path);
  ASSERT_TRUE(text.ok());
  auto m = ckpt::Manifest::FromJson(*text);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  m->tag = to;
  std::ofstream(path, std::ios::trunc) << m->ToJson();  // sealed again with its checksum
}

// Before every save two checkpoints exist (`latest` and a spare), so every save recycles; the
// child dies at its k-th durable operation, k = 1.. until one finishes. After each: `latest`
// verifies and is the previous one or the new tag; every checkpoint under its final name
// verifies; the new tag verifies or does not exist; at most keep_last remain. On tmpfs (no disk
// fsyncs; the same crash consistency against a killed process).
TEST(CheckpointRetentionCrash, KilledRecyclingSaverNeverLeavesALoadablePartialCheckpoint) {
  const char* shm = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
  ::setenv("STRATA_TEST_TMPDIR", shm, 1);
  const std::string dir = UniqueTestDir("ckpt_recycle_crash");
  ::unsetenv("STRATA_TEST_TMPDIR");
  {
    RunSpec s;
    s.config_json = Config(4096);
    s.steps = 1;
    s.after_step = [&](int, int, Engine& e) -> Status { return e.Save(dir, "base"); };
    RunResult r = RunEngine(s);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  }
  std::string latest = "base";
  int points = 0, completed = 0, recycled = 0;
  for (int k = 1; k < 1000; ++k) {
    const std::string tag = "k" + std::to_string(k);
    if (Tags(dir).size() < 2) CopyCheckpoint(dir, latest, "spare" + std::to_string(k));
    const std::vector<std::string> before = Tags(dir);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) ChildLoadAndRecycle(dir, tag, k);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status)) << tag;
    const int code = WEXITSTATUS(status);
    ASSERT_TRUE(code == 77 || code == 0) << tag << " exited " << code;
    ++points;
    auto l = ckpt::VerifyCheckpoint(dir, "");
    ASSERT_TRUE(l.ok()) << tag << ": latest does not verify: " << l.status().ToString();
    EXPECT_TRUE(l->tag == latest || l->tag == tag) << l->tag;
    const std::vector<std::string> after = Tags(dir);
    for (const std::string& t : after) {
      auto v = ckpt::VerifyCheckpoint(dir, t);
      EXPECT_TRUE(v.ok()) << tag << ": " << t << " is under its final name but "
                          << v.status().ToString();
    }
    const bool complete = ckpt::VerifyCheckpoint(dir, tag).ok();
    EXPECT_EQ(complete, std::filesystem::exists(dir + "/" + tag)) << tag;
    if (after.size() < before.size() + (complete ? 1 : 0)) ++recycled;  // one went
    latest = l->tag;
    if (complete) {
      ++completed;
      EXPECT_LE(after.size(), 2u) << tag;
    }
    if (code == 0) {
      EXPECT_TRUE(complete);
      EXPECT_EQ(latest, tag);
      break;
    }
  }
  std::printf("recycling crash points: %d, checkpoints completed: %d, recycled or retired: %d\n",
              points, completed, recycled);
  EXPECT_GT(points, 20);
  EXPECT_GT(recycled, 10);  // most points lie after the old checkpoint was taken
  // The survivor loads into a new engine.
  RunSpec s;
  s.config_json = Config(4096);
  s.steps = 0;
  s.init = [&](int, Engine& e) -> Status { return e.Load(dir, ""); };
  EXPECT_TRUE(RunEngine(s).status.ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata::testing
