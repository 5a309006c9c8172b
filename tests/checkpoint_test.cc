// Engine checkpoints (Engine::Save / Engine::Load, core/zero/checkpoint*.h): training resumed from
// a checkpoint ends bit-for-bit where the uninterrupted run ends, for several placements (state
// on every tier) and world sizes; damaged checkpoints are refused naming the file; a saver killed
// at many points (a CheckpointEnv double that _exits at the k-th durable operation, torn writes
// included: checkpoint_fault_env.h; and real SIGKILLs after random delays) never leaves a partial
// checkpoint that loads, and the previous one always loads. Model and harness: engine_test_model.h.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_fault_env.h"
#include "core/zero/checkpoint_format.h"
#include "engine_test_model.h"
#include "nvme/bench/nvme_bench.h"

namespace strata::testing {
namespace {

namespace ckpt = zero::ckpt;

struct Placement {
  int stage;
  const char* opt;
  const char* param;
  int world;
  const char* precision;
};

std::string Config(const Placement& pl) {
  const std::string precision = pl.precision;
  return R"({
  "train_micro_batch_size_per_gpu": 3,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}},
  "bf16": {"enabled": )" +
         std::string(precision == "bf16" ? "true" : "false") + R"(},
  "fp16": {"enabled": )" +
         std::string(precision == "fp16" ? "true" : "false") +
         R"(, "initial_scale_power": 8, "loss_scale_window": 2},
  "zero_optimization": {
    "stage": )" +
         std::to_string(pl.stage) + R"(,
    "offload_optimizer": {"device": ")" +
         pl.opt + R"(", "nvme_path": "/tmp"},
    "offload_param": {"device": ")" +
         pl.param + R"(", "nvme_path": "/tmp"},
    "sub_group_size": 256,
    "stage3_param_persistence_threshold": 64
  }
})";
}

std::string Name(const Placement& p) {
  return "stage" + std::to_string(p.stage) + "_opt_" + p.opt + "_param_" + p.param + "_w" +
         std::to_string(p.world) + "_" + p.precision;
}

std::vector<uint8_t> Blob(const std::string& s) { return {s.begin(), s.end()}; }

class CheckpointResume : public ::testing::TestWithParam<Placement> {};

// Run 6 steps; separately run 3, save, and resume in new engines for steps 3..5: the final
// master weights are the same bits. The client blob comes back on every rank.
TEST_P(CheckpointResume, BitIdenticalToUninterrupted) {
  const Placement pl = GetParam();
  const std::string dir = UniqueTestDir("ckpt_resume");
  RunSpec base;
  base.config_json = Config(pl);
  base.world = pl.world;
  base.steps = 6;
  RunResult full = RunEngine(base);
  ASSERT_TRUE(full.status.ok()) << full.status.ToString();

  RunSpec first = base;
  first.steps = 3;
  first.after_step = [&](int, int step, Engine& e) -> Status {
    if (step == 1) return e.Save(dir, "step2", Blob("two"));
    if (step == 2) return e.Save(dir, "step3", Blob("data position 3"));
    return Status::OK();
  };
  RunResult part = RunEngine(first);
  ASSERT_TRUE(part.status.ok()) << part.status.ToString();
  auto m = ckpt::VerifyCheckpoint(dir, "");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->tag, "step3");
  EXPECT_EQ(m->global_step, 3);
  EXPECT_EQ(m->world_size, pl.world);

  RunSpec resume = base;
  resume.first_step = 3;
  std::vector<std::string> blobs(pl.world);
  resume.init = [&](int r, Engine& e) -> Status {
    std::vector<uint8_t> blob;
    STRATA_RETURN_IF_ERROR(e.Load(dir, "", &blob));
    blobs[r].assign(blob.begin(), blob.end());
    if (e.global_step() != 3) return Status::Internal("global_step not restored");
    return Status::OK();
  };
  RunResult resumed = RunEngine(resume);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.ToString();
  for (const std::string& b : blobs) EXPECT_EQ(b, "data position 3");
  EXPECT_TRUE(BitEqual(full.master, resumed.master)) << "resumed run diverged";
  ASSERT_EQ(resumed.reports.size(), 3u);
  EXPECT_EQ(resumed.reports.back().global_step, full.reports.back().global_step);
  EXPECT_EQ(resumed.reports.back().loss_scale, full.reports.back().loss_scale);
  EXPECT_EQ(resumed.reports.back().lr, full.reports.back().lr);
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Placements, CheckpointResume,
                         ::testing::Values(Placement{0, "none", "none", 1, "bf16"},
                                           Placement{0, "cpu", "none", 2, "bf16"},
                                           Placement{1, "cpu", "none", 2, "fp16"},
                                           Placement{2, "none", "none", 2, "fp32"},
                                           Placement{3, "nvme", "nvme", 1, "bf16"},
                                           Placement{3, "nvme", "nvme", 2, "bf16"},
                                           Placement{3, "cpu", "nvme", 2, "fp16"},
                                           Placement{3, "none", "cpu", 2, "bf16"}),
                         [](const ::testing::TestParamInfo<Placement>& i) {
                           return Name(i.param);
                         });

// LoadOptions optimizer_states and lr_schedule false: a run resumed from step 3's checkpoint
// with a fresh Adam and schedule is the same bits as a new engine initialised with the
// checkpoint's masters (fresh m, v, bias correction and WarmupLR) training the same steps; and
// the restarts survive a save and load.
TEST(CheckpointLoadOptions, FreshOptimizerStateEqualsANewEngineOnTheSameWeights) {
  for (const Placement pl : {Placement{1, "cpu", "none", 2, "fp32"},
                             Placement{3, "nvme", "nvme", 2, "bf16"}}) {
    SCOPED_TRACE(Name(pl));
    const std::string dir = UniqueTestDir("ckpt_fresh");
    RunSpec first;
    first.config_json = Config(pl);
    first.world = pl.world;
    first.steps = 3;
    first.after_step = [&](int, int step, Engine& e) -> Status {
      return step == 2 ? e.Save(dir, "step3") : Status::OK();
    };
    const RunResult part = RunEngine(first);
    ASSERT_TRUE(part.status.ok()) << part.status.ToString();

    RunSpec fresh = first;
    fresh.steps = 5;
    fresh.first_step = 3;
    fresh.after_step = {};
    fresh.init = [&](int, Engine& e) -> Status {
      // Each parameter's values in its group's flat master.
      const ModelSpec model = TestModel();
      std::vector<std::vector<const float*>> t(part.master.size());
      for (size_t g = 0; g < t.size(); ++g) {
        size_t off = 0;
        for (const ParamSpec& ps : model.groups[g].params) {
          t[g].push_back(part.master[g].data() + off);
          off += ps.numel();
        }
      }
      return e.InitFromFullTensors(t);
    };
    const RunResult want = RunEngine(fresh);
    ASSERT_TRUE(want.status.ok()) << want.status.ToString();

    RunSpec loaded = fresh;
    loaded.init = [&](int, Engine& e) -> Status {
      LoadOptions o;  // the config's WarmupLR restarts too, as in a new engine
      o.optimizer_states = false;
      o.lr_schedule = false;
      STRATA_RETURN_IF_ERROR(e.Load(dir, "step3", nullptr, o));
      return e.global_step() == 3 ? Status::OK() : Status::Internal("global_step not restored");
    };
    loaded.after_step = [&](int, int step, Engine& e) -> Status {
      return step == 3 ? e.Save(dir, "step4") : Status::OK();
    };
    const RunResult got = RunEngine(loaded);
    ASSERT_TRUE(got.status.ok()) << got.status.ToString();
    EXPECT_TRUE(BitEqual(got.master, want.master));

    RunSpec again = fresh;
    again.first_step = 4;
    again.init = [&](int, Engine& e) -> Status { return e.Load(dir, "step4"); };
    const RunResult resumed = RunEngine(again);
    ASSERT_TRUE(resumed.status.ok()) << resumed.status.ToString();
    EXPECT_TRUE(BitEqual(resumed.master, want.master));
    std::filesystem::remove_all(dir);
  }
}

// --- refusals and damage ------------------------------------------------------------------------

const Placement kSolo{3, "cpu", "cpu", 1, "bf16"};

// Saves `tag` after 2 steps into dir (world 1), through `env` when given.
void SaveSolo(const std::string& dir, const std::string& tag, CheckpointEnv* env = nullptr) {
  RunSpec s;
  s.config_json = Config(kSolo);
  s.steps = 2;
  s.after_step = [&](int, int step, Engine& e) -> Status {
    if (step != 1) return Status::OK();
    if (env == nullptr) return e.Save(dir, tag, Blob("blob"));
    SaveOptions o;
    o.env = env;
    return e.Save(dir, tag, o, Blob("blob"));
  };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
}

// Loads `tag` of dir into a new engine (world 1, `pl`); the load's status.
Status LoadSolo(const std::string& dir, const std::string& tag, Placement pl = kSolo,
                std::optional<ModelSpec> model = std::nullopt) {
  RunSpec s;
  s.config_json = Config(pl);
  s.world = pl.world;
  s.steps = 0;
  s.model = model;
  Status load;
  s.init = [&](int r, Engine& e) -> Status {
    Status st = e.Load(dir, tag);
    if (r == 0) load = st;
    return Status::OK();
  };
  RunResult r = RunEngine(s);
  if (!load.ok()) return load;
  return model ? Status::OK() : r.status;
}

// A tag saved again is replaced (as DeepSpeed overwrites it): `latest` names it and it holds the
// second save, which loads; nothing of the first is left behind.
TEST(Checkpoint, SavingATagAgainReplacesIt) {
  const std::string dir = UniqueTestDir("ckpt_again");
  RunSpec s;
  s.config_json = Config(kSolo);
  s.steps = 2;
  s.after_step = [&](int, int, Engine& e) -> Status { return e.Save(dir, "a"); };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  auto m = ckpt::VerifyCheckpoint(dir, "");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->tag, "a");
  EXPECT_EQ(m->global_step, 2);
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "latest"}));
  RunSpec two = s;
  two.after_step = nullptr;
  RunResult want = RunEngine(two);
  ASSERT_TRUE(want.status.ok());
  RunSpec loaded = s;
  loaded.steps = 0;
  loaded.after_step = nullptr;
  loaded.init = [&](int, Engine& e) { return e.Load(dir, "a"); };
  RunResult got = RunEngine(loaded);
  ASSERT_TRUE(got.status.ok()) << got.status.ToString();
  EXPECT_TRUE(BitEqual(got.master, want.master));
  std::filesystem::remove_all(dir);
}

// SaveOptions::update_latest false (DeepSpeed's save_latest=False): `latest` keeps naming the
// checkpoint it named, the new one is complete and loads by its tag; with keep_last the one
// `latest` names is kept whatever its age.
TEST(Checkpoint, WithoutUpdatingLatestTheNewOneLoadsByItsTag) {
  const std::string dir = UniqueTestDir("ckpt_no_latest");
  RunSpec s;
  s.config_json = Config(kSolo);
  s.steps = 3;
  s.after_step = [&](int, int step, Engine& e) -> Status {
    SaveOptions o;
    o.update_latest = step == 0;
    o.keep_last = 2;
    return e.Save(dir, "s" + std::to_string(step + 1), o);
  };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  auto latest = ckpt::ResolveTag(dir, "");
  ASSERT_TRUE(latest.ok()) << latest.status().ToString();
  EXPECT_EQ(*latest, "s1");
  EXPECT_TRUE(ckpt::PathExists(dir + "/s1"));
  EXPECT_FALSE(ckpt::PathExists(dir + "/s2"));  // retired by keep_last 2, s1 being `latest`
  auto m = ckpt::VerifyCheckpoint(dir, "s3");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->global_step, 3);
  RunSpec loaded = s;
  loaded.steps = 0;
  loaded.after_step = nullptr;
  loaded.init = [&](int, Engine& e) { return e.Load(dir, "s3"); };
  RunResult got = RunEngine(loaded);
  ASSERT_TRUE(got.status.ok()) << got.status.ToString();
  EXPECT_TRUE(BitEqual(got.master, r.master));
  std::filesystem::remove_all(dir);
}

// A tag directory renamed after its save ("global_step6" -> "best", as scripts keep their best
// checkpoint; DeepSpeed builds paths from the tag and checks nothing inside) verifies and loads
// under its new name, and `latest` may name it. A save's unfinished "<tag>.tmp" does not load,
// even named explicitly.
TEST(Checkpoint, ARenamedTagDirectoryLoadsUnderItsNewName) {
  const std::string dir = UniqueTestDir("ckpt_renamed");
  SaveSolo(dir, "global_step2");
  std::filesystem::rename(dir + "/global_step2", dir + "/best");
  auto m = ckpt::VerifyCheckpoint(dir, "best");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->tag, "best");
  EXPECT_TRUE(LoadSolo(dir, "best").ok());
  {
    std::ofstream latest(dir + "/latest", std::ios::trunc);
    latest << "best\n";
  }
  EXPECT_TRUE(LoadSolo(dir, "").ok());
  std::filesystem::copy(dir + "/best", dir + "/best.tmp");
  const Status tmp = LoadSolo(dir, "best.tmp");
  EXPECT_EQ(tmp.code(), Status::Code::kCorruption) << tmp.ToString();
  EXPECT_NE(tmp.ToString().find("unfinished save"), std::string::npos) << tmp.ToString();
  EXPECT_FALSE(ckpt::VerifyCheckpoint(dir, "best.tmp").ok());
  std::filesystem::remove_all(dir);
}

// Save needs every group released and no gradient buffer out (a backward in progress); Load
// also needs the accumulation window closed. Each refusal writes nothing.
TEST(Checkpoint, RefusesInsideABackwardAndLoadsOnlyAtABoundary) {
  const std::string dir = UniqueTestDir("ckpt_refuse");
  RunSpec s;
  s.config_json = Config(kSolo);
  s.steps = 2;
  Status with_buffer, gathered, loaded;
  s.after_step = [&](int, int step, Engine& e) -> Status {
    if (step == 0) return e.Save(dir, "boundary");
    STRATA_ASSIGN_OR_RETURN(GatheredGroup g, e.Gather(0));
    gathered = e.Save(dir, "gathered");
    e.Release(std::move(g));
    STRATA_RETURN_IF_ERROR(e.GradBuffer(0).status());
    with_buffer = e.Save(dir, "buffer");
    STRATA_RETURN_IF_ERROR(e.ReduceGradients(0));
    loaded = e.Load(dir, "boundary");
    return e.DiscardGradients();
  };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  for (const Status* st : {&gathered, &with_buffer, &loaded}) {
    EXPECT_EQ(st->code(), Status::Code::kFailedPrecondition) << st->ToString();
  }
  EXPECT_NE(gathered.ToString().find("not released"), std::string::npos) << gathered.ToString();
  EXPECT_NE(with_buffer.ToString().find("backward in progress"), std::string::npos)
      << with_buffer.ToString();
  EXPECT_NE(loaded.ToString().find("mid-accumulation"), std::string::npos) << loaded.ToString();
  for (const char* t : {"gathered", "buffer", "gathered.tmp", "buffer.tmp"}) {
    EXPECT_FALSE(std::filesystem::exists(dir + "/" + t)) << t;
  }
  std::filesystem::remove_all(dir);
}

// DeepSpeed's save_checkpoint inside an accumulation window (a script that saves every N
// micro-batches): the checkpoint holds the state of the last Step, without the window's
// gradients, and training goes on with them. gradient_accumulation_steps 2: step 1 saves after
// its first micro-step ("window"), step 2 after both (its Adam, speculated from the final
// gradients with the optimizer offloaded at stage 3, is undone for the save and redone by Step).
// The run ends on the bits of one that never saved, and each checkpoint resumes to them from the
// step after the last Step before it (the window starts again whole, as in DeepSpeed).
TEST(Checkpoint, SavesInsideAWindowWithoutItsGradients) {
  const Placement placements[] = {
      {2, "cpu", "none", 2, "fp32"}, {3, "cpu", "cpu", 2, "bf16"}, {3, "nvme", "nvme", 1, "fp32"}};
  for (const Placement& pl : placements) {
    SCOPED_TRACE(Name(pl));
    const std::string dir = UniqueTestDir("ckpt_window");
    RunSpec s;
    s.config_json = Config(pl);
    const std::string one = R"("gradient_accumulation_steps": 1)";
    // Unclipped (DeepSpeed's default clips at 1.0): a clipped step's speculation is undone.
    s.config_json.replace(s.config_json.find(one), one.size(),
                          R"("gradient_accumulation_steps": 2, "gradient_clipping": 0)");
    const std::string nvme = R"("nvme_path": "/tmp"})";
    s.config_json.replace(s.config_json.find(nvme), nvme.size(),
                          R"("nvme_path": "/tmp", "speculative_step": true})");
    s.gas = 2;
    s.world = pl.world;
    s.steps = 4;
    const RunResult plain = RunEngine(s);
    ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();

    RunSpec saving = s;
    saving.after_micro = [&](int, int step, int micro, Engine& e) -> Status {
      if (step == 1 && micro == 0) return e.Save(dir, "window");
      if (step == 2 && micro == 1) return e.Save(dir, "final");
      return Status::OK();
    };
    const RunResult saved = RunEngine(saving);
    ASSERT_TRUE(saved.status.ok()) << saved.status.ToString();
    EXPECT_TRUE(BitEqual(saved.master, plain.master));
    if (pl.stage == 3) {  // the speculated Adam of step 2 was undone for "final" and redone
      EXPECT_GT(saved.reports[2].rolled_back_sub_groups, 0u);
      EXPECT_EQ(plain.reports[2].rolled_back_sub_groups, 0u);
    }
    for (const auto& [tag, first] : {std::pair<const char*, int>{"window", 1}, {"final", 2}}) {
      SCOPED_TRACE(tag);
      RunSpec resumed = s;
      resumed.first_step = first;
      resumed.init = [&](int, Engine& e) { return e.Load(dir, tag); };
      const RunResult got = RunEngine(resumed);
      ASSERT_TRUE(got.status.ok()) << got.status.ToString();
      EXPECT_TRUE(BitEqual(got.master, plain.master));
    }
    std::filesystem::remove_all(dir);
  }
}

// A script that saves on rank 0 only (`if rank == 0: engine.save_checkpoint(...)`, common with
// torch.save habits): Save is collective, so rank 0 waits at the first agreement until the
// timeout, and the error says why instead of only naming the deadline.
TEST(Checkpoint, SaveOnOneRankOnlyNamesTheCollectiveWithinTheTimeout) {
  const std::string dir = UniqueTestDir("ckpt_rank0_only");
  RunSpec s;
  s.config_json = Config(kSolo);
  s.world = 2;
  s.steps = 1;
  s.timeout = std::chrono::milliseconds(2000);
  std::promise<Status> saved;
  std::shared_future<Status> done = saved.get_future().share();
  s.after_step = [&](int rank, int, Engine& e) -> Status {
    if (rank == 0) {
      saved.set_value(e.Save(dir, "alone"));
    } else {
      done.wait();  // rank 1 stays alive (and out of collectives) until rank 0 gave up
    }
    return Status::OK();
  };
  RunResult r = RunEngine(s);
  (void)r;  // rank 0's engine has failed: the run's later collectives fail too
  const Status st = done.get();
  EXPECT_EQ(st.code(), Status::Code::kDeadlineExceeded) << st.ToString();
  EXPECT_NE(st.ToString().find("every rank must call it"), std::string::npos) << st.ToString();
  EXPECT_FALSE(std::filesystem::exists(dir + "/alone"));
  std::filesystem::remove_all(dir);
}

// Reads `tag`'s manifest, lets `edit` change it, and writes it back (by ToJson: sealed with its
// checksum from format version 2).
void RewriteManifest(const std::string& dir, const std::string& tag,
                     const std::function<void(ckpt::Manifest*)>& edit) {
  const std::string path = dir + "/" + tag + "/" + ckpt::kManifestName;
  auto m = ckpt::Manifest::FromJson(*ckpt::ReadWholeFile(path));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  edit(&*m);
  std::ofstream(path, std::ios::trunc) << m->ToJson();
}

// XORs the byte right after the first `after` in the file at `path` with 1.
void FlipByteAfter(const std::string& path, const std::string& after) {
  std::string t = *ckpt::ReadWholeFile(path);
  const size_t at = t.find(after);
  ASSERT_NE(at, std::string::npos) << after;
  t[at + after.size()] ^= 1;
  std::ofstream(path, std::ios::trunc | std::ios::binary) << t;
}

TEST(Checkpoint, DamagedFilesAreNamed) {
  const std::string dir = UniqueTestDir("ckpt_damage");
  SaveSolo(dir, "good");
  ASSERT_TRUE(LoadSolo(dir, "").ok());
  auto copy = [&](const std::string& name, int format_version = ckpt::kFormatVersion) {
    std::filesystem::copy(dir + "/good", dir + "/" + name,
                          std::filesystem::copy_options::recursive);
    // The copy's manifest still says tag "good": rewritten (and sealed again) by ToJson.
    RewriteManifest(dir, name, [&](ckpt::Manifest* m) {
      m->tag = name;
      m->format_version = format_version;
    });
    return dir + "/" + name + "/";
  };
  // Truncated rank file.
  std::filesystem::resize_file(copy("trunc") + "rank0.safetensors", 1000);
  // One flipped byte in the middle.
  {
    const std::string p = copy("flip") + "rank0.safetensors";
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(5000);
    char c;
    f.get(c);
    f.seekp(5000);
    f.put(static_cast<char>(c ^ 0x10));
  }
  std::filesystem::remove(copy("gone") + "rank0.safetensors");
  std::filesystem::remove(copy("noblob") + "client_state.bin");
  std::filesystem::remove(copy("nomanifest") + "manifest.json");
  std::filesystem::create_directories(dir + "/deepspeed");  // what DeepSpeed's save leaves
  std::ofstream(dir + "/deepspeed/mp_rank_00_model_states.pt") << "PK";
  copy("version", 99);
  FlipByteAfter(copy("mflip") + "manifest.json", "\"global_step\": ");
  struct Case {
    const char* tag;
    Status::Code code;
    const char* names;
  };
  const Case cases[] = {
      {"trunc", Status::Code::kCorruption, "trunc/rank0.safetensors"},
      {"flip", Status::Code::kCorruption, "flip/rank0.safetensors"},
      {"gone", Status::Code::kNotFound, "gone/rank0.safetensors"},
      {"noblob", Status::Code::kNotFound, "noblob/client_state.bin"},
      {"nomanifest", Status::Code::kNotFound, "nomanifest/manifest.json"},
      {"deepspeed", Status::Code::kNotFound, "deepspeed is a checkpoint DeepSpeed wrote"},
      {"version", Status::Code::kFailedPrecondition, "format version 99"},
      {"mflip", Status::Code::kCorruption, "mflip/manifest.json: manifest: checksum mismatch"},
      {"missing", Status::Code::kNotFound, "missing does not exist"},
  };
  for (const Case& c : cases) {
    Status st = LoadSolo(dir, c.tag);
    EXPECT_EQ(st.code(), c.code) << c.tag << ": " << st.ToString();
    EXPECT_NE(st.ToString().find(c.names), std::string::npos) << c.tag << ": " << st.ToString();
    auto v = ckpt::VerifyCheckpoint(dir, c.tag);
    EXPECT_FALSE(v.ok()) << c.tag;
  }
  EXPECT_TRUE(ckpt::VerifyCheckpoint(dir, "good").ok());
  std::filesystem::remove_all(dir);
}

// A rank file whose header is damaged is refused before the load changes anything: the engine
// stays usable and then loads a good checkpoint (it used to fail half-way, and the engine with
// it, so that it refused even the good one).
TEST(Checkpoint, DamagedHeaderLeavesTheEngineUsable) {
  const std::string dir = UniqueTestDir("ckpt_header");
  SaveSolo(dir, "good");
  std::filesystem::copy(dir + "/good", dir + "/hflip", std::filesystem::copy_options::recursive);
  RewriteManifest(dir, "hflip", [](ckpt::Manifest* m) { m->tag = "hflip"; });
  FlipByteAfter(dir + "/hflip/rank0.safetensors", "\"shape\":[");
  RunSpec s;
  s.config_json = Config(kSolo);
  s.steps = 1;
  Status bad, good;
  s.init = [&](int, Engine& e) -> Status {
    bad = e.Load(dir, "hflip");
    good = e.Load(dir, "good");
    return Status::OK();
  };
  RunResult r = RunEngine(s);
  EXPECT_EQ(bad.code(), Status::Code::kCorruption) << bad.ToString();
  EXPECT_NE(bad.ToString().find("hflip/rank0.safetensors"), std::string::npos) << bad.ToString();
  EXPECT_TRUE(good.ok()) << good.ToString();
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();  // and it trains on
  std::filesystem::remove_all(dir);
}

// The manifest is checksummed too: damaged as it lands (FlipByteEnv: one digit of the step
// changed on disk just before its fsync, the save then completing), the checkpoint is refused at
// load and by VerifyCheckpoint, naming the manifest.
TEST(CheckpointManifest, DamagedAsItLandsIsRefusedNamingTheFile) {
  const std::string dir = UniqueTestDir("ckpt_manifest_flip");
  FlipByteEnv flip("/" + std::string(ckpt::kManifestName), "\"global_step\": ");
  SaveSolo(dir, "t", &flip);
  ASSERT_TRUE(flip.flipped());
  const std::string manifest = dir + "/t/" + ckpt::kManifestName;
  for (const Status& st : {LoadSolo(dir, ""), ckpt::VerifyCheckpoint(dir, "").status()}) {
    EXPECT_EQ(st.code(), Status::Code::kCorruption) << st.ToString();
    EXPECT_NE(st.ToString().find(manifest + ": manifest: checksum mismatch"), std::string::npos)
        << st.ToString();
  }
  std::filesystem::remove_all(dir);
}

// A manifest cut short (or not JSON at all) is named as such, not as some other shape.
TEST(CheckpointManifest, TruncatedIsNotValidJson) {
  for (const char* text : {"{", "", "{\"tag\": \"a\""}) {
    auto m = ckpt::Manifest::FromJson(text);
    ASSERT_FALSE(m.ok()) << text;
    EXPECT_EQ(m.status().code(), Status::Code::kCorruption);
    EXPECT_NE(m.status().ToString().find("not valid JSON"), std::string::npos)
        << m.status().ToString();
  }
  auto m = ckpt::Manifest::FromJson("[1, 2]");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().ToString().find("not a JSON object"), std::string::npos);
}

// Any one byte of a sealed manifest changed (each byte XORed with 1 in turn) is refused, as
// Corruption; the text as written loads.
TEST(CheckpointManifest, EveryFlippedByteIsRefused) {
  const std::string dir = UniqueTestDir("ckpt_manifest_bytes");
  SaveSolo(dir, "t");
  const std::string text = *ckpt::ReadWholeFile(dir + "/t/" + ckpt::kManifestName);
  ASSERT_TRUE(ckpt::Manifest::FromJson(text).ok());
  ASSERT_NE(text.find("\"manifest_xxh3\": \""), std::string::npos) << text;
  size_t accepted = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    std::string t = text;
    t[i] ^= 1;
    auto m = ckpt::Manifest::FromJson(t);
    if (m.ok() || !m.status().IsCorruption()) {
      ++accepted;
      ADD_FAILURE() << "byte " << i << " ('" << text[i] << "'): " << m.status().ToString();
    }
  }
  EXPECT_EQ(accepted, 0u) << "of " << text.size() << " bytes";
  std::filesystem::remove_all(dir);
}

// Checkpoints written before the manifest had a checksum (format version 1: no
// "manifest_xxh3") still load and verify; a version 2 manifest without one is refused, and one
// with a checksum is checked whatever version it claims.
TEST(CheckpointManifest, VersionOneWithoutChecksumStillLoads) {
  const std::string dir = UniqueTestDir("ckpt_manifest_v1");
  SaveSolo(dir, "t");
  RewriteManifest(dir, "t", [](ckpt::Manifest* m) { m->format_version = 1; });
  const std::string path = dir + "/t/" + ckpt::kManifestName;
  const std::string v1 = *ckpt::ReadWholeFile(path);
  EXPECT_EQ(v1.find("manifest_xxh3"), std::string::npos) << v1;
  EXPECT_TRUE(LoadSolo(dir, "").ok());
  auto verified = ckpt::VerifyCheckpoint(dir, "");
  ASSERT_TRUE(verified.ok()) << verified.status().ToString();
  EXPECT_EQ(verified->format_version, 1);

  std::string v2 = v1;  // claims version 2, has no checksum
  const std::string from = "\"format_version\": 1";
  v2.replace(v2.find(from), from.size(), "\"format_version\": 2");
  auto m = ckpt::Manifest::FromJson(v2);
  EXPECT_TRUE(m.status().IsCorruption()) << m.status().ToString();
  EXPECT_NE(m.status().ToString().find("no \"manifest_xxh3\""), std::string::npos)
      << m.status().ToString();

  ckpt::Manifest sealed = *verified;  // a sealed manifest edited to claim version 1
  sealed.format_version = 2;
  std::string claims_v1 = sealed.ToJson();
  const std::string two = "\"format_version\": 2";
  claims_v1.replace(claims_v1.find(two), two.size(), "\"format_version\": 1");
  m = ckpt::Manifest::FromJson(claims_v1);
  EXPECT_TRUE(m.status().IsCorruption()) << m.status().ToString();
  std::filesystem::remove_all(dir);
}

// A format-1 manifest has no checksum (and a sealed one can be re-sealed): its model description
// must add up on its own, since zero_to_fp32, export and reshard size what they write from it. A
// numel, a shape or a shard size that disagree is Corruption naming the group, never a
// checkpoint that verifies and reads back shifted or zero-filled values.
TEST(CheckpointManifest, AModelDescriptionThatDoesNotAddUpIsCorruption) {
  const std::string dir = UniqueTestDir("ckpt_manifest_layout");
  SaveSolo(dir, "t");
  const std::string path = dir + "/t/" + ckpt::kManifestName;
  auto good = ckpt::Manifest::FromJson(*ckpt::ReadWholeFile(path));
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  good->format_version = 1;
  const std::vector<std::pair<std::string, std::function<void(ckpt::Manifest*)>>> edits = {
      {"numel says", [](ckpt::Manifest* m) { m->groups[0].numel -= 1; }},
      {"numel says", [](ckpt::Manifest* m) { m->groups[0].params[0].shape[0] -= 1; }},
      {"out of range", [](ckpt::Manifest* m) { m->groups[0].params[0].shape[0] = -1; }},
      {"out of range",
       [](ckpt::Manifest* m) {
         m->groups[0].params[0].shape = {int64_t{1} << 40, 1 << 20};
       }},
      {"shard_elems", [](ckpt::Manifest* m) { m->groups[0].shard_elems += 128; }}};
  for (const auto& [needle, edit] : edits) {
    ckpt::Manifest m = *good;
    edit(&m);
    auto read = ckpt::Manifest::FromJson(m.ToJson());
    EXPECT_TRUE(read.status().IsCorruption()) << needle << ": " << read.status().ToString();
    EXPECT_NE(read.status().ToString().find("group '" + m.groups[0].name + "'"), std::string::npos)
        << read.status().ToString();
    EXPECT_NE(read.status().ToString().find(needle), std::string::npos) << read.status().ToString();
  }
  EXPECT_TRUE(ckpt::Manifest::FromJson(good->ToJson()).ok());
  std::filesystem::remove_all(dir);
}

// The small files a checkpoint directory names are read only when they are regular files: a
// FIFO blocked every reader forever, /dev/zero grew without end. "latest" written with "\r\n"
// or blanks around the tag names it, as the Python readers and DeepSpeed strip it.
TEST(CheckpointManifest, OnlyRegularFilesAreReadAndLatestIsStripped) {
  const std::string dir = UniqueTestDir("ckpt_small_files");
  SaveSolo(dir, "t");
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto r = ckpt::ReadWholeFile(fifo);
  EXPECT_TRUE(r.status().IsInvalidArgument()) << r.status().ToString();
  EXPECT_NE(r.status().ToString().find("not a regular file"), std::string::npos);
  EXPECT_TRUE(ckpt::ReadWholeFile("/dev/zero").status().IsInvalidArgument());
  EXPECT_TRUE(ckpt::ReadWholeFile(dir + "/t/" + ckpt::kManifestName, 16).status().IsCorruption());
  std::ofstream(dir + "/latest", std::ios::trunc) << "  t\r\n";
  auto tag = ckpt::ResolveTag(dir, "");
  ASSERT_TRUE(tag.ok()) << tag.status().ToString();
  EXPECT_EQ(*tag, "t");
  std::ofstream(dir + "/latest", std::ios::trunc) << "..\n";
  EXPECT_TRUE(ckpt::ResolveTag(dir, "").status().IsCorruption());
  std::filesystem::remove(dir + "/latest");
  ASSERT_EQ(::mkfifo((dir + "/latest").c_str(), 0600), 0);
  auto blocked = ckpt::ResolveTag(dir, "");
  EXPECT_TRUE(blocked.status().IsInvalidArgument()) << blocked.status().ToString();
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, RefusesOtherModelOrPrecision) {
  const std::string dir = UniqueTestDir("ckpt_compat");
  SaveSolo(dir, "t");
  ModelSpec other = TestModel();
  other.groups[2].params[0].shape = {41, 32};
  other.groups[4].params[1].name = "bias2";
  Status st = LoadSolo(dir, "t", kSolo, other);
  EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.ToString().find("mid.W1: [40,32] in the checkpoint, [41,32] in the model"),
            std::string::npos)
      << st.ToString();
  EXPECT_NE(st.ToString().find("top.b2[36] is in the checkpoint, not in the model"),
            std::string::npos)
      << st.ToString();
  EXPECT_NE(st.ToString().find("top.bias2[36] is in the model, not in the checkpoint"),
            std::string::npos)
      << st.ToString();
  // A module added in the middle: named alone, not every group after it.
  ModelSpec added = TestModel();
  added.groups.insert(added.groups.begin() + 1, GroupSpec{"extra", {{"w", {8}}}});
  st = LoadSolo(dir, "t", kSolo, added);
  EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.ToString().find("extra.w[8] is in the model, not in the checkpoint"),
            std::string::npos)
      << st.ToString();
  EXPECT_EQ(st.ToString().find("in the checkpoint, not"), std::string::npos) << st.ToString();
  // A module's parameter moved out of its "<module>#frozen" group (a PEFT unfreeze): named by
  // the parameter's own name, the same on both sides, and reported as moved between groups.
  {
    ModelSpec split = TestModel();
    GroupSpec frozen = split.groups[4];
    frozen.name = split.groups[4].name + "#frozen";
    frozen.trainable = false;
    frozen.params.resize(1);
    for (ParamSpec& p : split.groups[4].params) p.name = split.groups[4].name + "." + p.name;
    frozen.params[0].name = split.groups[4].params[1].name;
    frozen.params[0].shape = split.groups[4].params[1].shape;
    split.groups[4].params.pop_back();
    split.groups.push_back(frozen);
    const std::string sdir = UniqueTestDir("ckpt_frozen_split");
    RunSpec save;
    save.config_json = Config(kSolo);
    save.steps = 0;
    save.model = split;
    Status saved;
    save.init = [&](int, Engine& e) -> Status {
      saved = e.Save(sdir, "t", Blob("blob"));
      return Status::OK();
    };
    (void)RunEngine(save);
    ASSERT_TRUE(saved.ok()) << saved.ToString();
    ModelSpec unfrozen = split;
    unfrozen.groups[4].params.push_back(frozen.params[0]);
    unfrozen.groups.pop_back();
    st = LoadSolo(sdir, "t", kSolo, unfrozen);
    EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
    EXPECT_EQ(st.ToString().find("not in the"), std::string::npos) << st.ToString();
    EXPECT_NE(st.ToString().find("in other groups or another order"), std::string::npos)
        << st.ToString();
    // The group both sides name alike is shown with its parameters on each side.
    EXPECT_NE(st.ToString().find("in the checkpoint, '" + split.groups[4].params[0].name + "', '" +
                                 frozen.params[0].name + "' in the model"),
              std::string::npos)
        << st.ToString();
    std::filesystem::remove_all(sdir);
  }
  // The same parameters in another group order: named as that.
  ModelSpec swapped = TestModel();
  std::swap(swapped.groups[0], swapped.groups[1]);
  st = LoadSolo(dir, "t", kSolo, swapped);
  EXPECT_NE(st.ToString().find("in other groups or another order: group 0"), std::string::npos)
      << st.ToString();
  st = LoadSolo(dir, "t", Placement{3, "cpu", "cpu", 1, "fp16"});
  EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.ToString().find("precision"), std::string::npos) << st.ToString();
  std::filesystem::remove_all(dir);
}

// A run of `pl` whose group kMid (and `also`, when given) is frozen.
RunSpec FrozenRun(const Placement& pl, int steps, std::optional<size_t> also = std::nullopt) {
  RunSpec s;
  s.config_json = Config(pl);
  s.world = pl.world;
  s.steps = steps;
  s.model = TestModel();
  s.model->groups[kMid].trainable = false;
  if (also) s.model->groups[*also].trainable = false;
  return s;
}

// SaveOptions::exclude_frozen (DeepSpeed's exclude_frozen_parameters, which transformers' Trainer
// asks for at every save of a PEFT model): nothing of the frozen group is in the files; a Load
// without LoadOptions::keep_excluded is refused naming it and changes nothing; with it the engine
// keeps its own values for the group (those the run started from) and training continues bit for
// bit. An offline reshard keeps the group out, and its result loads as the whole checkpoint does.
TEST(CheckpointExcludeFrozen, TrainedStateOnlyResumesBitForBitKeepingTheFrozenValues) {
  for (const Placement& pl :
       {Placement{3, "nvme", "nvme", 2, "bf16"}, Placement{2, "cpu", "none", 2, "fp32"},
        Placement{0, "none", "none", 1, "fp16"}}) {
    SCOPED_TRACE(Name(pl));
    const std::string dir = UniqueTestDir("ckpt_excl");
    const std::string lean = dir + "/lean", whole = dir + "/whole";
    const RunSpec base = FrozenRun(pl, 5);
    const RunResult full = RunEngine(base);
    ASSERT_TRUE(full.status.ok()) << full.status.ToString();

    RunSpec first = base;
    first.steps = 3;
    first.after_step = [&](int, int step, Engine& e) -> Status {
      if (step != 2) return Status::OK();
      SaveOptions o;
      o.exclude_frozen = true;
      STRATA_RETURN_IF_ERROR(e.Save(lean, "s3", o, Blob("lean")));
      return e.Save(whole, "s3", SaveOptions{}, Blob("whole"));
    };
    const RunResult part = RunEngine(first);
    ASSERT_TRUE(part.status.ok()) << part.status.ToString();
    auto ml = ckpt::VerifyCheckpoint(lean, "");
    auto mw = ckpt::VerifyCheckpoint(whole, "");
    ASSERT_TRUE(ml.ok() && mw.ok()) << ml.status().ToString() << mw.status().ToString();
    for (size_t g = 0; g < kGroups; ++g) {
      EXPECT_EQ(ml->groups[g].excluded, g == kMid) << g;
      EXPECT_FALSE(mw->groups[g].excluded) << g;
      EXPECT_EQ(ml->groups[g].fingerprint != 0, g == kMid) << g;
    }
    EXPECT_EQ(ml->groups[kMid].fingerprint, mw->groups[kMid].fingerprint);
    uint64_t lean_bytes = 0, whole_bytes = 0;
    for (const auto& f : ml->files) lean_bytes += f.size_bytes;
    for (const auto& f : mw->files) whole_bytes += f.size_bytes;
    const uint64_t frozen_bytes = ml->groups[kMid].numel * ml->ElemBytes(0);
    EXPECT_LE(lean_bytes + frozen_bytes, whole_bytes);
    {
      ckpt::RangeReader rd(lean + "/s3", *ml);
      std::vector<float> out(8);
      const Status st = rd.ReadFp32(kMid, 0, 8, out.data());
      EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
      EXPECT_NE(st.ToString().find("left out at save"), std::string::npos) << st.ToString();
    }

    // Without keep_excluded: refused, naming the group and the option; nothing changed.
    RunSpec fresh = base;
    fresh.steps = 0;
    const RunResult initial = RunEngine(fresh);
    ASSERT_TRUE(initial.status.ok()) << initial.status.ToString();
    RunSpec refused = fresh;
    std::vector<Status> refusals(pl.world);
    refused.after_init = [&](int r, Engine& e) -> Status {
      refusals[r] = e.Load(lean, "");
      return Status::OK();
    };
    const RunResult unchanged = RunEngine(refused);
    ASSERT_TRUE(unchanged.status.ok()) << unchanged.status.ToString();
    // With keep_excluded into a model whose frozen values are not the run's (another base):
    // refused by their fingerprint, naming the group; nothing changed either.
    RunSpec other_base = fresh;
    std::vector<Status> others(pl.world);
    other_base.init = [&](int r, Engine& e) -> Status {
      STRATA_RETURN_IF_ERROR(e.InitParameters([](size_t, size_t, size_t b, size_t end, float* o) {
        for (size_t i = b; i < end; ++i) o[i - b] = 0.5f - 0.001f * static_cast<float>(i % 97);
      }));
      LoadOptions o;
      o.keep_excluded = true;
      others[r] = e.Load(lean, "", nullptr, o);
      return Status::OK();
    };
    const RunResult kept = RunEngine(other_base);
    ASSERT_TRUE(kept.status.ok()) << kept.status.ToString();
    for (const Status& st : others) {
      EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
      EXPECT_NE(st.ToString().find("1 frozen group(s) whose values in this model are not the ones "
                                   "the saving run started from: 'mid'"),
                std::string::npos)
          << st.ToString();
    }
    EXPECT_EQ(kept.master[kEmbed][3], 0.5f - 0.001f * 3.0f);
    for (const Status& st : refusals) {
      EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
      EXPECT_NE(st.ToString().find("1 frozen group(s)"), std::string::npos) << st.ToString();
      EXPECT_NE(st.ToString().find("'mid'"), std::string::npos) << st.ToString();
      EXPECT_NE(st.ToString().find("keep_excluded"), std::string::npos) << st.ToString();
      EXPECT_NE(st.ToString().find("load_module_strict=False"), std::string::npos) << st.ToString();
    }
    EXPECT_TRUE(BitEqual(unchanged.master, initial.master));

    // With keep_excluded: the trained state from the checkpoint, the frozen group's own values.
    RunSpec resume = base;
    resume.first_step = 3;
    std::vector<std::string> blobs(pl.world);
    resume.after_init = [&](int r, Engine& e) -> Status {
      std::vector<uint8_t> blob;
      LoadOptions o;
      o.keep_excluded = true;
      STRATA_RETURN_IF_ERROR(e.Load(lean, "", &blob, o));
      blobs[r].assign(blob.begin(), blob.end());
      return Status::OK();
    };
    const RunResult resumed = RunEngine(resume);
    ASSERT_TRUE(resumed.status.ok()) << resumed.status.ToString();
    for (const std::string& b : blobs) EXPECT_EQ(b, "lean");
    EXPECT_TRUE(BitEqual(full.master, resumed.master)) << "resumed run diverged";

    if (pl.world == 2) {
      // Resharded to one rank at stage 1: still without the group; loads as the whole one.
      auto n = ckpt::ReshardCheckpoint(lean, "", {1, 1, ""}, dir + "/lean1");
      ASSERT_TRUE(n.ok()) << n.status().ToString();
      EXPECT_TRUE(n->groups[kMid].excluded);
      auto load_at_one = [&](const std::string& from, bool keep) {
        RunSpec s = fresh;
        s.config_json = Config({1, "cpu", "none", 1, pl.precision});
        s.world = 1;
        s.after_init = [&, keep](int, Engine& e) -> Status {
          LoadOptions o;
          o.keep_excluded = keep;
          return e.Load(from, "", nullptr, o);
        };
        return RunEngine(s);
      };
      const RunResult a = load_at_one(whole, false), b = load_at_one(dir + "/lean1", true);
      ASSERT_TRUE(a.status.ok() && b.status.ok()) << a.status.ToString() << b.status.ToString();
      EXPECT_TRUE(BitEqual(a.master, b.master));
      // The lean one itself, resharded on load (each rank reads other ranks' files).
      const RunResult c = load_at_one(lean, true);
      ASSERT_TRUE(c.status.ok()) << c.status.ToString();
      EXPECT_TRUE(BitEqual(a.master, c.master));
      // Converted to another precision: the fingerprints (of values rounded to the old one) go,
      // and the group is kept unchecked by an engine of the new precision.
      const char* other = std::string(pl.precision) == "fp32" ? "bf16" : "fp32";
      auto conv = ckpt::ReshardCheckpoint(lean, "", {1, 1, other}, dir + "/lean_conv");
      ASSERT_TRUE(conv.ok()) << conv.status().ToString();
      EXPECT_EQ(conv->groups[kMid].fingerprint, 0u);
      RunSpec s = fresh;
      s.config_json = Config({1, "cpu", "none", 1, other});
      s.world = 1;
      s.after_init = [&](int, Engine& e) -> Status {
        LoadOptions o;
        o.keep_excluded = true;
        return e.Load(dir + "/lean_conv", "", nullptr, o);
      };
      const RunResult d = RunEngine(s);
      ASSERT_TRUE(d.status.ok()) << d.status.ToString();
    }
    std::filesystem::remove_all(dir);
  }
}

// A frozen group written during the run (WriteParams: DeepSpeed's GatheredParameters with a
// modifier rank, a LoRA fused into its base) has values nothing else holds: exclude_frozen saves
// it whole, marked "changed", and an engine that loads it keeps saving it whole.
TEST(CheckpointExcludeFrozen, AFrozenGroupWrittenDuringTheRunIsSavedWhole) {
  const std::string dir = UniqueTestDir("ckpt_excl_written");
  const RunSpec base = FrozenRun({3, "cpu", "cpu", 2, "fp32"}, 1, kMidBias);
  const float kWritten = 0.25f;
  auto lean = [](Engine& e, const std::string& to) {
    SaveOptions o;
    o.exclude_frozen = true;
    return e.Save(to, "t", o);
  };
  RunSpec written = base;
  written.after_step = [&](int, int, Engine& e) -> Status {
    const size_t g[] = {kMid};
    STRATA_RETURN_IF_ERROR(
        e.WriteParams(g, [&](size_t, size_t, size_t b, size_t end, float* out) -> Status {
          std::fill(out, out + (end - b), kWritten);
          return Status::OK();
        }));
    return lean(e, dir + "/a");
  };
  const RunResult r = RunEngine(written);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  auto m = ckpt::VerifyCheckpoint(dir + "/a", "");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_FALSE(m->groups[kMid].excluded);
  EXPECT_TRUE(m->groups[kMid].changed);
  EXPECT_TRUE(m->groups[kMidBias].excluded);
  EXPECT_FALSE(m->groups[kMidBias].changed);
  // Loaded into a fresh engine (its initial values for both frozen groups): the written values
  // come from the checkpoint, and its own lean save keeps them.
  RunSpec again = base;
  again.steps = 0;
  again.after_init = [&](int, Engine& e) -> Status {
    LoadOptions o;
    o.keep_excluded = true;
    STRATA_RETURN_IF_ERROR(e.Load(dir + "/a", "", nullptr, o));
    return lean(e, dir + "/b");
  };
  const RunResult a = RunEngine(again);
  ASSERT_TRUE(a.status.ok()) << a.status.ToString();
  ASSERT_EQ(a.master[kMid].size(), r.master[kMid].size());
  for (float v : a.master[kMid]) ASSERT_EQ(v, kWritten);
  auto mb = ckpt::VerifyCheckpoint(dir + "/b", "");
  ASSERT_TRUE(mb.ok()) << mb.status().ToString();
  EXPECT_TRUE(mb->groups[kMid].changed && !mb->groups[kMid].excluded);
  EXPECT_TRUE(mb->groups[kMidBias].excluded);
  std::filesystem::remove_all(dir);
}

// Every rank lays its file out as rank 0's manifest says: ranks that disagree on exclude_frozen
// are refused on every rank, and nothing is saved.
// The refusal comes before anything on disk changes: with keep_last the checkpoint the save would
// have retired keeps its files, and no unfinished save is left behind.
TEST(CheckpointExcludeFrozen, RanksThatDisagreeSaveNothing) {
  const std::string dir = UniqueTestDir("ckpt_excl_disagree");
  RunSpec s = FrozenRun({2, "cpu", "none", 2, "bf16"}, 1);
  std::vector<Status> saved(2);
  s.after_step = [&](int r, int, Engine& e) -> Status {
    SaveOptions o;
    o.keep_last = 2;
    STRATA_RETURN_IF_ERROR(e.Save(dir, "a", o));
    STRATA_RETURN_IF_ERROR(e.Save(dir, "b", o));
    o.exclude_frozen = r == 1;
    saved[r] = e.Save(dir, "t", o);
    return Status::OK();
  };
  const RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  for (const Status& st : saved) {
    EXPECT_EQ(st.code(), Status::Code::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.ToString().find("disagree on exclude_frozen (rank 0: false, rank 1: true)"),
              std::string::npos)
        << st.ToString();
  }
  auto latest = ckpt::ResolveTag(dir, "");
  ASSERT_TRUE(latest.ok()) << latest.status().ToString();
  EXPECT_EQ(*latest, "b");
  for (const char* tag : {"a", "b"}) {
    auto m = ckpt::VerifyCheckpoint(dir, tag);
    EXPECT_TRUE(m.ok()) << tag << ": " << m.status().ToString();
  }
  EXPECT_FALSE(ckpt::PathExists(dir + "/t"));
  EXPECT_FALSE(ckpt::PathExists(dir + "/t.tmp"));
  std::filesystem::remove_all(dir);
}

// The values an engine keeps for a group a lean checkpoint left out must be those the saving run
// started from. Refused, nothing changed: a group this engine wrote after the save (a LoRA fused
// for an evaluation, then a rollback), whose fingerprint it no longer knows. Kept unchecked, and
// saved without a fingerprint: values loaded whole from a checkpoint without one (a precision
// conversion), which are no longer those the engine fingerprinted at its start.
TEST(CheckpointExcludeFrozen, ValuesWrittenOrLoadedSinceTheStartAreNotTakenForTheStartingOnes) {
  const std::string dir = UniqueTestDir("ckpt_excl_since");
  const RunSpec base = FrozenRun({2, "cpu", "none", 2, "fp32"}, 1);
  const float kWritten = 0.25f;
  std::vector<Status> rollback(2);
  RunSpec written = base;
  written.after_step = [&](int r, int, Engine& e) -> Status {
    SaveOptions o;
    o.exclude_frozen = true;
    STRATA_RETURN_IF_ERROR(e.Save(dir + "/lean", "t", o));
    STRATA_RETURN_IF_ERROR(e.Save(dir + "/whole", "t", SaveOptions{}));
    const size_t g[] = {kMid};
    STRATA_RETURN_IF_ERROR(
        e.WriteParams(g, [&](size_t, size_t, size_t b, size_t end, float* out) -> Status {
          std::fill(out, out + (end - b), kWritten);
          return Status::OK();
        }));
    LoadOptions keep;
    keep.keep_excluded = true;
    rollback[r] = e.Load(dir + "/lean", "", nullptr, keep);
    return Status::OK();
  };
  const RunResult w = RunEngine(written);
  ASSERT_TRUE(w.status.ok()) << w.status.ToString();
  for (const Status& st : rollback) {
    EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.ToString().find("has written since it started"), std::string::npos)
        << st.ToString();
    EXPECT_NE(st.ToString().find("'mid'"), std::string::npos) << st.ToString();
  }
  for (float v : w.master[kMid]) ASSERT_EQ(v, kWritten);

  // The whole checkpoint converted to bf16 (no fingerprints), loaded by a bf16 engine built from
  // other values, which then saves lean: no fingerprint for the group, where the old code wrote
  // that of the values the load replaced.
  auto conv = ckpt::ReshardCheckpoint(dir + "/whole", "", {2, 2, "bf16"}, dir + "/conv");
  ASSERT_TRUE(conv.ok()) << conv.status().ToString();
  ASSERT_EQ(conv->groups[kMid].fingerprint, 0u);
  RunSpec other = FrozenRun({2, "cpu", "none", 2, "bf16"}, 0);
  other.init = [&](int, Engine& e) -> Status {
    STRATA_RETURN_IF_ERROR(e.InitParameters([](size_t, size_t, size_t b, size_t end, float* o) {
      for (size_t i = b; i < end; ++i) o[i - b] = 0.5f - 0.001f * static_cast<float>(i % 97);
    }));
    STRATA_RETURN_IF_ERROR(e.Load(dir + "/conv", ""));
    SaveOptions o;
    o.exclude_frozen = true;
    return e.Save(dir + "/lean2", "t", o);
  };
  const RunResult c = RunEngine(other);
  ASSERT_TRUE(c.status.ok()) << c.status.ToString();
  auto m2 = ckpt::VerifyCheckpoint(dir + "/lean2", "");
  ASSERT_TRUE(m2.ok()) << m2.status().ToString();
  EXPECT_TRUE(m2->groups[kMid].excluded);
  EXPECT_EQ(m2->groups[kMid].fingerprint, 0u);
  std::filesystem::remove_all(dir);
}

// Resharding on load: a checkpoint saved at 2 ranks, stage 3 with NVMe state goes through 1 rank
// stage 0 and 3 ranks stage 1 (each loads it, checks the masters are the saved bits, and saves
// again), then back to 2 ranks stage 3, and training continues bit for bit as the run that was
// never resharded: every state (params, masters, Adam m and v, counters) survived both reshards
// exactly. The same world size at another stage continues bit for bit directly.
TEST(CheckpointReshard, RoundTripThroughOtherWorldSizesAndStagesIsExact) {
  const std::string dir = UniqueTestDir("ckpt_reshard");
  const Placement home{3, "nvme", "nvme", 2, "bf16"};
  RunSpec base;
  base.config_json = Config(home);
  base.world = 2;
  base.steps = 6;
  RunResult full = RunEngine(base);
  ASSERT_TRUE(full.status.ok()) << full.status.ToString();
  RunSpec first = base;
  first.steps = 3;
  first.after_step = [&](int, int step, Engine& e) -> Status {
    return step == 2 ? e.Save(dir, "w2s3") : Status::OK();
  };
  RunResult part = RunEngine(first);
  ASSERT_TRUE(part.status.ok()) << part.status.ToString();

  auto hop = [&](const Placement& pl, const std::string& from, const std::string& to) {
    RunSpec s;
    s.config_json = Config(pl);
    s.world = pl.world;
    s.steps = 0;
    s.init = [&](int, Engine& e) -> Status {
      STRATA_RETURN_IF_ERROR(e.Load(dir, from));
      if (e.global_step() != 3) return Status::Internal("global_step not restored");
      return e.Save(dir, to);
    };
    RunResult r = RunEngine(s);
    ASSERT_TRUE(r.status.ok()) << Name(pl) << ": " << r.status.ToString();
    EXPECT_TRUE(BitEqual(r.master, part.master)) << Name(pl) << ": masters changed";
    auto m = ckpt::VerifyCheckpoint(dir, to);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(m->world_size, pl.world);
    EXPECT_EQ(m->stage, pl.stage);
  };
  hop(Placement{0, "none", "none", 1, "bf16"}, "w2s3", "w1s0");
  hop(Placement{1, "cpu", "none", 3, "bf16"}, "w1s0", "w3s1");

  for (const Placement& pl : {home, Placement{1, "cpu", "none", 2, "bf16"}}) {
    RunSpec resume = base;
    resume.config_json = Config(pl);
    resume.first_step = 3;
    const std::string from = pl.stage == 3 ? "w3s1" : "w2s3";
    resume.init = [&](int, Engine& e) -> Status { return e.Load(dir, from); };
    RunResult resumed = RunEngine(resume);
    ASSERT_TRUE(resumed.status.ok()) << resumed.status.ToString();
    EXPECT_TRUE(BitEqual(full.master, resumed.master))
        << Name(pl) << " from " << from << " diverged";
  }
  std::filesystem::remove_all(dir);
}

// The issue's resharding test: saved at 4 ranks, stage 3, optimizer and params on NVMe; loaded at
// 2 ranks stage 1 (2 micro-steps per step) and at 1 rank stage 0 (4 micro-steps), so every step
// still trains on the same 4 samples; 3 more steps then match the run that stayed at 4 ranks
// within the equivalence tolerance (fp32: 1e-4 of the distance those steps moved the weights;
// only the summation order differs).
TEST(CheckpointReshard, FourRanksStage3NvmeToTwoRanksStage1AndOneRankStage0) {
  const std::string dir = UniqueTestDir("ckpt_reshard4");
  const Placement home{3, "nvme", "nvme", 4, "fp32"};
  RunSpec base;
  base.config_json = Config(home);
  base.world = 4;
  base.steps = 6;
  RunResult full = RunEngine(base);
  ASSERT_TRUE(full.status.ok()) << full.status.ToString();
  RunSpec first = base;
  first.steps = 3;
  first.after_step = [&](int, int step, Engine& e) -> Status {
    return step == 2 ? e.Save(dir, "w4s3") : Status::OK();
  };
  RunResult part = RunEngine(first);
  ASSERT_TRUE(part.status.ok()) << part.status.ToString();
  const double moved = MaxAbsDiff(full.master, part.master);
  ASSERT_GT(moved, 1e-3);
  for (const Placement& pl :
       {Placement{1, "cpu", "none", 2, "fp32"}, Placement{0, "none", "none", 1, "fp32"}}) {
    RunSpec resume = base;
    resume.world = pl.world;
    resume.gas = 4 / pl.world;
    resume.config_json = Config(pl);
    const std::string gas1 = "\"gradient_accumulation_steps\": 1";
    resume.config_json.replace(resume.config_json.find(gas1), gas1.size(),
                               "\"gradient_accumulation_steps\": " + std::to_string(resume.gas));
    resume.data_key = [&](int r, int micro) {
      return std::pair<int, int>{0, micro * pl.world + r};
    };
    resume.first_step = 3;
    resume.init = [&](int, Engine& e) -> Status {
      STRATA_RETURN_IF_ERROR(e.Load(dir, "w4s3"));
      return e.global_step() == 3 ? Status::OK() : Status::Internal("global_step not restored");
    };
    RunResult resumed = RunEngine(resume);
    ASSERT_TRUE(resumed.status.ok()) << Name(pl) << ": " << resumed.status.ToString();
    const double err = MaxAbsDiff(resumed.master, full.master);
    std::printf("%s: max difference to the 4-rank run %.3g (the last 3 steps moved %.3g)\n",
                Name(pl).c_str(), err, moved);
    EXPECT_LT(err, 1e-4 * moved + 1e-7) << Name(pl);
  }
  std::filesystem::remove_all(dir);
}

// Offline resharding (ckpt::ReshardCheckpoint, `offloadctl ckpt reshard`): a 2-rank stage-3
// checkpoint rewritten for 3 ranks stage 1 and for 1 rank stage 0 verifies, each rank file holds
// the new shards, and training resumed from either continues bit for bit as the run that never
// resharded (same world size here: through 3 ranks and back).
TEST(CheckpointReshard, OfflineReshardLoadsAndContinuesExactly) {
  const std::string dir = UniqueTestDir("ckpt_offline");
  const Placement home{3, "nvme", "nvme", 2, "bf16"};
  RunSpec base;
  base.config_json = Config(home);
  base.world = 2;
  base.steps = 5;
  RunResult full = RunEngine(base);
  ASSERT_TRUE(full.status.ok()) << full.status.ToString();
  RunSpec first = base;
  first.steps = 3;
  first.after_step = [&](int, int step, Engine& e) -> Status {
    return step == 2 ? e.Save(dir + "/w2", "t", Blob("pos")) : Status::OK();
  };
  ASSERT_TRUE(RunEngine(first).status.ok());
  auto w3 = ckpt::ReshardCheckpoint(dir + "/w2", "", {3, 1, ""}, dir + "/w3");
  ASSERT_TRUE(w3.ok()) << w3.status().ToString();
  EXPECT_EQ(w3->world_size, 3);
  EXPECT_EQ(w3->stage, 1);
  auto v3 = ckpt::VerifyCheckpoint(dir + "/w3", "");
  ASSERT_TRUE(v3.ok()) << v3.status().ToString();
  EXPECT_EQ(v3->files.size(), 4u);  // 3 ranks + the client state
  // Back to 2 ranks from the 3-rank copy: the same bytes as the original rank files.
  auto w2 = ckpt::ReshardCheckpoint(dir + "/w3", "t", {2, 3, ""}, dir + "/back");
  ASSERT_TRUE(w2.ok()) << w2.status().ToString();
  auto orig = ckpt::ReadManifest(dir + "/w2", "t");
  ASSERT_TRUE(orig.ok());
  for (int r = 0; r < 2; ++r) EXPECT_EQ(w2->files[r].xxh3, orig->files[r].xxh3) << "rank " << r;
  EXPECT_EQ(ckpt::ReshardCheckpoint(dir + "/w2", "", {5000, 1, ""}, dir + "/bad").status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(ckpt::ReshardCheckpoint(dir + "/w2", "", {3, 1, ""}, dir + "/w3").status().code(),
            Status::Code::kFailedPrecondition);
  // The 3-rank copy loads at 3 ranks (each rank its own file) with the saved masters.
  RunSpec at3;
  at3.config_json = Config(Placement{1, "cpu", "none", 3, "bf16"});
  at3.world = 3;
  at3.steps = 0;
  at3.init = [&](int, Engine& e) -> Status { return e.Load(dir + "/w3"); };
  RunResult r3 = RunEngine(at3);
  ASSERT_TRUE(r3.status.ok()) << r3.status.ToString();
  RunSpec resume = base;
  resume.first_step = 3;
  resume.init = [&](int, Engine& e) -> Status { return e.Load(dir + "/back"); };
  RunResult resumed = RunEngine(resume);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.ToString();
  EXPECT_TRUE(BitEqual(full.master, resumed.master)) << "resharded twice, then diverged";
  std::filesystem::remove_all(dir);
}

// Figures, not assertions: Save and Load MB/s of a model of STRATA_CKPT_BENCH_PARAMS elements
// (stage 3, optimizer and params on NVMe through the real IO backend, world 1, sub-groups of
// STRATA_CKPT_BENCH_SUB_GROUP elements, default 4M; 256 gives 1 KiB blocks) against the disk's
// O_DIRECT write and read rates measured in the same run on the same directory (nvme/bench: 1 MiB
// requests, 16 in flight). Skipped unless STRATA_CKPT_BENCH_PARAMS is set.
TEST(CheckpointThroughput, DISABLED_PrintsFigures) {
  const char* env = std::getenv("STRATA_CKPT_BENCH_PARAMS");
  if (env == nullptr) GTEST_SKIP() << "set STRATA_CKPT_BENCH_PARAMS=<elements> to measure";
  const int64_t n = std::atoll(env);
  const char* sg_env = std::getenv("STRATA_CKPT_BENCH_SUB_GROUP");
  const std::string sub_group = sg_env != nullptr ? sg_env : "4194304";
  ModelSpec m;
  for (int g = 0; g < 8; ++g) m.groups.push_back({"layer" + std::to_string(g), {{"w", {n / 8}}}});
  const std::string dir = UniqueTestDir("ckpt_bench");
  RunSpec s;
  s.config_json = Config(Placement{3, "nvme", "nvme", 1, "bf16"});
  const std::string small = "\"sub_group_size\": 256";
  s.config_json.replace(s.config_json.find(small), small.size(),
                        "\"sub_group_size\": " + sub_group);
  if (const char* aio = std::getenv("STRATA_CKPT_BENCH_AIO"); aio != nullptr) {
    s.config_json.replace(s.config_json.find('{'), 1, std::string("{\"aio\": ") + aio + ",");
  }
  s.steps = 0;
  s.model = m;
  s.io = IoBackendKind::kAuto;
  s.device_budget = uint64_t{8} << 30;
  using Clock = std::chrono::steady_clock;
  double save_s = 0, load_s = 0;
  uint64_t bytes = 0, host_peak = 0, host_budget = 0;
  s.init = [&](int, Engine& e) -> Status {
    auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(e.Save(dir, "bench"));
    save_s = std::chrono::duration<double>(Clock::now() - t0).count();
    for (const auto& f : std::filesystem::directory_iterator(dir + "/bench"))
      bytes += f.file_size();
    t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(e.Load(dir, "bench"));
    load_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const EngineStats st = e.Stats();
    host_peak = st.store.peak_bytes[Tier::kHost];
    host_budget = st.store.budget_bytes[Tier::kHost];
    return Status::OK();
  };
  RunEngine(s);  // its read-back of TestModel's groups fails on this model: ignored
  ASSERT_GT(save_s, 0);
  // The disk as the save's streams see it (the default aio, 1 MiB x 8): same bytes, a new file.
  auto disk = ckpt::MeasureDisk(dir, bytes, ckpt::StreamOptionsFromAio(1 << 20, 8, 1, s.io));
  ASSERT_TRUE(disk.ok()) << disk.status().ToString();
  const double mb = static_cast<double>(bytes) / 1e6;
  const double dw = disk->write_fresh_bytes_per_s / 1e6, dr = disk->read_bytes_per_s / 1e6;
  std::printf(
      "checkpoint of %lld params, sub_group_size %s: %.1f MB; save %.3f s (%.0f MB/s, "
      "%.2fx the disk's O_DIRECT write %.0f MB/s), load %.3f s (%.0f MB/s, %.2fx its "
      "read %.0f MB/s); host peak %.1f of %.1f MB budget\n",
      static_cast<long long>(n), sub_group.c_str(), mb, save_s, mb / save_s, mb / save_s / dw, dw,
      load_s, mb / load_s, mb / load_s / dr, dr, host_peak / 1e6, host_budget / 1e6);
  std::filesystem::remove_all(dir);
}

// --- crashes ---------------------------------------------------------------------------------

// The crash test's saver, in a forked child: loads "base" and saves it again as `tag` with
// 4 KiB IO chunks (many durable operations to pick from) through a CrashAtEnv dying at its
// `crash_at`-th durable operation (0: never), then _exits 0, or 1 when the save failed. The
// parent holds no engine (and so no threads) when it forks.
[[noreturn]] void ChildLoadAndSave(const std::string& dir, const std::string& tag, int crash_at) {
  CrashAtEnv crash(crash_at);
  // The config has no `checkpoint` section: SaveOptions' defaults are what Save without
  // options takes (SaveOptionsFromConfig).
  SaveOptions save;
  save.env = &crash;
  RunSpec s;
  s.config_json = Config(kSolo);
  s.config_json.replace(s.config_json.find('{'), 1,
                        "{\"aio\": {\"block_size\": 4096, \"queue_depth\": 2},");
  s.steps = 0;
  s.init = [&](int, Engine& e) -> Status {
    STRATA_RETURN_IF_ERROR(e.Load(dir, "base"));
    return e.Save(dir, tag, save, Blob("blob"));
  };
  RunResult r = RunEngine(s);
  ::_exit(r.status.ok() ? 0 : 1);
}

// Forks the saver; crash_at > 0: its k-th durable operation dies (a write torn);
// kill_after_us >= 0 sends SIGKILL after that long. Returns the wait status.
int RunChild(const std::string& dir, const std::string& tag, int crash_at, int kill_after_us) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) ChildLoadAndSave(dir, tag, crash_at);
  if (kill_after_us >= 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(kill_after_us));
    ::kill(pid, SIGKILL);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// After a crashed (or finished) save of `tag`: `latest` loads, is `prev_latest` or `tag`; `tag`
// either verifies completely (and then loads) or is refused. Returns the new latest.
std::string CheckAfterCrash(const std::string& dir, const std::string& tag,
                            const std::string& prev_latest, bool* tag_complete) {
  auto latest = ckpt::VerifyCheckpoint(dir, "");
  EXPECT_TRUE(latest.ok()) << tag << ": latest does not verify: " << latest.status().ToString();
  if (!latest.ok()) return prev_latest;
  EXPECT_TRUE(latest->tag == prev_latest || latest->tag == tag) << latest->tag;
  auto v = ckpt::VerifyCheckpoint(dir, tag);
  *tag_complete = v.ok();
  if (!v.ok()) {
    // Never a checkpoint directory that exists under its final name but fails verification.
    EXPECT_FALSE(std::filesystem::exists(dir + "/" + tag)) << tag << ": " << v.status().ToString();
  }
  return latest->tag;
}

// Points STRATA_TEST_TMPDIR at /dev/shm (when it exists) while alive: the crash test's 200+
// savers then cost no disk fsyncs (crash consistency against a killed process is the same on
// tmpfs; O_DIRECT is refused there and the streams fall back to buffered IO).
class ShmTestDir {
 public:
  ShmTestDir() {
    const char* old = std::getenv("STRATA_TEST_TMPDIR");
    if (old != nullptr) old_ = old;
    had_ = old != nullptr;
    if (std::filesystem::is_directory("/dev/shm")) ::setenv("STRATA_TEST_TMPDIR", "/dev/shm", 1);
  }
  ~ShmTestDir() {
    if (had_) {
      ::setenv("STRATA_TEST_TMPDIR", old_.c_str(), 1);
    } else {
      ::unsetenv("STRATA_TEST_TMPDIR");
    }
  }

 private:
  std::string old_;
  bool had_ = false;
};

TEST(CheckpointCrash, KilledSaverNeverLeavesALoadablePartialCheckpoint) {
  ShmTestDir shm;
  const std::string dir = UniqueTestDir("ckpt_crash");
  SaveSolo(dir, "base");
  std::string latest = "base";
  int points = 0, completed = 0, loaded = 0;
  // 1. CrashAtEnv: die at the k-th durable operation (writes torn in half), k = 1.. until a
  //    child finishes without reaching k.
  for (int k = 1; k < 1000; ++k) {
    const std::string tag = "k" + std::to_string(k);
    const int status = RunChild(dir, tag, k, -1);
    ASSERT_TRUE(WIFEXITED(status)) << tag;
    const int code = WEXITSTATUS(status);
    ASSERT_TRUE(code == 77 || code == 0) << tag << " exited " << code;
    bool complete = false;
    latest = CheckAfterCrash(dir, tag, latest, &complete);
    ++points;
    if (complete) {
      ++completed;
      if (loaded < 3 || code == 0) {  // a few full loads: the data really is there
        EXPECT_TRUE(LoadSolo(dir, tag).ok()) << tag;
        ++loaded;
      }
    }
    if (code == 0) {
      EXPECT_TRUE(complete);
      EXPECT_EQ(latest, tag);
      break;
    }
  }
  const int hook_points = points;
  EXPECT_GT(hook_points, 25);
  // 2. Real SIGKILLs after random delays across the child's lifetime.
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(RunChild(dir, "timed", 0, -1), 0);
  const int64_t life_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  latest = "timed";
  std::mt19937 rng(12345);
  std::uniform_int_distribution<int64_t> delay(life_us / 4, life_us + life_us / 8);
  for (int i = 0; i < 200 && points < 205; ++i) {
    const std::string tag = "s" + std::to_string(i);
    RunChild(dir, tag, 0, static_cast<int>(delay(rng)));
    bool complete = false;
    latest = CheckAfterCrash(dir, tag, latest, &complete);
    completed += complete;
    ++points;
  }
  std::printf("crash points: %d (%d by the hook), checkpoints completed: %d\n", points, hook_points,
              completed);
  EXPECT_GE(points, 200);
  EXPECT_TRUE(LoadSolo(dir, "").ok());
  std::filesystem::remove_all(dir);
}

// A tag saved again, the saver dying at each of its durable operations in turn: the tag always
// verifies (the old checkpoint or the new one, never neither and never a partial one), and
// `latest` loads.
TEST(CheckpointCrash, KilledSaverReplacingATagLeavesTheOldOrTheNew) {
  ShmTestDir shm;
  const std::string dir = UniqueTestDir("ckpt_replace_crash");
  SaveSolo(dir, "base");
  ASSERT_EQ(RunChild(dir, "over", 0, -1), 0);
  int points = 0;
  for (int k = 1; k < 1000; ++k) {
    const int status = RunChild(dir, "over", k, -1);
    ASSERT_TRUE(WIFEXITED(status)) << k;
    const int code = WEXITSTATUS(status);
    ASSERT_TRUE(code == 77 || code == 0) << k << " exited " << code;
    auto v = ckpt::VerifyCheckpoint(dir, "over");
    EXPECT_TRUE(v.ok()) << "crash at " << k << ": " << v.status().ToString();
    auto latest = ckpt::VerifyCheckpoint(dir, "");
    EXPECT_TRUE(latest.ok()) << "crash at " << k << ": " << latest.status().ToString();
    ++points;
    if (code == 0) break;
  }
  EXPECT_GT(points, 25);
  EXPECT_TRUE(LoadSolo(dir, "over").ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata::testing
