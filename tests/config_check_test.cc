// DeepSpeed config checks: every error (with its JSON path) and every warning (with what happens
// instead), --strict, and the machine checks of --here.
#include <linux/capability.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "strata/config.h"
#include "tests/config_test_util.h"

namespace strata {
namespace {

using testing::Dump;
using testing::FindDiag;
using testing::MustParse;
using Kind = ConfigDiagnostic::Kind;

// Asserts exactly one error of `kind` at `path` whose message contains `needle`.
void ExpectError(const std::string& text, Kind kind, const std::string& path,
                 const std::string& needle, const ParseOptions& o = {}) {
  ConfigCheck c = CheckDeepSpeedConfig(text, o);
  EXPECT_FALSE(c.ok()) << text;
  EXPECT_FALSE(c.parsed.has_value());
  const ConfigDiagnostic* d = FindDiag(c.errors, kind, path);
  ASSERT_NE(d, nullptr) << "no " << DiagnosticKindName(kind) << " error at '" << path
                        << "'; errors:\n"
                        << Dump(c.errors);
  EXPECT_NE(d->message.find(needle), std::string::npos) << d->message;
}

TEST(ConfigCheck, WrongTypesNameThePathAndTheExpectation) {
  ExpectError(R"({"zero_optimization": {"stage": "three"}})", Kind::kType,
              "zero_optimization.stage", "expected an integer");
  ExpectError(R"({"zero_optimization": {"overlap_comm": "yes"}})", Kind::kType,
              "zero_optimization.overlap_comm", "expected true or false");
  ExpectError(R"({"zero_optimization": 5})", Kind::kType, "zero_optimization",
              "expected an object");
  ExpectError(R"({"zero_optimization": {"offload_param": {"nvme_path": 3}}})", Kind::kType,
              "zero_optimization.offload_param.nvme_path", "expected a string");
  ExpectError(R"({"optimizer": {"type": "Adam", "params": {"lr": [1]}}})", Kind::kType,
              "optimizer.params.lr", "expected a number");
  ExpectError(R"({"zero_optimization": {"offload_optimizer": {"device": 1}}})", Kind::kType,
              "zero_optimization.offload_optimizer.device", "expected one of");
  ExpectError(R"({"optimizer": {"params": {}}})", Kind::kType, "optimizer.type", "missing");
}

// A config the check accepts is not refused when the engine starts: the rules the engine applies
// across keys, and the sections of features strata does not run, are the check's too.
TEST(ConfigCheck, WhatTheEngineRefusesTheCheckRefuses) {
  ExpectError(R"({"zero_optimization": {"stage": 1, "zero_quantized_weights": true}})",
              Kind::kConflict, "zero_optimization.zero_quantized_weights", "set it to 3");
  ExpectError(R"({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})",
              Kind::kConflict, "zero_optimization.zero_hpz_partition_size",
              "zero_optimization.stage is 2");
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"zero_optimization": {"stage": 1,
      "zero_quantized_weights": false, "zero_hpz_partition_size": 1}})")
                  .ok());
  ParseOptions four;
  four.world_size = 4;
  ExpectError(R"({"gradient_predivide_factor": 2.0})", Kind::kConflict, "gradient_predivide_factor",
              "supported as 1 or the world size (4) only", four);
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"gradient_predivide_factor": 4})", four).ok());
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"gradient_predivide_factor": 2.0})").ok());  // no world
  ExpectError(R"({"gradient_predivide_factor": 0})", Kind::kRange, "gradient_predivide_factor",
              "> 0");
  ExpectError(R"({"prescale_gradients": "maybe"})", Kind::kType, "prescale_gradients",
              "expected true or false");
  ConfigCheck pre = CheckDeepSpeedConfig(R"({"prescale_gradients": "true",
      "gradient_predivide_factor": 3})",
                                         four);
  ASSERT_TRUE(pre.ok()) << Dump(
      pre.errors);  // prescale divides by the world size whatever the factor
  EXPECT_TRUE(pre.parsed->config.prescale_gradients);
  for (const UnactedKey& k : pre.parsed->config.unacted_keys) {
    EXPECT_NE(k.path, "prescale_gradients");  // read, so not listed as kept-but-unused
  }

  ExpectError(R"({"amp": {"enabled": true, "opt_level": "O1"}})", Kind::kUnsupported, "amp.enabled",
              "bf16 or fp16");
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"amp": {"enabled": false}})").ok());
  ExpectError(R"({"sparse_attention": {"mode": "fixed", "block": 16}})", Kind::kUnsupported,
              "sparse_attention", "sparse attention");
  ExpectError(R"({"compression_training": {"weight_quantization": {"shared_parameters":
      {"enabled": true, "quantizer_kernel": false}}}})",
              Kind::kUnsupported,
              "compression_training.weight_quantization.shared_parameters.enabled",
              "weight_quantization");
  ExpectError(R"({"compression_training": {"layer_reduction": {"enabled": true}}})",
              Kind::kUnsupported, "compression_training.layer_reduction.enabled",
              "layer_reduction");
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"compression_training": {"sparse_pruning":
      {"shared_parameters": {"enabled": false}}}})")
                  .ok());
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"pipeline": {"pipe_partitioned": true}})").ok());
  // Sections that make DeepSpeed train something else (configs from DeepSpeedExamples,
  // Megatron-DeepSpeed, LLaMA-Factory): refused; disabled or size 1, accepted.
  ExpectError(R"({"progressive_layer_drop": {"enabled": true, "theta": 0.5, "gamma": 0.001}})",
              Kind::kUnsupported, "progressive_layer_drop.enabled", "pld_theta");
  ExpectError(R"({"curriculum_learning": {"enabled": true, "curriculum_type": "seqlen"}})",
              Kind::kUnsupported, "curriculum_learning.enabled", "curriculum_seqlen");
  ExpectError(R"({"data_efficiency": {"enabled": true}})", Kind::kUnsupported,
              "data_efficiency.enabled", "random-LTD");
  ExpectError(R"({"tensor_parallel": {"autotp_size": 2}})", Kind::kUnsupported,
              "tensor_parallel.autotp_size", "data-parallel");
  ExpectError(R"({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}})",
              Kind::kUnsupported, "zero_optimization.zenflow", "ZenFlow");
  // The caller's step() as the boundary, of any number of backwards: windows here are
  // gradient_accumulation_steps micro-steps, which would step less often than the script asks.
  ExpectError(R"({"managed_gradient_accumulation": false})", Kind::kUnsupported,
              "managed_gradient_accumulation", "set_gradient_accumulation_boundary");
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"train_micro_batch_size_per_gpu": 1,
      "managed_gradient_accumulation": true})")
                  .ok());
  for (const char* off : {R"({"progressive_layer_drop": {"enabled": false}})",
                          R"({"curriculum_learning": {"enabled": false}})",
                          R"({"data_efficiency": {"enabled": false}})",
                          R"({"tensor_parallel": {"autotp_size": 1}})"}) {
    EXPECT_TRUE(CheckDeepSpeedConfig(off).ok()) << off;
  }
  ExpectError(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
      "nvme_path": "none"}}})",
              Kind::kConflict, "zero_optimization.offload_optimizer.nvme_path",
              "offload_optimizer_nvme_path");
  // aio values strata runs at the nearest bound say so.
  ConfigCheck aio = CheckDeepSpeedConfig(R"({"aio": {"block_size": 512, "queue_depth": 4096}})");
  ASSERT_TRUE(aio.ok()) << Dump(aio.errors);
  const ConfigDiagnostic* block = FindDiag(aio.warnings, Kind::kRange, "aio.block_size");
  ASSERT_NE(block, nullptr) << Dump(aio.warnings);
  EXPECT_NE(block->message.find("use 4096"), std::string::npos) << block->message;
  const ConfigDiagnostic* depth = FindDiag(aio.warnings, Kind::kRange, "aio.queue_depth");
  ASSERT_NE(depth, nullptr) << Dump(aio.warnings);
  EXPECT_NE(depth->message.find("runs as 1024"), std::string::npos) << depth->message;
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"train_micro_batch_size_per_gpu": 1,
      "aio": {"block_size": 1048576, "queue_depth": 32}})")
                  .warnings.empty());
  ConfigCheck gds = CheckDeepSpeedConfig(R"({"aio": {"use_gds": true}})");
  ASSERT_TRUE(gds.ok());
  ASSERT_NE(FindDiag(gds.warnings, Kind::kIgnored, "aio.use_gds"), nullptr) << Dump(gds.warnings);
}

TEST(ConfigCheck, StageAbove3IsAnError) {
  ExpectError(R"({"zero_optimization": {"stage": 4}})", Kind::kRange, "zero_optimization.stage",
              "expected a ZeRO stage 0, 1, 2 or 3, got 4");
}

TEST(ConfigCheck, NegativeSizesAreErrors) {
  for (const char* key : {"reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
                          "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                          "stage3_max_reuse_distance", "stage3_param_persistence_threshold"}) {
    ExpectError(std::string(R"({"zero_optimization": {")") + key + R"(": -5}})", Kind::kRange,
                std::string("zero_optimization.") + key, ">= 0");
  }
  ExpectError(R"({"zero_optimization": {"offload_param": {"buffer_size": "-1e8"}}})", Kind::kRange,
              "zero_optimization.offload_param.buffer_size", ">= 0");
  ExpectError(R"({"aio": {"queue_depth": 0}})", Kind::kRange, "aio.queue_depth", ">= 1");
  ExpectError(R"({"train_micro_batch_size_per_gpu": 0})", Kind::kRange,
              "train_micro_batch_size_per_gpu", ">= 1");
  ExpectError(R"({"gradient_clipping": -1.0})", Kind::kRange, "gradient_clipping", ">= 0");
  ExpectError(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
      "ratio": 1.5}}})",
              Kind::kRange, "zero_optimization.offload_optimizer.ratio", "[0, 1]");
}

TEST(ConfigCheck, UnknownOffloadDeviceIsAnError) {
  ExpectError(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})",
              Kind::kRange, "zero_optimization.offload_param.device",
              "unknown offload device \"gpu\"; expected one of \"none\", \"cpu\", \"nvme\"");
}

TEST(ConfigCheck, NvmeWithoutPathIsAnError) {
  ExpectError(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})",
              Kind::kConflict, "zero_optimization.offload_optimizer.nvme_path", "needs nvme_path");
  ExpectError(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
      "nvme_path": null}}})",
              Kind::kConflict, "zero_optimization.offload_param.nvme_path", "needs nvme_path");
}

TEST(ConfigCheck, Fp16AndBf16BothEnabledIsAnError) {
  ExpectError(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", Kind::kConflict,
              "bf16.enabled", "both enabled");
  // Unresolved "auto" on one side is not (yet) a conflict: the trainer picks one.
  MustParse(R"({"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": true}})");
  ParseOptions o;
  o.auto_values["fp16.enabled"] = "true";
  ExpectError(R"({"fp16": {"enabled": "auto"}, "bf16": {"enabled": true}})", Kind::kConflict,
              "bf16.enabled", "both enabled", o);
}

TEST(ConfigCheck, BetasMustBeAPairInUnitRange) {
  ExpectError(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})", Kind::kType,
              "optimizer.params.betas", "expected a pair [beta1, beta2]");
  ExpectError(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.99, 0.999]}}})",
              Kind::kType, "optimizer.params.betas", "expected a pair");
  ExpectError(R"({"optimizer": {"type": "Adam", "params": {"betas": 0.9}}})", Kind::kType,
              "optimizer.params.betas", "expected a pair");
  ExpectError(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}})", Kind::kRange,
              "optimizer.params.betas", "[0, 1)");
  ExpectError(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9, "x"]}}})", Kind::kType,
              "optimizer.params.betas[1]", "expected a number");
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "optimizer": {"type": "Adam",
      "params": {"betas": ["0.8", 0.9]}}})");
  EXPECT_DOUBLE_EQ(p.config.optimizer.betas.value().first, 0.8);
}

TEST(ConfigCheck, OtherOptimizersAreUnsupported) {
  ExpectError(R"({"optimizer": {"type": "Lamb"}})", Kind::kUnsupported, "optimizer.type",
              "strata runs Adam and AdamW");
}

TEST(ConfigCheck, BatchSizesMustMultiplyOutForTheWorldSize) {
  ParseOptions o;
  o.world_size = 4;
  const char* three = R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2})";
  ExpectError(three, Kind::kConflict, "train_batch_size",
              "64 != train_micro_batch_size_per_gpu 4 "
              "* gradient_accumulation_steps 2 * world_size 4 = 32",
              o);
  o.world_size = 8;
  EXPECT_TRUE(CheckDeepSpeedConfig(three, o).ok());
  // Without a world size: only divisibility can be checked.
  EXPECT_TRUE(CheckDeepSpeedConfig(three).ok());
  ExpectError(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2})",
              Kind::kConflict, "train_batch_size", "no world size multiplies out");
  o.world_size = 3;
  ExpectError(R"({"train_batch_size": 64, "gradient_accumulation_steps": 2})", Kind::kConflict,
              "train_batch_size", "not divisible", o);
  ExpectError(R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4})", Kind::kConflict,
              "train_batch_size", "not divisible", o);
  ExpectError(R"({"train_batch_size": 64})", Kind::kConflict, "train_batch_size",
              "not divisible by world_size 3", o);
}

TEST(ConfigCheck, AnyTwoBatchSizesDetermineTheThird) {
  ParseOptions o;
  o.world_size = 4;
  EngineConfig c =
      MustParse(R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4})", o).config;
  EXPECT_EQ(c.gradient_accumulation_steps.value(), 4);
  c = MustParse(R"({"train_batch_size": 64, "gradient_accumulation_steps": 8})", o).config;
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value(), 2);
  c = MustParse(R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5})", o)
          .config;
  EXPECT_EQ(c.train_batch_size.value(), 60);
  c = MustParse(R"({"train_batch_size": 64})", o).config;
  EXPECT_EQ(c.gradient_accumulation_steps.value(), 1);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value(), 16);
  c = MustParse(R"({"train_micro_batch_size_per_gpu": 5})", o).config;
  EXPECT_EQ(c.gradient_accumulation_steps.value(), 1);
  EXPECT_EQ(c.train_batch_size.value(), 20);
  // Supplied values fill absent batch keys as a trainer does.
  o.auto_values["train_micro_batch_size_per_gpu"] = "2";
  c = MustParse(R"({"gradient_accumulation_steps": 3})", o).config;
  EXPECT_EQ(c.train_batch_size.value(), 24);
}

TEST(ConfigCheck, NoBatchSizeIsAnErrorWhenNothingWillSupplyOne) {
  // With a trainer to fill values, a warning: strata.initialize and DeepSpeed refuse it unless
  // the trainer supplies them.
  ConfigCheck c = CheckDeepSpeedConfig(R"({"zero_optimization": {"stage": 2}})");
  EXPECT_TRUE(c.ok());
  ASSERT_EQ(c.warnings.size(), 1u) << Dump(c.warnings);
  EXPECT_EQ(c.warnings[0].path, "train_batch_size");
  EXPECT_NE(c.warnings[0].message.find("strata.initialize refuses"), std::string::npos);
  // Left "auto" for a trainer: no warning.
  EXPECT_TRUE(
      CheckDeepSpeedConfig(R"({"train_micro_batch_size_per_gpu": "auto"})").warnings.empty());
  ParseOptions o;
  o.require_resolved = true;
  ExpectError(R"({"gradient_accumulation_steps": 2})", Kind::kUnresolvedAuto, "train_batch_size",
              "neither train_batch_size nor", o);
  // A script's own initialize (no trainer): refused, as DeepSpeed refuses it.
  ParseOptions direct;
  direct.trainer_fills_auto = false;
  ExpectError(R"({"zero_optimization": {"stage": 2}})", Kind::kUnresolvedAuto, "train_batch_size",
              "Either train_batch_size or train_micro_batch_size_per_gpu needs", direct);
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"train_batch_size": 8})", direct).ok());
}

TEST(ConfigCheck, UnresolvedAutoNamesEveryKeyWhenValuesAreNeeded) {
  ParseOptions o;
  o.require_resolved = true;
  o.auto_values["optimizer.params.lr"] = "1e-4";
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_micro_batch_size_per_gpu": "auto",
      "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
      "zero_optimization": {"reduce_bucket_size": "auto"}})",
                                       o);
  ASSERT_EQ(c.errors.size(), 1u) << Dump(c.errors);
  EXPECT_EQ(c.errors[0].kind, Kind::kUnresolvedAuto);
  const std::string& m = c.errors[0].message;
  EXPECT_NE(m.find("train_micro_batch_size_per_gpu"), std::string::npos) << m;
  EXPECT_NE(m.find("gradient_clipping"), std::string::npos) << m;
  EXPECT_NE(m.find("zero_optimization.reduce_bucket_size"), std::string::npos) << m;
  EXPECT_EQ(m.find("optimizer.params.lr"), std::string::npos) << m;  // it was supplied
}

// Outside DeepSpeed's config models (see config_auto_test.cc for the sections that drop "auto").
TEST(ConfigCheck, AutoWhereNoTrainerFillsItAndDeepSpeedKeepsItIsAnError) {
  ExpectError(R"({"aio": {"block_size": "auto"}})", Kind::kType, "aio.block_size",
              "\"auto\" is not accepted here");
  ExpectError(R"({"steps_per_print": "auto"})", Kind::kType, "steps_per_print",
              "\"auto\" is not accepted here");
}

TEST(ConfigCheck, AccelerateAutoKeysDeferTheChecksThatNeedThem) {
  // An "auto" stage: offload settings cannot be judged yet, so no stage warnings.
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": "auto", "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "auto"}}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_TRUE(c.warnings.empty()) << Dump(c.warnings);
  EXPECT_EQ(c.parsed->config.zero.offload_optimizer.nvme_path, "");  // not the path "auto"
  EXPECT_EQ(c.parsed->unresolved_auto,
            (std::vector<std::string>{"zero_optimization.stage",
                                      "zero_optimization.offload_optimizer.nvme_path"}));
  ParseOptions o;
  o.require_resolved = true;
  o.auto_values["zero_optimization.stage"] = "3";
  ExpectError(R"({"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "nvme",
      "nvme_path": "auto"}}, "train_batch_size": 8})",
              Kind::kUnresolvedAuto, "zero_optimization.offload_optimizer.nvme_path",
              "still unresolved", o);
}

TEST(ConfigCheck, PartialOffloadBelowStage3IsAnError) {
  ExpectError(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
      "ratio": 0.5}}})",
              Kind::kConflict, "zero_optimization.offload_optimizer.ratio", "needs ZeRO stage 3");
}

TEST(ConfigCheck, OffloadParamBelowStage3IsIgnoredWithAWarning) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 2, "offload_param": {"device": "cpu"}}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  const ConfigDiagnostic* w =
      FindDiag(c.warnings, Kind::kIgnored, "zero_optimization.offload_param.device");
  ASSERT_NE(w, nullptr) << Dump(c.warnings);
  EXPECT_NE(w->message.find("ignored"), std::string::npos);
  EXPECT_EQ(c.parsed->config.zero.offload_param.device, OffloadDevice::kNone);
}

TEST(ConfigCheck, NvmeOptimizerBelowStage3BecomesCpuWithAWarning) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  const ConfigDiagnostic* w =
      FindDiag(c.warnings, Kind::kIgnored, "zero_optimization.offload_optimizer.device");
  ASSERT_NE(w, nullptr) << Dump(c.warnings);
  EXPECT_NE(w->message.find("CPU memory instead"), std::string::npos);
  EXPECT_EQ(c.parsed->config.zero.offload_optimizer.device, OffloadDevice::kCpu);
}

TEST(ConfigCheck, NvmeOnlyKeysWithCpuAreIgnoredWithAWarning) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true, "fast_init": true},
      "offload_param": {"device": "cpu", "buffer_count": 5, "max_in_cpu": 1e9}}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  ASSERT_EQ(c.warnings.size(), 3u) << Dump(c.warnings);
  for (const char* path : {"zero_optimization.offload_optimizer.fast_init",
                           "zero_optimization.offload_param.buffer_count",
                           "zero_optimization.offload_param.max_in_cpu"}) {
    const ConfigDiagnostic* w = FindDiag(c.warnings, Kind::kIgnored, path);
    ASSERT_NE(w, nullptr) << path << "\n" << Dump(c.warnings);
    EXPECT_NE(w->message.find("only applies to device \"nvme\""), std::string::npos);
  }
  // The same keys with nvme: no warning.
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/n", "buffer_count": 5,
      "max_in_cpu": 1e9}}})")
                  .warnings.empty());
}

TEST(ConfigCheck, OptimizerOffloadAtStage0IsIgnored) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "offload_optimizer": {"device": "cpu"}}})");
  ASSERT_TRUE(c.ok());
  EXPECT_NE(FindDiag(c.warnings, Kind::kIgnored, "zero_optimization.offload_optimizer.device"),
            nullptr);
  EXPECT_EQ(c.parsed->config.zero.offload_optimizer.device, OffloadDevice::kNone);
}

TEST(ConfigCheck, DeviceNameInAnotherCaseIsAWarning) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 3, "offload_optimizer": {"device": "None"}, "offload_param": {"device": "CPU"}}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  const ConfigDiagnostic* w =
      FindDiag(c.warnings, Kind::kCase, "zero_optimization.offload_param.device");
  ASSERT_NE(w, nullptr) << Dump(c.warnings);
  EXPECT_NE(w->message.find("write \"cpu\""), std::string::npos);
  EXPECT_NE(FindDiag(c.warnings, Kind::kCase, "zero_optimization.offload_optimizer.device"),
            nullptr);
  EXPECT_EQ(c.parsed->config.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.parsed->config.zero.offload_optimizer.device, OffloadDevice::kNone);
}

TEST(ConfigCheck, UnknownKeysWarnWithTheNearestKnownKey) {
  ConfigCheck c =
      CheckDeepSpeedConfig(R"({"train_batch_szie": 8, "train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 3, "comm_overlap": true,
        "offload_param": {"device": "cpu", "pin_memroy": true}},
      "totally_unrelated": 1})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  auto expect = [&](const char* path, const char* suggestion) {
    const ConfigDiagnostic* w = FindDiag(c.warnings, Kind::kUnknownKey, path);
    ASSERT_NE(w, nullptr) << path << "\n" << Dump(c.warnings);
    if (suggestion == nullptr) {
      EXPECT_EQ(w->message.find("did you mean"), std::string::npos) << w->message;
    } else {
      EXPECT_NE(w->message.find(std::string("did you mean '") + suggestion + "'?"),
                std::string::npos)
          << w->message;
    }
  };
  expect("train_batch_szie", "train_batch_size");
  expect("zero_optimization.comm_overlap", "overlap_comm");
  expect("zero_optimization.offload_param.pin_memroy", "pin_memory");
  expect("totally_unrelated", nullptr);
  EXPECT_EQ(c.warnings.size(), 4u) << Dump(c.warnings);
  // The unknown keys are kept too.
  EXPECT_EQ(c.parsed->config.unacted_keys.size(), 4u);
}

TEST(ConfigCheck, MaxGradNormInOptimizerParamsIsAWarning) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "optimizer": {"type": "Adam",
      "params": {"max_grad_norm": 1.0}}})");
  ASSERT_TRUE(c.ok());
  EXPECT_NE(FindDiag(c.warnings, Kind::kIgnored, "optimizer.params.max_grad_norm"), nullptr);
}

// data_types as DeepSpeed reads them: DtypeEnum spellings, param_dtype the enabled precision
// (DeepSpeed asserts it), grad_accum_dtype not acted on unless fp32, buffer_dtype for the Python
// engine (no diagnostic).
TEST(ConfigCheck, DataTypesAreDeepSpeedsDtypeNames) {
  const char* bf16 = R"({"train_batch_size": 8, "bf16": {"enabled": true}, "data_types": )";
  ConfigCheck ok = CheckDeepSpeedConfig(
      std::string(bf16) +
      R"({"param_dtype": "bfloat16", "buffer_dtype": "torch.bfloat16", "grad_accum_dtype": "fp32"}})");
  EXPECT_TRUE(ok.ok()) << Dump(ok.errors);
  EXPECT_TRUE(ok.warnings.empty()) << Dump(ok.warnings);
  ExpectError(std::string(bf16) + R"({"param_dtype": "fp16"}})", Kind::kConflict,
              "data_types.param_dtype", "conflicts with the enabled precision");
  // A precision left "auto" is the trainer's to decide: no conflict yet.
  EXPECT_TRUE(CheckDeepSpeedConfig(R"({"train_batch_size": 8, "bf16": {"enabled": "auto"},
      "data_types": {"param_dtype": "bf16"}})")
                  .ok());
  ExpectError(std::string(bf16) + R"({"buffer_dtype": "int8"}})", Kind::kType,
              "data_types.buffer_dtype", "not a floating-point dtype");
  ExpectError(std::string(bf16) + R"({"buffer_dtype": 16}})", Kind::kType,
              "data_types.buffer_dtype", "not a floating-point dtype");
  ConfigCheck accum = CheckDeepSpeedConfig(
      std::string(bf16) + R"({"grad_accum_dtype": "bf16", "bufer_dtype": "bf16"}})");
  ASSERT_TRUE(accum.ok()) << Dump(accum.errors);
  EXPECT_NE(FindDiag(accum.warnings, Kind::kIgnored, "data_types.grad_accum_dtype"), nullptr);
  EXPECT_NE(FindDiag(accum.warnings, Kind::kUnknownKey, "data_types.bufer_dtype"), nullptr);
}

// DeepSpeed's CPU Adam keeps 16-bit moments with fp32_optimizer_states false; strata keeps fp32
// ones, which a run sized for the smaller state needs to know (true, the default, is silent).
TEST(ConfigCheck, Fp32OptimizerStatesFalseIsAWarning) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
      "params": {"fp32_optimizer_states": false}}})");
  ASSERT_TRUE(c.ok());
  const ConfigDiagnostic* d =
      FindDiag(c.warnings, Kind::kIgnored, "optimizer.params.fp32_optimizer_states");
  ASSERT_NE(d, nullptr) << Dump(c.warnings);
  EXPECT_NE(d->message.find("keeps Adam's moments in fp32"), std::string::npos);
  EXPECT_EQ(FindDiag(CheckDeepSpeedConfig(R"({"train_batch_size": 8, "optimizer": {"type":
      "AdamW", "params": {"fp32_optimizer_states": true}}})")
                         .warnings,
                     Kind::kIgnored, "optimizer.params.fp32_optimizer_states"),
            nullptr);
}

// optimizer.params are the keyword arguments of DeepSpeed's Adam / AdamW: another name (a
// TypeError there) is an unknown key with a suggestion, the implementation knobs are kept and
// listed as not acted on, and the variants strata's Adam lacks are refused.
TEST(ConfigCheck, OptimizerParamsAreAdamsArguments) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
      "params": {"lr": 1e-3, "weight_decy": 0.1, "torch_adam": true, "amsgrad": false}}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  const ConfigDiagnostic* typo =
      FindDiag(c.warnings, Kind::kUnknownKey, "optimizer.params.weight_decy");
  ASSERT_NE(typo, nullptr) << Dump(c.warnings);
  EXPECT_NE(typo->message.find("did you mean 'weight_decay'"), std::string::npos);
  EXPECT_EQ(c.warnings.size(), 1u) << Dump(c.warnings);  // torch_adam and amsgrad are known
  EXPECT_EQ(c.parsed->config.optimizer.weight_decay.value_or(0.0), 0.0);  // not the typo's 0.1
  EXPECT_EQ(c.parsed->config.unacted_keys.size(), 3u);
  for (const char* variant : {"amsgrad", "maximize"}) {
    ConfigCheck v = CheckDeepSpeedConfig(std::string(R"({"train_batch_size": 8, "optimizer": {
        "type": "Adam", "params": {")") + variant +
                                         R"(": true}}})");
    EXPECT_FALSE(v.ok());
    EXPECT_NE(FindDiag(v.errors, Kind::kUnsupported, std::string("optimizer.params.") + variant),
              nullptr)
        << Dump(v.errors);
  }
}

TEST(ConfigCheck, SixteenBitMasterAndOptimizerStatesAreNamedAsNotActedOn) {
  // The keys that shrink DeepSpeed's state (bf16 / fp16 masters, gradients, Adam moments): strata
  // keeps fp32 state, so a run sized for the smaller one is told, naming each key given true.
  ConfigCheck bf = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "bf16": {"enabled": true,
      "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true},
      "zero_optimization": {"stage": 3}})");
  ASSERT_TRUE(bf.ok()) << Dump(bf.errors);
  ASSERT_EQ(bf.warnings.size(), 2u) << Dump(bf.warnings);
  const ConfigDiagnostic* m =
      FindDiag(bf.warnings, Kind::kIgnored, "bf16.bf16_master_weights_and_grads");
  const ConfigDiagnostic* v = FindDiag(bf.warnings, Kind::kIgnored, "bf16.bf16_optimizer_states");
  ASSERT_NE(m, nullptr) << Dump(bf.warnings);
  ASSERT_NE(v, nullptr) << Dump(bf.warnings);
  EXPECT_NE(m->message.find("fp32 master weights"), std::string::npos) << m->message;
  EXPECT_NE(v->message.find("moments in fp32"), std::string::npos) << v->message;
  // The old section name, and fp16's key.
  ConfigCheck old = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "bfloat16": {"enabled": true,
      "bf16_optimizer_states": true}})");
  ASSERT_EQ(old.warnings.size(), 1u) << Dump(old.warnings);
  EXPECT_NE(FindDiag(old.warnings, Kind::kIgnored, "bfloat16.bf16_optimizer_states"), nullptr);
  ConfigCheck fp = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "fp16": {"enabled": true,
      "fp16_master_weights_and_grads": true}})");
  ASSERT_EQ(fp.warnings.size(), 1u) << Dump(fp.warnings);
  EXPECT_NE(FindDiag(fp.warnings, Kind::kIgnored, "fp16.fp16_master_weights_and_grads"), nullptr);
  // False, or with 16-bit training off (DeepSpeed then does not read them): nothing to say.
  for (const char* quiet :
       {R"({"train_batch_size": 8, "bf16": {"enabled": true, "bf16_optimizer_states": false}})",
        R"({"train_batch_size": 8, "bf16": {"enabled": false, "bf16_optimizer_states": true}})",
        R"({"train_batch_size": 8, "fp16": {"enabled": false,
            "fp16_master_weights_and_grads": true}})"}) {
    ConfigCheck q = CheckDeepSpeedConfig(quiet);
    EXPECT_TRUE(q.ok()) << quiet;
    EXPECT_TRUE(q.warnings.empty()) << quiet << "\n" << Dump(q.warnings);
  }
}

TEST(ConfigCheck, StrictTurnsEveryWarningIntoAnError) {
  const char* text = R"({"train_batch_size": 8, "zero_optimization": {"stage": 2,
      "offload_param": {"device": "cpu"}, "cpu_offload": true, "overlap_com": true}})";
  ConfigCheck lax = CheckDeepSpeedConfig(text);
  ASSERT_TRUE(lax.ok());
  ASSERT_EQ(lax.warnings.size(), 3u) << Dump(lax.warnings);
  ParseOptions o;
  o.strict = true;
  ConfigCheck strict = CheckDeepSpeedConfig(text, o);
  EXPECT_FALSE(strict.ok());
  EXPECT_TRUE(strict.warnings.empty());
  ASSERT_EQ(strict.errors.size(), 3u) << Dump(strict.errors);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(strict.errors[i].path, lax.warnings[i].path);
    EXPECT_NE(strict.errors[i].message.find("--strict"), std::string::npos);
  }
}

TEST(ConfigCheck, DiagnosticsCarryTheLineAndColumnOfTheirKey) {
  const char* text =
      "{\n"
      "  \"train_batch_size\": 8,\n"
      "  \"zero_optimization\": {\n"
      "    \"stage\": 4,\n"
      "    \"offload_optimizer\": {\"device\": \"nvme\"},\n"
      "    /* comment */ \"overlap_com\": true\n"
      "  }\n"
      "}";
  ConfigCheck c = CheckDeepSpeedConfig(text);
  const ConfigDiagnostic* stage = FindDiag(c.errors, Kind::kRange, "zero_optimization.stage");
  ASSERT_NE(stage, nullptr) << Dump(c.errors);
  EXPECT_EQ(stage->line, 4);
  EXPECT_EQ(stage->column, 5);
  EXPECT_EQ(stage->ToString().rfind("zero_optimization.stage (line 4, column 5): ", 0), 0u)
      << stage->ToString();
  // An absent key is located at its nearest enclosing key.
  const ConfigDiagnostic* path =
      FindDiag(c.errors, Kind::kConflict, "zero_optimization.offload_optimizer.nvme_path");
  ASSERT_NE(path, nullptr) << Dump(c.errors);
  EXPECT_EQ(path->line, 5);
  EXPECT_EQ(path->column, 5);
  const ConfigDiagnostic* typo =
      FindDiag(c.warnings, Kind::kUnknownKey, "zero_optimization.overlap_com");
  ASSERT_NE(typo, nullptr) << Dump(c.warnings);
  EXPECT_EQ(typo->line, 6);
  EXPECT_EQ(typo->column, 19);
}

TEST(ConfigCheck, DuplicateKeyPointsAtTheSecondOccurrence) {
  ConfigCheck c = CheckDeepSpeedConfig("{\"a\": {\"x\": 1,\n  \"x\": 2}}");
  const ConfigDiagnostic* d = FindDiag(c.errors, Kind::kDuplicateKey, "a.x");
  ASSERT_NE(d, nullptr) << Dump(c.errors);
  EXPECT_EQ(d->line, 2);
  EXPECT_EQ(d->column, 3);
}

TEST(ConfigCheck, SuppliedValueWithoutAnAutoIsNoted) {
  ParseOptions o;
  o.auto_values = {{"optimizer.params.lr", "1e-4"}, {"train_micro_batch_size_per_gpu", "2"}};
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_micro_batch_size_per_gpu": "auto",
      "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})",
                                       o);
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_NE(c.notes[0].find("'optimizer.params.lr' is not used"), std::string::npos);
  EXPECT_DOUBLE_EQ(c.parsed->config.optimizer.lr.value(), 0.1);  // not overridden
}

// A unique directory under STRATA_TEST_TMPDIR, removed at the end of the test.
class TempDir {
 public:
  explicit TempDir(const std::string& name) {
    const char* base = std::getenv("STRATA_TEST_TMPDIR");
    path_ = std::filesystem::path(base ? base : "/tmp") /
            ("config_check_" + name + "_" + std::to_string(getpid()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all,
                                 std::filesystem::perm_options::add, ec);
    std::filesystem::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

std::string NvmeConfig(const std::string& path) {
  return R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
         path + R"("}}})";
}

TEST(ConfigCheck, NvmePathIsCheckedOnlyWithHere) {
  TempDir tmp("here");
  std::string missing = tmp.str() + "/does/not/exist";
  EXPECT_TRUE(CheckDeepSpeedConfig(NvmeConfig(missing)).ok());  // written for another machine
  ParseOptions o;
  o.check_here = true;
  ExpectError(NvmeConfig(missing), Kind::kMachine, "zero_optimization.offload_optimizer.nvme_path",
              "does not exist on this machine", o);
}

TEST(ConfigCheck, HereReportsFreeSpaceAndWarnsWhenLow) {
  TempDir tmp("free");
  std::string dir = tmp.str();
  ParseOptions o;
  o.check_here = true;
  o.min_free_bytes = 0;
  ConfigCheck c = CheckDeepSpeedConfig(NvmeConfig(dir), o);
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_NE(c.notes[0].find("bytes free"), std::string::npos);
  EXPECT_TRUE(c.warnings.empty());
  o.min_free_bytes = INT64_MAX;  // more than any disk has
  c = CheckDeepSpeedConfig(NvmeConfig(dir), o);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(FindDiag(c.warnings, Kind::kMachine, "zero_optimization.offload_optimizer.nvme_path"),
            nullptr);
}

// Each nvme_path in use is recorded with its free space, once per key (the planner compares it
// with the model's state: planner_config_test); a path on cpu is not looked at.
TEST(ConfigCheck, HereRecordsEachNvmePathInUse) {
  TempDir tmp("paths");
  const std::string opt = tmp.str() + "/opt", par = tmp.str() + "/par";
  std::filesystem::create_directories(opt);
  std::filesystem::create_directories(par);
  auto cfg = [](const std::string& param_device, const std::string& a, const std::string& b) {
    return R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
           a + R"("}, "offload_param": {"device": ")" + param_device + R"(", "nvme_path": ")" + b +
           R"("}}})";
  };
  ParseOptions o;
  o.check_here = true;
  o.min_free_bytes = 0;
  ConfigCheck c = CheckDeepSpeedConfig(cfg("nvme", opt, par), o);
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  ASSERT_EQ(c.nvme_paths.size(), 2u);
  EXPECT_EQ(c.nvme_paths[0].key, "zero_optimization.offload_optimizer.nvme_path");
  EXPECT_EQ(c.nvme_paths[0].dir, opt);
  EXPECT_EQ(c.nvme_paths[1].key, "zero_optimization.offload_param.nvme_path");
  EXPECT_EQ(c.nvme_paths[1].dir, par);
  for (const NvmePathSpace& n : c.nvme_paths) EXPECT_GT(n.free_bytes, 0);
  c = CheckDeepSpeedConfig(cfg("nvme", opt, opt), o);  // one directory, both keys
  ASSERT_EQ(c.nvme_paths.size(), 2u);
  EXPECT_EQ(c.nvme_paths[1].dir, opt);
  // offload_param on cpu: its nvme_path is ignored (a warning says so), not checked.
  c = CheckDeepSpeedConfig(cfg("cpu", opt, tmp.str() + "/missing"), o);
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  ASSERT_EQ(c.nvme_paths.size(), 1u);
  EXPECT_EQ(c.nvme_paths[0].dir, opt);
  // A path that does not exist is an error and not recorded.
  c = CheckDeepSpeedConfig(cfg("nvme", opt, tmp.str() + "/missing"), o);
  EXPECT_FALSE(c.ok());
  EXPECT_EQ(c.nvme_paths.size(), 1u);
}

TEST(ConfigCheck, HereRejectsAFile) {
  TempDir tmp("kinds");
  std::string dir = tmp.str();
  std::string file = dir + "/file";
  FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  ParseOptions o;
  o.check_here = true;
  ExpectError(NvmeConfig(file), Kind::kMachine, "zero_optimization.offload_optimizer.nvme_path",
              "is not a directory", o);
}

// Drops the capabilities that let root write through permission bits, from the effective and
// the permitted set (access() checks a root caller against the permitted set).
bool DropDacOverride() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &hdr, data) != 0) return false;
  for (int cap : {CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER}) {
    data[cap / 32].effective &= ~(1u << (cap % 32));
    data[cap / 32].permitted &= ~(1u << (cap % 32));
  }
  return syscall(SYS_capset, &hdr, data) == 0;
}

TEST(ConfigCheck, HereRejectsAnUnwritableDirectory) {
  TempDir tmp("ro");
  std::string ro = tmp.str() + "/ro";
  std::filesystem::create_directories(ro);
  ASSERT_EQ(chmod(ro.c_str(), 0555), 0);
  ParseOptions o;
  o.check_here = true;
  // Root writes through 0555, so the check runs in a child that has given up that power (the
  // same check runs unchanged for a non-root user).
  EXPECT_EXIT(
      {
        if (geteuid() == 0 && !DropDacOverride()) {
          std::fprintf(stderr, "could not drop CAP_DAC_OVERRIDE\n");
          std::_Exit(3);
        }
        ExpectError(NvmeConfig(ro), Kind::kMachine, "zero_optimization.offload_optimizer.nvme_path",
                    "is not writable", o);
        std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0), "");
  chmod(ro.c_str(), 0755);
}

}  // namespace
}  // namespace strata
