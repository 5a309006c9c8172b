// Checkpoint precision conversion (ckpt::ReshardCheckpoint with ReshardTarget::precision, the
// rule in core/zero/checkpoint_format.h) and torn checkpoint writes while the process keeps
// running (the simulated IO backend's kTorn and kLost faults, scripted through a CheckpointEnv
// double: SimFaultEnv, checkpoint_fault_env.h).
//
// Conversion: a bf16 checkpoint (2 ranks, stage 3, states on NVMe) converted to fp16 and fp32 at
// other layouts loads with params equal to Cast(master) bit for bit, master / Adam m / Adam v
// equal to the saved bits, the loss scaler started from the loading engine's config, and trains
// on; converted back to bf16 its rank files are the original's byte for byte (so the derived
// params are exactly what the optimizer's param_out wrote). Model and harness: engine_test_model.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint_fault_env.h"
#include "core/zero/checkpoint_format.h"
#include "core/zero/checkpoint_io.h"
#include "engine_test_model.h"
#include "nvme/sim_backend.h"

namespace strata::testing {
namespace {

namespace ckpt = zero::ckpt;

struct EngineSetup {
  int stage;
  const char* opt;
  const char* param;
  int world;
  const char* precision;
  int initial_scale_power = 8;
  int aio_block_size = 1 << 20;
};

std::string Config(const EngineSetup& s) {
  const std::string p = s.precision;
  return R"({
  "train_micro_batch_size_per_gpu": 3,
  "gradient_accumulation_steps": 1,
  "aio": {"block_size": )" +
         std::to_string(s.aio_block_size) + R"(, "queue_depth": 2},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}},
  "bf16": {"enabled": )" +
         std::string(p == "bf16" ? "true" : "false") + R"(},
  "fp16": {"enabled": )" +
         std::string(p == "fp16" ? "true" : "false") + R"(, "initial_scale_power": )" +
         std::to_string(s.initial_scale_power) + R"(, "hysteresis": 1},
  "zero_optimization": {
    "stage": )" +
         std::to_string(s.stage) + R"(,
    "offload_optimizer": {"device": ")" +
         s.opt + R"(", "nvme_path": "/tmp"},
    "offload_param": {"device": ")" +
         s.param + R"(", "nvme_path": "/tmp"},
    "sub_group_size": 256,
    "stage3_param_persistence_threshold": 64
  }
})";
}

// Every group's first numel elements of state kind `kind` (global order), as raw bytes.
std::vector<std::vector<uint8_t>> ReadKind(const std::string& dir, size_t kind) {
  auto m = ckpt::VerifyCheckpoint(dir, "");
  EXPECT_TRUE(m.ok()) << dir << ": " << m.status().ToString();
  if (!m.ok()) return {};
  ckpt::RangeReader rd(dir + "/" + m->tag, *m);
  std::vector<std::vector<uint8_t>> out(m->groups.size());
  for (size_t g = 0; g < m->groups.size(); ++g) {
    out[g].resize(m->groups[g].numel * m->ElemBytes(kind));
    const Status st = rd.Read(g, kind, 0, m->groups[g].numel, out[g].data());
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  return out;
}

// The 16-bit (or fp32) params of `precision` from fp32 masters, computed here with the scalar
// reference conversions of strata/dtype.h (what AdamStep's param_out matches bit for bit).
std::vector<uint8_t> Cast(const std::vector<uint8_t>& master, const std::string& precision) {
  const size_t n = master.size() / 4;
  if (precision == "fp32") return master;
  std::vector<uint8_t> out(n * 2);
  for (size_t i = 0; i < n; ++i) {
    float f;
    std::memcpy(&f, master.data() + i * 4, 4);
    const uint16_t b = precision == "fp16" ? FloatToHalf(f).bits : FloatToBf16(f).bits;
    std::memcpy(out.data() + i * 2, &b, 2);
  }
  return out;
}

TEST(CheckpointPrecision, Bf16ConvertsToFp16AndFp32Exactly) {
  const std::string dir = UniqueTestDir("ckpt_prec");
  const EngineSetup home{3, "nvme", "nvme", 2, "bf16"};
  RunSpec first;
  first.config_json = Config(home);
  first.world = home.world;
  first.steps = 3;
  first.after_step = [&](int, int step, Engine& e) -> Status {
    return step == 2 ? e.Save(dir + "/src", "t") : Status::OK();
  };
  RunResult part = RunEngine(first);
  ASSERT_TRUE(part.status.ok()) << part.status.ToString();
  const auto master = ReadKind(dir + "/src", 1), exp_avg = ReadKind(dir + "/src", 2),
             exp_avg_sq = ReadKind(dir + "/src", 3);
  ASSERT_EQ(master.size(), static_cast<size_t>(kGroups));

  // fp16 at 2 ranks stage 3 (initial_scale_power 5 where the saving run had 8: the loading
  // engine's config decides), fp32 at 1 rank stage 1.
  const EngineSetup targets[] = {{3, "cpu", "cpu", 2, "fp16", 5}, {1, "cpu", "none", 1, "fp32"}};
  for (const EngineSetup& to : targets) {
    const std::string p = to.precision, out = dir + "/" + p;
    auto conv = ckpt::ReshardCheckpoint(dir + "/src", "", {to.world, to.stage, p}, out);
    ASSERT_TRUE(conv.ok()) << p << ": " << conv.status().ToString();
    EXPECT_EQ(conv->precision, p);
    EXPECT_EQ(conv->param_dtype, p == "fp16" ? "F16" : "F32");
    EXPECT_FALSE(conv->has_scaler_state);
    EXPECT_EQ(conv->global_step, 3);
    auto cfg = nlohmann::json::parse(conv->config_json, nullptr, false);
    EXPECT_EQ(cfg["fp16"]["enabled"], p == "fp16") << conv->config_json;
    EXPECT_EQ(cfg["bf16"]["enabled"], false) << conv->config_json;
    auto reread = ckpt::ReadManifest(out, "t");
    ASSERT_TRUE(reread.ok()) << reread.status().ToString();
    EXPECT_FALSE(reread->has_scaler_state);

    // Load, read the params the engine gathers and the loss scale, save again (every state as
    // the engine holds it), then train three more steps.
    std::vector<std::vector<uint8_t>> gathered(kGroups);
    double scale = 0;
    RunSpec resume;
    resume.config_json = Config(to);
    resume.world = to.world;
    resume.first_step = 3;
    resume.steps = 6;
    resume.init = [&](int r, Engine& e) -> Status {
      STRATA_RETURN_IF_ERROR(e.Load(out));
      for (size_t g = 0; g < kGroups; ++g) {
        STRATA_ASSIGN_OR_RETURN(GatheredGroup gg, e.Gather(g));
        if (r == 0) {
          const auto* b = static_cast<const uint8_t*>(gg.data());
          gathered[g].assign(b, b + gg.numel() * DTypeSize(gg.dtype()));
        }
        e.Release(std::move(gg));
      }
      if (r == 0) scale = e.LossScale();
      return e.Save(dir + "/re_" + p, "loaded");
    };
    RunResult resumed = RunEngine(resume);
    ASSERT_TRUE(resumed.status.ok()) << p << ": " << resumed.status.ToString();
    for (size_t g = 0; g < kGroups; ++g) {
      EXPECT_EQ(gathered[g], Cast(master[g], p))
          << p << " group " << g << ": params != Cast(master)";
    }
    EXPECT_EQ(scale, p == "fp16" ? 32.0 : 1.0) << p;
    EXPECT_EQ(ReadKind(dir + "/re_" + p, 0), ReadKind(out, 0)) << p;
    EXPECT_EQ(ReadKind(dir + "/re_" + p, 1), master) << p << ": masters changed";
    EXPECT_EQ(ReadKind(dir + "/re_" + p, 2), exp_avg) << p << ": Adam m changed";
    EXPECT_EQ(ReadKind(dir + "/re_" + p, 3), exp_avg_sq) << p << ": Adam v changed";
    ASSERT_EQ(resumed.reports.size(), 3u);
    EXPECT_EQ(resumed.reports.back().global_step, 6);
    bool moved = false, finite = true;
    for (size_t g = 0; g < kGroups; ++g) {
      for (size_t i = 0; i < resumed.master[g].size(); ++i) {
        float was;
        std::memcpy(&was, master[g].data() + i * 4, 4);
        moved = moved || resumed.master[g][i] != was;
        finite = finite && std::isfinite(resumed.master[g][i]);
      }
    }
    EXPECT_TRUE(moved && finite) << p << ": training did not continue";
  }

  // fp16 -> bf16 at the original layout: the rank files are the original's, byte for byte (the
  // params re-derived from the masters are the ones the optimizer wrote).
  auto back = ckpt::ReshardCheckpoint(dir + "/fp16", "", {2, 3, "bf16"}, dir + "/back");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  auto src = ckpt::ReadManifest(dir + "/src", "t");
  ASSERT_TRUE(src.ok());
  for (int r = 0; r < 2; ++r) EXPECT_EQ(back->files[r].xxh3, src->files[r].xxh3) << "rank " << r;
  std::filesystem::remove_all(dir);
}

// Saves a 2-step bf16 run (world 1) as `tag` in dir.
void SaveSolo(const std::string& dir, const std::string& tag) {
  RunSpec s;
  s.config_json = Config({3, "cpu", "cpu", 1, "bf16"});
  s.steps = 2;
  s.after_step = [&](int, int step, Engine& e) -> Status {
    return step == 1 ? e.Save(dir, tag) : Status::OK();
  };
  RunResult r = RunEngine(s);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
}

// Loads dir's latest into a new engine of `s` (rank 0's Load status).
Status LoadInto(const std::string& dir, const EngineSetup& s) {
  RunSpec spec;
  spec.config_json = Config(s);
  spec.world = s.world;
  spec.steps = 0;
  std::vector<Status> load(s.world);
  spec.init = [&](int r, Engine& e) -> Status {
    load[r] = e.Load(dir);
    return Status::OK();
  };
  RunResult res = RunEngine(spec);
  return load[0].ok() ? res.status : load[0];
}

TEST(CheckpointPrecision, MismatchNamesBothPrecisionsAndTheWayOut) {
  const std::string dir = UniqueTestDir("ckpt_prec_refuse");
  SaveSolo(dir + "/bf16", "t");
  Status st = LoadInto(dir + "/bf16", {3, "cpu", "cpu", 1, "fp16"});
  EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
  for (const char* want :
       {"precision is bf16", "the engine's fp16", "ckpt reshard", "--precision fp16"}) {
    EXPECT_NE(st.ToString().find(want), std::string::npos) << want << ": " << st.ToString();
  }
  auto conv = ckpt::ReshardCheckpoint(dir + "/bf16", "", {0, -1, "fp16"}, dir + "/fp16");
  ASSERT_TRUE(conv.ok()) << conv.status().ToString();
  EXPECT_EQ(conv->world_size, 1);  // 0 / -1: the checkpoint's
  EXPECT_EQ(conv->stage, 3);
  EXPECT_TRUE(LoadInto(dir + "/fp16", {3, "cpu", "cpu", 1, "fp16"}).ok());
  st = LoadInto(dir + "/fp16", {3, "cpu", "cpu", 1, "bf16"});
  EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.ToString().find("precision is fp16, the engine's bf16"), std::string::npos)
      << st.ToString();
  auto bad = ckpt::ReshardCheckpoint(dir + "/bf16", "", {1, 3, "int8"}, dir + "/bad");
  EXPECT_EQ(bad.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(bad.status().ToString().find("'int8'"), std::string::npos) << bad.status().ToString();
  EXPECT_FALSE(std::filesystem::exists(dir + "/bad"));
  std::filesystem::remove_all(dir);
}

// --- torn writes, the process alive ------------------------------------------------------------

// A write that tears and reports EIO (2 ranks, 4 KiB chunks: a dozen writes per rank file, the
// third of rank 1's torn) fails the save on every rank: rank 1 names its file and the offset,
// rank 0 names rank 1. `latest` still names the previous checkpoint, which verifies and loads;
// no `b/` exists; the engine stays usable and the same tag then saves.
TEST(CheckpointTornWrite, FailedWriteFailsTheSaveAndKeepsLatest) {
  const std::string dir = UniqueTestDir("ckpt_torn");
  std::vector<Status> torn(2), again(2);
  std::string latest_between;
  bool b_between = true;
  // The third write of rank 1's file of "b" tears. The config has no `checkpoint` section:
  // SaveOptions' defaults are what Save without options takes.
  SimFaultEnv tear("/b.tmp/rank1.", nvme::SimFault::kTorn, 3);
  SaveOptions faulty;
  faulty.env = &tear;
  RunSpec s;
  s.config_json = Config({3, "cpu", "cpu", 2, "bf16", 8, 4096});
  s.world = 2;
  s.steps = 2;
  s.after_step = [&](int r, int step, Engine& e) -> Status {
    if (step == 0) return e.Save(dir, "a", faulty);
    torn[r] = e.Save(dir, "b", faulty);
    if (r == 0) {  // every rank is past the failed save (it ends in an agreement)
      auto latest = ckpt::VerifyCheckpoint(dir, "");
      latest_between = latest.ok() ? latest->tag : latest.status().ToString();
      b_between = std::filesystem::exists(dir + "/b");
    }
    again[r] = e.Save(dir, "b", faulty);  // the env's fault is spent
    return Status::OK();
  };
  {
    RunResult res = RunEngine(s);
    ASSERT_TRUE(res.status.ok()) << res.status.ToString();
  }
  EXPECT_EQ(torn[1].code(), Status::Code::kIOError) << torn[1].ToString();
  // EIO from the tear itself (the failed write names its file, offset and errno).
  for (const char* want : {"b.tmp/rank1.safetensors", "offset", "Input/output error"}) {
    EXPECT_NE(torn[1].ToString().find(want), std::string::npos)
        << want << ": " << torn[1].ToString();
  }
  EXPECT_EQ(torn[0].code(), Status::Code::kAborted) << torn[0].ToString();
  EXPECT_NE(torn[0].ToString().find("rank 1"), std::string::npos) << torn[0].ToString();
  EXPECT_EQ(latest_between, "a");
  EXPECT_FALSE(b_between);
  for (const Status& st : again) EXPECT_TRUE(st.ok()) << st.ToString();
  auto b = ckpt::VerifyCheckpoint(dir, "");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->tag, "b");
  EXPECT_TRUE(ckpt::WriteSmallFile(dir + "/latest", "a\n", true).ok());
  EXPECT_TRUE(LoadInto(dir, {3, "cpu", "cpu", 2, "bf16"}).ok());
  std::filesystem::remove_all(dir);
}

// A silent tear (half the chunk lands, the write reports success): the save cannot see it and
// commits; verification and both load paths (same layout: the streamed checksum; another layout:
// the checks up front) refuse the checkpoint naming the file; the previous tag still loads.
TEST(CheckpointTornWrite, SilentTearIsFoundByVerifyAndLoad) {
  const std::string dir = UniqueTestDir("ckpt_lost");
  SaveSolo(dir, "a");
  {
    SimFaultEnv tear("/b.tmp/rank0.", nvme::SimFault::kLost, 3);
    SaveOptions faulty;
    faulty.env = &tear;
    RunSpec s;
    s.config_json = Config({3, "cpu", "cpu", 1, "bf16", 8, 4096});
    s.steps = 1;
    s.after_step = [&](int, int, Engine& e) -> Status { return e.Save(dir, "b", faulty); };
    RunResult r = RunEngine(s);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  }
  const std::string file = dir + "/b/rank0.safetensors";
  auto v = ckpt::VerifyCheckpoint(dir, "");
  EXPECT_EQ(v.status().code(), Status::Code::kCorruption) << v.status().ToString();
  EXPECT_NE(v.status().ToString().find(file), std::string::npos) << v.status().ToString();
  for (const EngineSetup& s :
       {EngineSetup{3, "cpu", "cpu", 1, "bf16"}, EngineSetup{1, "cpu", "none", 2, "bf16"}}) {
    const Status st = LoadInto(dir, s);
    EXPECT_EQ(st.code(), Status::Code::kCorruption) << s.world << ": " << st.ToString();
    EXPECT_NE(st.ToString().find(file), std::string::npos) << s.world << ": " << st.ToString();
  }
  ASSERT_TRUE(ckpt::WriteSmallFile(dir + "/latest", "a\n", true).ok());
  EXPECT_TRUE(LoadInto(dir, {3, "cpu", "cpu", 1, "bf16"}).ok());
  std::filesystem::remove_all(dir);
}

// Offline resharding through the simulated backend: a torn write of the output fails it naming
// the file, and the output directory holds neither the tag nor `latest`; a retry succeeds.
TEST(CheckpointTornWrite, TornReshardWriteLeavesNoCheckpoint) {
  const std::string dir = UniqueTestDir("ckpt_torn_reshard");
  SaveSolo(dir + "/src", "t");
  ckpt::StreamOptions so;
  so.kind = IoBackendKind::kSimulated;
  so.chunk_bytes = 4096;
  so.depth = 2;
  {
    SimFaultEnv tear("/out/t.tmp/rank1.", nvme::SimFault::kTorn, 2);
    ckpt::StreamOptions faulty = so;
    faulty.env = &tear;
    auto r = ckpt::ReshardCheckpoint(dir + "/src", "", {2, 1, "fp16"}, dir + "/out", faulty);
    EXPECT_EQ(r.status().code(), Status::Code::kIOError) << r.status().ToString();
    for (const char* want : {"t.tmp/rank1.safetensors", "Input/output error"}) {
      EXPECT_NE(r.status().ToString().find(want), std::string::npos) << r.status().ToString();
    }
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/out/t"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/out/latest"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/out/t.tmp"));  // nothing left holding the disk
  auto r = ckpt::ReshardCheckpoint(dir + "/src", "", {2, 1, "fp16"}, dir + "/out", so);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(ckpt::VerifyCheckpoint(dir + "/out", "").ok());
  // An output inside one of the source's tags would nest a checkpoint in the one it reads.
  auto nested = ckpt::ReshardCheckpoint(dir + "/src", "", {2, 1, ""}, dir + "/src/t/copy", so);
  EXPECT_TRUE(nested.status().IsInvalidArgument()) << nested.status().ToString();
  EXPECT_NE(nested.status().ToString().find("is inside"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir + "/src/t/copy"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata::testing
