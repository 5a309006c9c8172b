// Published DeepSpeed configs (tests/data/ds_configs, reproduced unchanged; see its README) and
// the example in the tree must pass as they are, with the values their authors meant.
#include <cstdlib>
#include <string>

#include <algorithm>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "strata/config.h"
#include "tests/config_test_util.h"

namespace strata {
namespace {

using testing::Dump;
using testing::FindDiag;
using Kind = ConfigDiagnostic::Kind;

std::string SourceDir() {
  const char* env = std::getenv("STRATA_SOURCE_DIR");
  return env != nullptr ? env : STRATA_SOURCE_DIR_DEFAULT;
}

std::string Fixture(const std::string& name) {
  return SourceDir() + "/tests/data/ds_configs/" + name;
}

ConfigCheck MustCheck(const std::string& path, const ParseOptions& o = {}) {
  Result<ConfigCheck> r = CheckDeepSpeedConfigFile(path, o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return ConfigCheck{};
  EXPECT_TRUE(r->ok()) << path << " errors:\n" << Dump(r->errors);
  return *std::move(r);
}

const ConfigDiagnostic* FindWarning(const ConfigCheck& c, Kind kind, const std::string& path) {
  for (const ConfigDiagnostic& w : c.warnings) {
    if (w.kind == kind && w.path == path) return &w;
  }
  return nullptr;
}

class RealConfigs : public ::testing::TestWithParam<const char*> {};

TEST_P(RealConfigs, PassUnchangedAndTheEffectiveConfigIsStable) {
  ConfigCheck c = MustCheck(Fixture(GetParam()));
  ASSERT_TRUE(c.parsed.has_value());
  // Warnings are allowed (typos in published configs are real, and a config written for a
  // trainer may leave the batch sizes out), never errors.
  for (const ConfigDiagnostic& w : c.warnings) {
    EXPECT_TRUE(w.kind == Kind::kUnknownKey || w.kind == Kind::kDeprecated ||
                (w.kind == Kind::kUnresolvedAuto && w.path == "train_batch_size"))
        << w.ToString();
  }
  std::string effective = EffectiveConfigJson(c.parsed->config);
  ConfigCheck again = CheckDeepSpeedConfig(effective);
  ASSERT_TRUE(again.ok()) << Dump(again.errors);
  EXPECT_EQ(EffectiveConfigJson(again.parsed->config), effective);
}

INSTANTIATE_TEST_SUITE_P(Published, RealConfigs,
                         ::testing::Values("hf_ds_config_zero2.json", "hf_ds_config_zero3.json",
                                           "llamafactory_ds_z3_offload_config.json",
                                           "axolotl_zero3_bf16_cpuoffload_all.json",
                                           "dse_ds_zero_stage_infinity_config.json",
                                           "dse_ds_zero_stage_3_config_release.json",
                                           "dse_ds_zero-offload_10B_config.json",
                                           "accelerate_docs_ds_config_auto.json",
                                           "hf_docs_zero3_nvme.json",
                                           "llamafactory_ds_z2_offload_config.json",
                                           "axolotl_zero2_torch_compile.json"));

TEST(RealConfig, HuggingFaceZero2AllAutoResolvesWithTrainerValues) {
  ConfigCheck c = MustCheck(Fixture("hf_ds_config_zero2.json"));
  const EngineConfig& e = c.parsed->config;
  EXPECT_TRUE(c.warnings.empty()) << Dump(c.warnings);
  EXPECT_EQ(e.zero.stage, 2);
  EXPECT_EQ(e.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(e.zero.offload_optimizer.pin_memory);
  EXPECT_EQ(e.zero.allgather_bucket_size, 200000000);
  EXPECT_EQ(e.zero.reduce_bucket_size.value(), 200000000);
  EXPECT_EQ(e.steps_per_print, std::optional<int64_t>(2000));
  EXPECT_EQ(c.parsed->unresolved_auto.size(), 13u);

  ParseOptions o;
  o.world_size = 8;
  o.require_resolved = true;
  o.auto_values = {{"fp16.enabled", "false"},
                   {"bf16.enabled", "true"},
                   {"optimizer.params.lr", "5e-5"},
                   {"optimizer.params.betas", "[0.9, 0.999]"},
                   {"optimizer.params.eps", "1e-8"},
                   {"optimizer.params.weight_decay", "0.0"},
                   {"scheduler.params.warmup_min_lr", "0"},
                   {"scheduler.params.warmup_max_lr", "5e-5"},
                   {"scheduler.params.warmup_num_steps", "100"},
                   {"gradient_accumulation_steps", "2"},
                   {"gradient_clipping", "1.0"},
                   {"train_micro_batch_size_per_gpu", "4"}};
  ConfigCheck resolved = MustCheck(Fixture("hf_ds_config_zero2.json"), o);
  EXPECT_TRUE(resolved.parsed->unresolved_auto.empty());
  EXPECT_EQ(resolved.parsed->config.train_batch_size.value(), 64);
  EXPECT_TRUE(resolved.parsed->config.bf16.enabled.value());
}

TEST(RealConfig, HuggingFaceZero3UsesTheDeprecatedGatherName) {
  ConfigCheck c = MustCheck(Fixture("hf_ds_config_zero3.json"));
  const EngineConfig& e = c.parsed->config;
  EXPECT_EQ(e.zero.stage, 3);
  EXPECT_EQ(e.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(e.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(e.zero.sub_group_size, 100000000000000);
  EXPECT_EQ(e.zero.reduce_bucket_size.value(), 0);
  EXPECT_TRUE(e.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(e.fp16.enabled.value());
  EXPECT_DOUBLE_EQ(e.optimizer.betas.value().first, 0.8);
  // The deprecated name, and the batch sizes it leaves to the Trainer.
  ASSERT_EQ(c.warnings.size(), 2u) << Dump(c.warnings);
  EXPECT_NE(FindWarning(c, Kind::kDeprecated,
                        "zero_optimization.stage3_gather_fp16_weights_on_model_save"),
            nullptr);
  EXPECT_NE(FindWarning(c, Kind::kUnresolvedAuto, "train_batch_size"), nullptr);
}

TEST(RealConfig, LlamaFactoryZ3OffloadResolvesFromHiddenSize) {
  ConfigCheck c = MustCheck(Fixture("llamafactory_ds_z3_offload_config.json"));
  // Its two extra sections are not DeepSpeed keys: warned, kept.
  ASSERT_EQ(c.warnings.size(), 2u) << Dump(c.warnings);
  EXPECT_NE(FindDiag(c.warnings, Kind::kUnknownKey, "comms_config"), nullptr);
  EXPECT_NE(FindDiag(c.warnings, Kind::kUnknownKey, "monitor_config"), nullptr);
  EXPECT_FALSE(c.parsed->config.zero.overlap_comm);

  ParseOptions o;
  o.hidden_size = 4096;
  o.world_size = 2;
  o.require_resolved = true;
  o.auto_values = {{"train_micro_batch_size_per_gpu", "1"},
                   {"gradient_accumulation_steps", "8"},
                   {"gradient_clipping", "1.0"},
                   {"fp16.enabled", "false"},
                   {"bf16.enabled", "true"}};
  ConfigCheck r = MustCheck(Fixture("llamafactory_ds_z3_offload_config.json"), o);
  const ZeroConfig& z = r.parsed->config.zero;
  EXPECT_EQ(z.reduce_bucket_size.value(), 4096 * 4096);
  EXPECT_EQ(z.stage3_prefetch_bucket_size.value(), 15099494);  // int(0.9 * 4096^2)
  EXPECT_EQ(z.stage3_param_persistence_threshold.value(), 40960);
  EXPECT_EQ(r.parsed->config.train_batch_size.value(), 16);
}

TEST(RealConfig, HuggingFaceDocsNvmeExampleHasAioInTheWrongPlace) {
  ConfigCheck c = MustCheck(Fixture("hf_docs_zero3_nvme.json"));  // with its trailing comma
  const ZeroConfig& z = c.parsed->config.zero;
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_param.nvme_path, "/local_nvme");
  EXPECT_EQ(z.offload_param.max_in_cpu, 1000000000);
  // The misplaced section, and the batch sizes it leaves to the Trainer.
  ASSERT_EQ(c.warnings.size(), 2u) << Dump(c.warnings);
  const ConfigDiagnostic* aio = FindWarning(c, Kind::kUnknownKey, "zero_optimization.aio");
  ASSERT_NE(aio, nullptr) << Dump(c.warnings);
  EXPECT_NE(aio->message.find("top-level section"), std::string::npos) << aio->message;
  EXPECT_NE(FindWarning(c, Kind::kUnresolvedAuto, "train_batch_size"), nullptr);
  // So the aio settings there are not applied: DeepSpeed's defaults stay.
  EXPECT_EQ(c.parsed->config.aio.queue_depth, 8);
  EXPECT_EQ(c.parsed->config.aio.block_size, 1048576);
}

TEST(RealConfig, AxolotlUsesTheShortAliases) {
  ConfigCheck c = MustCheck(Fixture("axolotl_zero3_bf16_cpuoffload_all.json"));
  EXPECT_TRUE(c.warnings.empty()) << Dump(c.warnings);
  const ZeroConfig& z = c.parsed->config.zero;
  EXPECT_EQ(z.stage3_max_live_parameters, 0);
  EXPECT_EQ(z.stage3_max_reuse_distance, 0);
  EXPECT_EQ(z.sub_group_size, 0);
  EXPECT_TRUE(z.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(c.parsed->config.bf16.enabled.value());
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kCpu);
}

TEST(RealConfig, ZeroInfinityNvmeAndItsTypo) {
  ConfigCheck c = MustCheck(Fixture("dse_ds_zero_stage_infinity_config.json"));
  const EngineConfig& e = c.parsed->config;
  EXPECT_EQ(e.zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(e.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(e.zero.offload_param.nvme_path, "/nvme_data");
  EXPECT_EQ(e.zero.offload_param.max_in_cpu, 1);
  EXPECT_EQ(e.aio.queue_depth, 16);
  // From the old name thread_count, which DeepSpeed 0.19.8 ignores: read, with a note.
  EXPECT_EQ(e.aio.intra_op_parallelism, 2);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_EQ(c.notes[0].rfind("aio.thread_count: the old name of 'intra_op_parallelism'", 0), 0u)
      << c.notes[0];
  EXPECT_DOUBLE_EQ(e.fp16.loss_scale, 1024);
  ASSERT_EQ(c.warnings.size(), 1u) << Dump(c.warnings);
  EXPECT_NE(c.warnings[0].message.find("did you mean 'stage3_param_persistence_threshold'"),
            std::string::npos);
  // The threshold therefore stays at DeepSpeed's default.
  EXPECT_EQ(e.zero.stage3_param_persistence_threshold.value(), 100000);
}

TEST(RealConfig, Zero3ReleaseConfigDeprecatedKeysAndATypoThatDisablesParamOffload) {
  ConfigCheck c = MustCheck(Fixture("dse_ds_zero_stage_3_config_release.json"));
  const ZeroConfig& z = c.parsed->config.zero;
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(z.offload_optimizer.pin_memory);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNone);  // "cpu_offload_params" is not a key
  const ConfigDiagnostic* w =
      FindDiag(c.warnings, Kind::kUnknownKey, "zero_optimization.cpu_offload_params");
  ASSERT_NE(w, nullptr) << Dump(c.warnings);
  EXPECT_NE(w->message.find("did you mean 'cpu_offload_param'"), std::string::npos);
}

TEST(RealConfig, ZeroOffload10BMultipliesOutForTenRanks) {
  ParseOptions o;
  o.world_size = 10;
  ConfigCheck c = MustCheck(Fixture("dse_ds_zero-offload_10B_config.json"), o);
  EXPECT_EQ(c.parsed->config.train_micro_batch_size_per_gpu.value(), 1);
  EXPECT_EQ(c.parsed->config.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_NE(FindDiag(c.warnings, Kind::kUnknownKey, "zero_optimization.comm_overlap"), nullptr);
  o.world_size = 8;  // 30 / (3 * 8) is not whole
  Result<ConfigCheck> bad =
      CheckDeepSpeedConfigFile(Fixture("dse_ds_zero-offload_10B_config.json"), o);
  ASSERT_TRUE(bad.ok());
  EXPECT_NE(FindDiag(bad->errors, Kind::kConflict, "train_batch_size"), nullptr);
}

TEST(RealConfig, AccelerateFillsTheStageAndTheDevices) {
  ConfigCheck c = MustCheck(Fixture("accelerate_docs_ds_config_auto.json"));
  EXPECT_TRUE(c.warnings.empty()) << Dump(c.warnings);
  const std::vector<std::string>& open = c.parsed->unresolved_auto;
  for (const char* key : {"zero_optimization.stage", "zero_optimization.offload_optimizer.device",
                          "zero_optimization.offload_param.device",
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save"}) {
    EXPECT_NE(std::find(open.begin(), open.end(), key), open.end()) << key;
  }
  EXPECT_EQ(c.parsed->config.unresolved_auto, open);
  EXPECT_TRUE(c.parsed->config.IsAuto("zero_optimization.stage"));
  EXPECT_FALSE(c.parsed->config.IsAuto("steps_per_print"));
  nlohmann::json effective = nlohmann::json::parse(EffectiveConfigJson(c.parsed->config));
  EXPECT_EQ(effective["zero_optimization"]["stage"], "auto");
  EXPECT_EQ(effective["zero_optimization"]["offload_param"]["device"], "auto");

  // What `accelerate launch --zero_stage=2 --offload_param_device=cpu ...` fills in: parameter
  // offload at stage 2 is then judged (and ignored with a warning).
  ParseOptions o;
  o.auto_values = {{"zero_optimization.stage", "2"},
                   {"zero_optimization.offload_optimizer.device", "\"cpu\""},
                   {"zero_optimization.offload_param.device", "\"cpu\""}};
  ConfigCheck r = MustCheck(Fixture("accelerate_docs_ds_config_auto.json"), o);
  EXPECT_EQ(r.parsed->config.zero.stage, 2);
  EXPECT_EQ(r.parsed->config.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(r.parsed->config.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_NE(FindDiag(r.warnings, Kind::kIgnored, "zero_optimization.offload_param.device"),
            nullptr);
}

TEST(RealConfig, TheExampleInTheTreePassesWithoutWarnings) {
  ParseOptions o;
  o.world_size = 8;
  ConfigCheck c = MustCheck(SourceDir() + "/examples/ds_zero3_offload.json", o);
  EXPECT_TRUE(c.warnings.empty()) << Dump(c.warnings);
  const EngineConfig& e = c.parsed->config;
  EXPECT_EQ(e.zero.stage, 3);
  EXPECT_EQ(e.train_batch_size.value(), 4 * 8 * 8);
  EXPECT_EQ(e.zero.stage3_prefetch_bucket_size.value(), 500000000);
  EXPECT_EQ(c.parsed->unresolved_auto,
            std::vector<std::string>{"scheduler.params.total_num_steps"});
}

}  // namespace
}  // namespace strata
