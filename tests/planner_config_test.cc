// EngineConfig -> PlanInput: the DeepSpeed keys the planner takes, with DeepSpeed's defaults
// for absent keys and notes for values it cannot take as written.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "strata/config.h"
#include "strata/planner.h"

namespace strata {
namespace {

struct Applied {
  PlanInput in;
  std::vector<std::string> notes;
};

// `json` is an object without batch sizes; a micro-batch size is added since DeepSpeed needs one.
Applied Apply(const std::string& json) {
  Applied a;
  a.in.params = 7e9;
  const std::string text = R"({"train_micro_batch_size_per_gpu": 1, )" + json.substr(1);
  auto parsed = ParseDeepSpeedConfig(text);
  EXPECT_TRUE(parsed.ok()) << parsed.status().ToString();
  if (parsed.ok()) ApplyEngineConfig(parsed->config, &a.in, &a.notes);
  return a;
}

bool HasNote(const Applied& a, const std::string& what) {
  for (const std::string& n : a.notes) {
    if (n.find(what) != std::string::npos) return true;
  }
  return false;
}

TEST(PlannerConfig, InfinityConfigMapsEveryKey) {
  const Applied a = Apply(R"({
    "bf16": {"enabled": true},
    "gradient_accumulation_steps": 4,
    "zero_optimization": {
      "stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 6,
                            "pin_memory": true},
      "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 7,
                        "buffer_size": 2e8, "max_in_cpu": 3e8},
      "overlap_comm": false,
      "reduce_bucket_size": 1e8, "allgather_bucket_size": 2e8,
      "stage3_prefetch_bucket_size": 3e7, "stage3_max_live_parameters": 4e8,
      "stage3_max_reuse_distance": 6e8, "stage3_param_persistence_threshold": 2e5,
      "sub_group_size": 5e7
    }
  })");
  const ZeroSettings& z = a.in.zero;
  EXPECT_TRUE(a.in.has_configured);
  EXPECT_EQ(a.in.recipe.name, "bf16-adam");
  EXPECT_EQ(z.stage, 3);
  EXPECT_EQ(z.offload_optimizer, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_param, OffloadDevice::kNvme);
  EXPECT_TRUE(z.optimizer_pin_memory);
  EXPECT_FALSE(z.param_pin_memory);
  EXPECT_DOUBLE_EQ(z.optimizer_buffer_count, 6);
  EXPECT_DOUBLE_EQ(z.param_buffer_count, 7);
  EXPECT_DOUBLE_EQ(z.param_buffer_size, 2e8);
  EXPECT_DOUBLE_EQ(z.max_in_cpu, 3e8);
  ASSERT_TRUE(z.overlap_comm.has_value());
  EXPECT_FALSE(*z.overlap_comm);
  EXPECT_DOUBLE_EQ(z.reduce_bucket_size, 1e8);
  EXPECT_DOUBLE_EQ(z.allgather_bucket_size, 2e8);
  EXPECT_DOUBLE_EQ(z.prefetch_bucket_size, 3e7);
  EXPECT_DOUBLE_EQ(z.max_live_parameters, 4e8);
  EXPECT_DOUBLE_EQ(z.max_reuse_distance, 6e8);
  EXPECT_DOUBLE_EQ(z.param_persistence_threshold, 2e5);
  EXPECT_DOUBLE_EQ(z.sub_group_size, 5e7);
  EXPECT_DOUBLE_EQ(z.gradient_accumulation_steps, 4);
  EXPECT_TRUE(a.notes.empty()) << a.notes.front();

  // The mapped settings drive the placement: host per node (8 GPUs, shard 8.75e8), by the
  // engine's rules (sched/placement.h): optimizer swap buffers 8 x (6 + 1) x 4 blocks of
  // min(5e7, a reduce_bucket_size group's shard 1.25e7) x 4 B (in 4 KiB pages: 50003968) =
  // 11.2 GB + param buffers 8 x 7 x
  // min(2e8, 8.75e8) x 2 B (in pages: 400003072) = 22.4 GB; the rest of the default 1024 GB
  // caches the 126 GB on NVMe (max_in_cpu does not bound it): 126 GB, and the speculative step's
  // rollback copies, a quarter of the 8 x 8.75e8 optimizer elements at 12 + 2 B: 24.5 GB.
  auto plan = MakePlan(a.in);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const double buffers = 8.0 * 7 * 4 * 50003968 + 8.0 * 7 * 400003072;
  EXPECT_DOUBLE_EQ(plan->configured->host_bytes_per_node, 126e9 + 24.5e9);
  EXPECT_DOUBLE_EQ(plan->configured->host_cache_bytes_per_node, 126e9 - buffers);
  // HBM, the engine's working set with groups of reduce_bucket_size (1e8; shard 1.25e7; 70
  // groups): gradient buffers (1e8 + 1.25e7) x 2 B = 0.225 GB (overlap off) + fp32 read-back
  // beyond them 0.4 - 0.225 = 0.175 + the reuse distance 6e8 keeps 6e8 / 2e8 + 1 = 4 groups
  // (max_live 4e8 would allow 4 + 1): gathered 4 x 1e8 x 2 B = 0.8 + shards 4 x 1.25e7 x 2 B =
  // 0.1 -> 1.3 GB, + the norm exchange 8 x 16 B.
  EXPECT_DOUBLE_EQ(plan->configured->hbm_bytes_per_gpu, 1.3e9 + 8 * 16);
}

TEST(PlannerConfig, DefaultsWhenKeysAreAbsent) {
  const Applied a = Apply(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}})");
  const ZeroSettings& z = a.in.zero;
  const ZeroSettings defaults;
  EXPECT_EQ(z.stage, 2);
  EXPECT_EQ(z.offload_optimizer, OffloadDevice::kNone);
  EXPECT_DOUBLE_EQ(z.reduce_bucket_size, defaults.reduce_bucket_size);
  EXPECT_DOUBLE_EQ(z.prefetch_bucket_size, defaults.prefetch_bucket_size);
  EXPECT_DOUBLE_EQ(z.max_in_cpu, defaults.max_in_cpu);
  EXPECT_DOUBLE_EQ(z.param_buffer_count, defaults.param_buffer_count);
  EXPECT_DOUBLE_EQ(z.optimizer_buffer_count, defaults.optimizer_buffer_count);
  EXPECT_DOUBLE_EQ(z.gradient_accumulation_steps, 1);
  // DeepSpeed's overlap_comm default below stage 3 is off.
  ASSERT_TRUE(z.overlap_comm.has_value());
  EXPECT_FALSE(*z.overlap_comm);
}

TEST(PlannerConfig, PrecisionPicksTheRecipe) {
  EXPECT_EQ(Apply(R"({"fp16": {"enabled": true}})").in.recipe.name, "fp16-adam");
  const Applied fp32 = Apply(R"({"zero_optimization": {"stage": 1}})");
  // The engine's widths (sched::StateElementBytes): an fp32 run keeps an fp32 master beside its
  // fp32 params, 4 + 4 + 12 = 20 B/param.
  EXPECT_EQ(fp32.in.recipe.name, "fp32-adam");
  EXPECT_DOUBLE_EQ(fp32.in.recipe.master_bytes, 4);
  EXPECT_DOUBLE_EQ(fp32.in.recipe.TotalBytes(), 20);
  EXPECT_TRUE(HasNote(fp32, "fp32"));
  const Applied autod = Apply(R"({"bf16": {"enabled": "auto"}})");
  EXPECT_EQ(autod.in.recipe.name, "bf16-adam");
  EXPECT_TRUE(HasNote(autod, "auto"));
}

TEST(PlannerConfig, AutoSizesAreNotedAndThePartialOffloadRatioIsPlanned) {
  const Applied a = Apply(R"({
    "bf16": {"enabled": true},
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "offload_optimizer": {"device": "cpu", "ratio": 0.3}}
  })");
  EXPECT_DOUBLE_EQ(a.in.zero.reduce_bucket_size, 5e8);
  EXPECT_DOUBLE_EQ(a.in.zero.prefetch_bucket_size, 5e7);
  EXPECT_DOUBLE_EQ(a.in.zero.gradient_accumulation_steps, 1);
  EXPECT_TRUE(HasNote(a, "zero_optimization.reduce_bucket_size"));
  EXPECT_TRUE(HasNote(a, "zero_optimization.stage3_prefetch_bucket_size"));
  EXPECT_TRUE(HasNote(a, "gradient_accumulation_steps"));
  // offload_optimizer.ratio is planned (sched::DeviceResidentSubGroups), not noted as ignored.
  EXPECT_DOUBLE_EQ(a.in.zero.optimizer_ratio, 0.3);
  EXPECT_FALSE(HasNote(a, "ratio"));
}

// Accelerate's all-"auto" config: the stage and devices hold DeepSpeed's defaults in the typed
// config, which must not be planned as if the user had chosen stage 0 without offload.
TEST(PlannerConfig, AutoStageAndDevicesAreNotTakenAsAChoice) {
  const Applied a = Apply(R"({
    "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"},
                          "offload_param": {"device": "auto"}}
  })");
  EXPECT_FALSE(a.in.has_configured);
  EXPECT_TRUE(HasNote(a, "zero_optimization.stage is \"auto\""));
  EXPECT_TRUE(HasNote(a, "zero_optimization.offload_optimizer.device is \"auto\""));
  EXPECT_TRUE(HasNote(a, "zero_optimization.offload_param.device is \"auto\""));

  const Applied fixed = Apply(R"({"zero_optimization": {"stage": 2}})");
  EXPECT_TRUE(fixed.in.has_configured);
  EXPECT_EQ(fixed.in.zero.stage, 2);
  EXPECT_FALSE(HasNote(fixed, "is \"auto\": no stage"));
}

// One rule in one place: every config the reader accepts passes the planner's checks (a
// published config with sub_group_size 0 passed `config check` but `plan --config` refused it).
TEST(PlannerConfig, EveryPublishedConfigIsPlanned) {
  const char* env = std::getenv("STRATA_SOURCE_DIR");
  const std::filesystem::path dir =
      std::filesystem::path(env != nullptr ? env : STRATA_SOURCE_DIR_DEFAULT) /
      "tests/data/ds_configs";
  int seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    ++seen;
    PlanInput in;
    in.params = 7e9;
    // No world size: the batch sizes of some fit other cluster sizes than the default 8 ranks.
    auto parsed = LoadDeepSpeedConfig(entry.path().string());
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    std::vector<std::string> notes;
    ApplyEngineConfig(parsed->config, &in, &notes);
    const Status valid = ValidatePlanInput(in);
    EXPECT_TRUE(valid.ok()) << entry.path().filename() << ": " << valid.ToString();
  }
  EXPECT_GE(seen, 10);
}

// A value the reader never produces is still named by its JSON path.
TEST(PlannerConfig, InvalidValuesAreNamedByTheirJsonPath) {
  EngineConfig c;
  c.zero.offload_param.buffer_count = -1;
  PlanInput in;
  in.params = 7e9;
  std::vector<std::string> notes;
  ApplyEngineConfig(c, &in, &notes);
  const Status valid = ValidatePlanInput(in);
  EXPECT_NE(valid.message().find("zero_optimization.offload_param.buffer_count"),
            std::string_view::npos)
      << valid.ToString();
}

TEST(PlannerConfig, FileErrorsAreStatuses) {
  PlanInput in;
  in.params = 7e9;
  std::vector<std::string> notes;
  Status s = ApplyDeepSpeedConfigFile("/nonexistent/strata/ds.json", &in, &notes);
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(in.has_configured);
}

// config check --here --params: each filesystem's free space against what the engine puts in the
// nvme_paths on it, by the planner's placement of the configured setting. 2^20 bf16 parameters at
// stage 3 with everything on NVMe: the optimizer state is 12 bytes per parameter (fp32 master, m,
// v), the gradient 2 (bf16: one rank, one micro-step, the optimizer wholly offloaded) or 4 (fp32:
// two ranks), the params 2.
TEST(PlannerConfig, NvmeFreeSpaceIsComparedWithTheEnginesState) {
  const auto base =
      std::filesystem::path(std::getenv("STRATA_TEST_TMPDIR") ? std::getenv("STRATA_TEST_TMPDIR")
                                                              : "/tmp") /
      ("planner_nvme_" + std::to_string(getpid()));
  const std::string opt = (base / "opt").string(), par = (base / "par").string();
  std::filesystem::create_directories(opt);
  std::filesystem::create_directories(par);
  auto check = [](int stage, const std::string& a, const std::string& b) {
    ParseOptions o;
    o.check_here = true;
    o.min_free_bytes = 0;
    const std::string stage_text = stage < 0 ? "\"auto\"" : std::to_string(stage);
    ConfigCheck c = CheckDeepSpeedConfig(
        R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
            "zero_optimization": {"stage": )" +
            stage_text + R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + a +
            R"("}, "offload_param": {"device": "nvme", "nvme_path": ")" + b + R"("}}})",
        o);
    EXPECT_TRUE(c.ok()) << (c.errors.empty() ? "" : c.errors[0].ToString());
    return c;
  };
  auto has = [](const std::vector<std::string>& notes, const std::string& what) {
    for (const std::string& n : notes) {
      if (n.find(what) != std::string::npos) return true;
    }
    return false;
  };
  const double params = 1 << 20;
  const int64_t mib = 1 << 20;

  // One directory for both: 16 bytes per parameter at one rank, 18 at two.
  for (const auto& [ranks, need] : {std::pair<int64_t, int64_t>{1, 16 * mib}, {2, 18 * mib}}) {
    ConfigCheck c = check(3, opt, opt);
    ASSERT_EQ(c.nvme_paths.size(), 2u);
    for (NvmePathSpace& n : c.nvme_paths) n.free_bytes = need;  // exactly enough
    CheckNvmeSpace(params, ranks, /*strict=*/false, &c);
    EXPECT_TRUE(c.warnings.empty()) << c.warnings[0].ToString();
    EXPECT_TRUE(has(c.notes, "holds " + std::to_string(need) + " bytes")) << ranks;

    c = check(3, opt, opt);
    for (NvmePathSpace& n : c.nvme_paths) n.free_bytes = need - 1;
    CheckNvmeSpace(params, ranks, false, &c);
    // One rank: exactly this machine's allocation, so an error; several: a warning (other ranks
    // may run elsewhere).
    const std::vector<ConfigDiagnostic>& found = ranks == 1 ? c.errors : c.warnings;
    EXPECT_EQ((ranks == 1 ? c.warnings : c.errors).size(), 0u);
    ASSERT_EQ(found.size(), 1u);  // one directory, one finding
    EXPECT_EQ(found[0].path, "zero_optimization.offload_optimizer.nvme_path");
    EXPECT_EQ(found[0].kind, ConfigDiagnostic::Kind::kMachine);
    const std::string& m = found[0].message;
    EXPECT_NE(m.find("needs " + std::to_string(need) + " bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("the optimizer state with its gradients and the params"), std::string::npos)
        << m;
    EXPECT_NE(m.find("has " + std::to_string(need - 1) + " bytes free"), std::string::npos) << m;
  }

  // Two directories on one filesystem (as here): their free space is one, so their parts add up
  // (one rank: 14 + 2 bytes per parameter), compared once, naming both.
  ConfigCheck c = check(3, opt, par);
  ASSERT_NE(c.nvme_paths[0].filesystem, 0u);
  ASSERT_EQ(c.nvme_paths[0].filesystem, c.nvme_paths[1].filesystem);
  for (NvmePathSpace& n : c.nvme_paths) n.free_bytes = 16 * mib - 1;
  CheckNvmeSpace(params, 1, false, &c);
  ASSERT_EQ(c.errors.size(), 1u);
  EXPECT_NE(c.errors[0].message.find("and '" + par + "' (one filesystem) needs " +
                                     std::to_string(16 * mib) + " bytes"),
            std::string::npos)
      << c.errors[0].message;

  // Two directories on two filesystems: the engine stripes its swap files over both, so each
  // holds half of the 16 bytes per parameter, whatever the keys name it for.
  c = check(3, opt, par);
  c.nvme_paths[0].filesystem = 1;
  c.nvme_paths[1].filesystem = 2;
  c.nvme_paths[0].free_bytes = 14 * mib;
  c.nvme_paths[1].free_bytes = 8 * mib - 1;
  CheckNvmeSpace(params, 1, false, &c);
  ASSERT_EQ(c.errors.size(), 1u);
  EXPECT_EQ(c.errors[0].path, "zero_optimization.offload_param.nvme_path");
  EXPECT_NE(c.errors[0].message.find("needs " + std::to_string(8 * mib) +
                                     " bytes (1/2 of the swap files striped over the nvme_paths"),
            std::string::npos)
      << c.errors[0].message;
  EXPECT_TRUE(has(c.notes, "holds " + std::to_string(8 * mib) + " bytes"));

  // --strict: the shortfall is an error at any world size.
  c = check(3, opt, par);
  c.nvme_paths[0].filesystem = 1;
  c.nvme_paths[1].filesystem = 2;
  c.nvme_paths[1].free_bytes = 0;
  CheckNvmeSpace(params, 2, true, &c);
  EXPECT_FALSE(c.ok());
  EXPECT_TRUE(c.warnings.empty());

  // Nothing compared: at stage 2 the reader takes the NVMe offloads as cpu and none (DeepSpeed's
  // rules), so no nvme_path is in use; an "auto" stage is no setting.
  c = check(2, opt, par);
  EXPECT_TRUE(c.nvme_paths.empty());
  c = check(-1, opt, par);
  ASSERT_EQ(c.nvme_paths.size(), 2u);
  for (NvmePathSpace& n : c.nvme_paths) n.free_bytes = 0;
  CheckNvmeSpace(params, 1, false, &c);
  EXPECT_TRUE(c.warnings.empty());
  EXPECT_TRUE(has(c.notes, "not compared with the model's state: zero_optimization.stage"));
  std::error_code ec;
  std::filesystem::remove_all(base, ec);
}

}  // namespace
}  // namespace strata
