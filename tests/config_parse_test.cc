// DeepSpeed config parser: text layer (comments, trailing commas, malformed JSON, duplicates),
// lenient scalars, "auto", aliases, deprecated keys and DeepSpeed's defaults.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "strata/config.h"
#include "tests/config_test_util.h"

namespace strata {
namespace {

using testing::Dump;
using testing::FindDiag;
using testing::MustParse;
using Kind = ConfigDiagnostic::Kind;

TEST(ConfigParse, CommentsOfEveryKindAreIgnoredButNotInsideStrings) {
  const char* text = R"(// leading line comment
{
  /* block
     comment */ "train_micro_batch_size_per_gpu": 2,  // trailing
  # hjson-style hash comment
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt//nvme/* not a comment */#x"}
  }
})";
  ParsedConfig p = MustParse(text);
  EXPECT_EQ(p.config.train_micro_batch_size_per_gpu.value(), 2);
  EXPECT_EQ(p.config.zero.offload_optimizer.nvme_path, "/mnt//nvme/* not a comment */#x");
}

TEST(ConfigParse, EscapedQuoteInStringDoesNotEndIt) {
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/a\"//b"}}})");
  EXPECT_EQ(p.config.zero.offload_param.nvme_path, "/a\"//b");
}

TEST(ConfigParse, TrailingCommasAreAccepted) {
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "optimizer": {"type": "Adam",
      "params": {"betas": [0.9, 0.99,], /* c */ }, }, })");
  EXPECT_DOUBLE_EQ(p.config.optimizer.betas.value().second, 0.99);
}

TEST(ConfigParse, MalformedJsonReportsLineAndColumn) {
  // Missing comma after the first member: the parser stops at the string on line 3, column 3.
  ConfigCheck c = CheckDeepSpeedConfig("{\n  \"train_batch_size\": 8\n  \"steps_per_print\": 1\n}");
  ASSERT_EQ(c.errors.size(), 1u);
  EXPECT_EQ(c.errors[0].kind, Kind::kSyntax);
  EXPECT_EQ(c.errors[0].line, 3);
  EXPECT_EQ(c.errors[0].column, 3);
  EXPECT_NE(c.errors[0].message.find("malformed JSON"), std::string::npos);
  EXPECT_NE(c.errors[0].ToString().find("line 3, column 3"), std::string::npos);
}

TEST(ConfigParse, LineAndColumnCountCommentsBeforeTheError) {
  ConfigCheck c = CheckDeepSpeedConfig("// one\n/* two\n three */ {\"a\": 1,, }");
  ASSERT_EQ(c.errors.size(), 1u);
  EXPECT_EQ(c.errors[0].line, 3);
  EXPECT_EQ(c.errors[0].column, 19);  // the second comma
}

// JSON's reader would take a NUL byte for the end of the text and drop what follows (here an
// invalid stage): refused where it is.
TEST(ConfigParse, ANulByteIsASyntaxError) {
  const std::string before = "{\"train_batch_size\": 8}";
  std::string text = before;
  text += '\0';
  text += "{\"zero_optimization\": {\"stage\": \"bogus\"}}";
  ConfigCheck c = CheckDeepSpeedConfig(text);
  ASSERT_EQ(c.errors.size(), 1u) << Dump(c.errors);
  EXPECT_EQ(c.errors[0].kind, Kind::kSyntax);
  EXPECT_NE(c.errors[0].message.find("NUL byte"), std::string::npos) << c.errors[0].message;
  EXPECT_EQ(c.errors[0].line, 1);
  EXPECT_EQ(c.errors[0].column, static_cast<int>(before.size()) + 1);
}

TEST(ConfigParse, UnterminatedBlockCommentIsASyntaxError) {
  ConfigCheck c = CheckDeepSpeedConfig("{\n  \"a\": 1 /* open\n}");
  ASSERT_EQ(c.errors.size(), 1u);
  EXPECT_EQ(c.errors[0].kind, Kind::kSyntax);
  EXPECT_EQ(c.errors[0].line, 2);
  EXPECT_EQ(c.errors[0].column, 10);
}

TEST(ConfigParse, MalformedBytesAreQuotedPrintably) {
  ConfigCheck c = CheckDeepSpeedConfig("{\"a\": \"\xff\xfe\"}");
  ASSERT_EQ(c.errors.size(), 1u);
  EXPECT_NE(c.errors[0].message.find("\\xff"), std::string::npos) << c.errors[0].message;
  // The message is valid UTF-8: it can be written as JSON.
  EXPECT_NO_THROW(nlohmann::json(c.errors[0].message).dump());
}

TEST(ConfigParse, TopLevelMustBeAnObject) {
  ConfigCheck c = CheckDeepSpeedConfig("[1, 2]");
  ASSERT_EQ(c.errors.size(), 1u);
  EXPECT_EQ(c.errors[0].kind, Kind::kType);
}

TEST(ConfigParse, DuplicateKeysAreRejectedWithTheirPath) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "device": "nvme"},
                          "stage": 3},
    "train_batch_size": 16})");
  EXPECT_FALSE(c.ok());
  EXPECT_NE(FindDiag(c.errors, Kind::kDuplicateKey, "zero_optimization.stage"), nullptr)
      << Dump(c.errors);
  EXPECT_NE(FindDiag(c.errors, Kind::kDuplicateKey, "zero_optimization.offload_optimizer.device"),
            nullptr)
      << Dump(c.errors);
  EXPECT_NE(FindDiag(c.errors, Kind::kDuplicateKey, "train_batch_size"), nullptr);
}

TEST(ConfigParse, SameKeyInDifferentObjectsIsNotADuplicate) {
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "fp16": {"enabled": false},
      "bf16": {"enabled": true}})");
  EXPECT_TRUE(p.config.bf16.enabled.value());
}

TEST(ConfigParse, NumbersAsNumbersOrStrings) {
  ParsedConfig p = MustParse(R"({"train_batch_size": "64",
      "zero_optimization": {"stage": "3", "reduce_bucket_size": "5e8",
        "allgather_bucket_size": 2e8, "sub_group_size": " 1e9 ",
        "stage3_max_live_parameters": 3.0e9},
      "gradient_clipping": "1.0", "optimizer": {"type": "AdamW", "params": {"lr": "3e-5"}}})");
  const EngineConfig& c = p.config;
  EXPECT_EQ(c.train_batch_size.value(), 64);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.reduce_bucket_size.value(), 500000000);
  EXPECT_EQ(c.zero.allgather_bucket_size, 200000000);
  EXPECT_EQ(c.zero.sub_group_size, 1000000000);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 3000000000);
  EXPECT_DOUBLE_EQ(c.gradient_clipping.value(), 1.0);
  EXPECT_DOUBLE_EQ(c.optimizer.lr.value(), 3e-5);
}

TEST(ConfigParse, NonIntegralOrNonNumericStringsForIntegersAreTypeErrors) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "reduce_bucket_size": 1.5, "sub_group_size": "lots", "allgather_bucket_size": "0x10",
      "stage3_max_live_parameters": true}})");
  for (const char* key : {"reduce_bucket_size", "sub_group_size", "allgather_bucket_size",
                          "stage3_max_live_parameters"}) {
    const ConfigDiagnostic* d =
        FindDiag(c.errors, Kind::kType, std::string("zero_optimization.") + key);
    ASSERT_NE(d, nullptr) << key << "\n" << Dump(c.errors);
    EXPECT_NE(d->message.find("expected an integer"), std::string::npos);
  }
}

TEST(ConfigParse, NumbersThatOverflowAreTypeErrors) {
  // Beyond double: the JSON layer reports it, with its position (never an exception).
  ConfigCheck overflow = CheckDeepSpeedConfig("{\n  \"gradient_clipping\": 1e400}");
  ASSERT_EQ(overflow.errors.size(), 1u);
  EXPECT_EQ(overflow.errors[0].kind, Kind::kRange);
  EXPECT_NE(overflow.errors[0].message.find("1e400"), std::string::npos);
  EXPECT_EQ(overflow.errors[0].line, 2);
  EXPECT_EQ(overflow.errors[0].column, 24);
  // Beyond int64: a type error of the key; "1e400" as a string overflows strtod.
  ConfigCheck c = CheckDeepSpeedConfig(R"({"gradient_clipping": "1e400",
      "zero_optimization": {"reduce_bucket_size": 1e30, "sub_group_size": 18446744073709551615}})");
  EXPECT_NE(FindDiag(c.errors, Kind::kType, "gradient_clipping"), nullptr) << Dump(c.errors);
  EXPECT_NE(FindDiag(c.errors, Kind::kType, "zero_optimization.reduce_bucket_size"), nullptr);
  EXPECT_NE(FindDiag(c.errors, Kind::kType, "zero_optimization.sub_group_size"), nullptr);
}

TEST(ConfigParse, BooleansAcceptStringsTrueFalse) {
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 2,
      "overlap_comm": "true", "contiguous_gradients": "False"}})");
  EXPECT_TRUE(p.config.zero.overlap_comm);
  EXPECT_FALSE(p.config.zero.contiguous_gradients);
}

TEST(ConfigParse, DefaultsAreDeepSpeeds) {
  ParsedConfig p = MustParse(R"({"train_micro_batch_size_per_gpu": 1})");
  const EngineConfig& c = p.config;
  EXPECT_DOUBLE_EQ(c.gradient_clipping.value(), 1.0);  // DeepSpeed 0.19.8's (0 before)
  EXPECT_FALSE(c.steps_per_print.has_value());         // DeepSpeed's None: no progress lines
  EXPECT_FALSE(c.prescale_gradients);
  EXPECT_EQ(c.gradient_predivide_factor, 1.0);
  EXPECT_FALSE(c.fp16.enabled.value());
  EXPECT_EQ(c.fp16.loss_scale, 0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1);
  EXPECT_FALSE(c.bf16.enabled.value());
  EXPECT_EQ(c.optimizer.type, OptimizerType::kNone);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kNone);
  EXPECT_EQ(c.aio.block_size, 1048576);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_FALSE(c.aio.use_gds);
  const ZeroConfig& z = c.zero;
  EXPECT_EQ(z.stage, 0);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 4);
  EXPECT_FALSE(z.offload_optimizer.pin_memory);
  EXPECT_DOUBLE_EQ(z.offload_optimizer.ratio, 1.0);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(z.offload_param.buffer_count, 5);
  EXPECT_EQ(z.offload_param.buffer_size, 100000000);
  EXPECT_EQ(z.offload_param.max_in_cpu, 1000000000);
  EXPECT_FALSE(z.overlap_comm);  // stage 0
  EXPECT_TRUE(z.contiguous_gradients);
  EXPECT_TRUE(z.reduce_scatter);
  EXPECT_EQ(z.reduce_bucket_size.value(), 500000000);
  EXPECT_TRUE(z.allgather_partitions);
  EXPECT_EQ(z.allgather_bucket_size, 500000000);
  EXPECT_EQ(z.sub_group_size, 1000000000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size.value(), 50000000);
  EXPECT_EQ(z.stage3_param_persistence_threshold.value(), 100000);
  EXPECT_EQ(z.stage3_model_persistence_threshold, INT64_MAX);
  EXPECT_EQ(z.stage3_max_live_parameters, 1000000000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1000000000);
  EXPECT_FALSE(z.stage3_gather_16bit_weights_on_model_save);
  EXPECT_FALSE(z.zero_quantized_weights);
  EXPECT_FALSE(z.zero_quantized_gradients);
  EXPECT_EQ(z.zero_hpz_partition_size, 1);
}

TEST(ConfigParse, OverlapCommDefaultsToTrueOnlyAtStage3) {
  EXPECT_TRUE(MustParse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3}})")
                  .config.zero.overlap_comm);
  EXPECT_FALSE(MustParse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 2}})")
                   .config.zero.overlap_comm);
  EXPECT_FALSE(MustParse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "overlap_comm": false}})")
                   .config.zero.overlap_comm);
}

TEST(ConfigParse, OptimizerDefaultsAndAdamWForcesDecoupledDecay) {
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "optimizer": {"type": "adam"}})");
  const OptimizerConfig& o = p.config.optimizer;
  EXPECT_EQ(o.type, OptimizerType::kAdam);
  EXPECT_DOUBLE_EQ(o.lr.value(), 1e-3);
  EXPECT_DOUBLE_EQ(o.betas.value().first, 0.9);
  EXPECT_DOUBLE_EQ(o.betas.value().second, 0.999);
  EXPECT_DOUBLE_EQ(o.eps.value(), 1e-8);
  EXPECT_DOUBLE_EQ(o.weight_decay.value(), 0.0);
  EXPECT_TRUE(o.adam_w_mode);  // DeepSpeed's Adam defaults to AdamW behaviour
  EXPECT_TRUE(o.bias_correction);

  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
      "params": {"adam_w_mode": false, "torch_adam": true}}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_TRUE(c.parsed->config.optimizer.adam_w_mode);
  EXPECT_EQ(c.parsed->config.optimizer.other_params.at("torch_adam"), "true");
  EXPECT_NE(FindDiag(c.warnings, Kind::kIgnored, "optimizer.params.adam_w_mode"), nullptr);
}

TEST(ConfigParse, SchedulerParamsAreKeptAsGiven) {
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_momentum": true,
      "decay_step_size": 1000}}})");
  EXPECT_EQ(p.config.scheduler.type, SchedulerType::kOneCycle);
  EXPECT_EQ(p.config.scheduler.type_name, "OneCycle");
  EXPECT_EQ(p.config.scheduler.params.at("cycle_momentum"), "true");
  EXPECT_EQ(p.config.scheduler.params.at("decay_step_size"), "1000");
  for (const char* t : {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest"}) {
    const std::string total =
        std::string(t) == "WarmupDecayLR" || std::string(t) == "WarmupCosineLR"
            ? R"(, "params": {"total_num_steps": 100})"
            : "";
    ParsedConfig q = MustParse(std::string(R"({"train_batch_size": 8, "scheduler": {"type": ")") +
                               t + "\"" + total + "}}");
    EXPECT_EQ(SchedulerTypeName(q.config.scheduler.type), t);
  }
}

// The scheduler's params are checked as the engine's LrSchedule reads them (DeepSpeed's
// constructors: a TypeError for an unknown name, its own range checks), naming the key and its
// place, once no "auto" a trainer fills is left there.
TEST(ConfigParse, SchedulerParamsAreCheckedAsTheEngineReadsThem) {
  const struct {
    const char* params;
    const char* path;
    const char* says;
  } cases[] = {
      {R"("type": "WarmupLR", "params": {"warmup_steps": 100})", "scheduler.params.warmup_steps",
       "not a parameter of WarmupLR"},
      {R"("type": "WarmupLR", "params": {"warmup_num_steps": 0})",
       "scheduler.params.warmup_num_steps", ">= 1"},
      {R"("type": "WarmupDecayLR", "params": {"warmup_num_steps": 10})",
       "scheduler.params.total_num_steps", "WarmupDecayLR requires it"},
      {R"("type": "OneCycle", "params": {"cycle_min_lr": 1e-5})", "scheduler.params.cycle_max_lr",
       "OneCycle requires it"},
  };
  for (const auto& c : cases) {
    const std::string text =
        std::string(R"({"train_batch_size": 8, "scheduler": {)") + c.params + "}}";
    ConfigCheck check = CheckDeepSpeedConfig(text);
    ASSERT_FALSE(check.ok()) << text;
    ASSERT_EQ(check.errors.size(), 1u) << Dump(check.errors);
    EXPECT_EQ(check.errors[0].path, c.path) << Dump(check.errors);
    EXPECT_NE(check.errors[0].message.find(c.says), std::string::npos) << Dump(check.errors);
    EXPECT_GT(check.errors[0].line, 0) << Dump(check.errors);  // located in the text
  }
  // Left for a trainer: checked once resolved.
  ConfigCheck waiting = CheckDeepSpeedConfig(
      R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
          "params": {"total_num_steps": "auto", "warmup_num_steps": 0}}})");
  EXPECT_TRUE(waiting.ok()) << Dump(waiting.errors);
  ParseOptions resolved;
  resolved.auto_values["scheduler.params.total_num_steps"] = "100";
  ConfigCheck bad = CheckDeepSpeedConfig(
      R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
          "params": {"total_num_steps": "auto", "warmup_num_steps": 0}}})",
      resolved);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.errors[0].path, "scheduler.params.warmup_num_steps") << Dump(bad.errors);
}

TEST(ConfigParse, AutoIsKeptAndListedInDocumentOrder) {
  ParsedConfig p = MustParse(R"({"train_batch_size": "auto",
      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                    "weight_decay": "auto"}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}})");
  const EngineConfig& c = p.config;
  EXPECT_TRUE(c.train_batch_size.is_auto());
  EXPECT_TRUE(c.fp16.enabled.is_auto());
  EXPECT_TRUE(c.optimizer.betas.is_auto());
  EXPECT_TRUE(c.zero.reduce_bucket_size.is_auto());
  EXPECT_EQ(c.scheduler.params.at("warmup_num_steps"), "\"auto\"");
  std::vector<std::string> expected = {"train_batch_size",
                                       "train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps",
                                       "gradient_clipping",
                                       "fp16.enabled",
                                       "bf16.enabled",
                                       "optimizer.params.lr",
                                       "optimizer.params.betas",
                                       "optimizer.params.eps",
                                       "optimizer.params.weight_decay",
                                       "scheduler.params.warmup_num_steps",
                                       "zero_optimization.reduce_bucket_size",
                                       "zero_optimization.stage3_prefetch_bucket_size",
                                       "zero_optimization.stage3_param_persistence_threshold"};
  EXPECT_EQ(p.unresolved_auto, expected);
}

TEST(ConfigParse, AutoIsResolvedFromSuppliedValuesAndHiddenSize) {
  ParseOptions o;
  o.world_size = 4;
  o.hidden_size = 1000;
  o.auto_values = {{"train_micro_batch_size_per_gpu", "2"},
                   {"gradient_accumulation_steps", "8"},
                   {"optimizer.params.lr", "1e-4"},
                   {"optimizer.params.betas", "[0.9, 0.95]"},
                   {"bf16.enabled", "true"},
                   {"scheduler.params.total_num_steps", "500"}};
  o.require_resolved = true;
  ParsedConfig p = MustParse(R"({"train_batch_size": "auto",
      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "bf16": {"enabled": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}})",
                             o);
  const EngineConfig& c = p.config;
  EXPECT_TRUE(p.unresolved_auto.empty());
  EXPECT_EQ(c.train_batch_size.value(), 2 * 8 * 4);  // derived by the batch rule
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value(), 2);
  EXPECT_DOUBLE_EQ(c.optimizer.lr.value(), 1e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.betas.value().second, 0.95);
  EXPECT_TRUE(c.bf16.enabled.value());
  EXPECT_EQ(c.scheduler.params.at("total_num_steps"), "500");
  EXPECT_EQ(c.zero.reduce_bucket_size.value(), 1000000);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size.value(), 900000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold.value(), 10000);
  // The normalized document carries the substituted values, so it re-parses the same.
  nlohmann::json doc = nlohmann::json::parse(p.normalized_json);
  EXPECT_EQ(doc["train_batch_size"], 64);
  EXPECT_EQ(doc["optimizer"]["params"]["lr"], 1e-4);
}

TEST(ConfigParse, ResolveLaterWithMoreValues) {
  ParsedConfig early = MustParse(R"({"train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})");
  ASSERT_EQ(early.unresolved_auto.size(), 2u);
  ParseOptions o;
  o.world_size = 4;
  o.require_resolved = true;
  o.auto_values = {{"gradient_accumulation_steps", "3"}};
  Result<ParsedConfig> partial = ResolveDeepSpeedConfig(early, o);
  ASSERT_FALSE(partial.ok());  // lr is still "auto"
  EXPECT_NE(partial.status().message().find("optimizer.params.lr"), std::string::npos);
  o.auto_values["optimizer.params.lr"] = "2e-5";
  Result<ParsedConfig> done = ResolveDeepSpeedConfig(early, o);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->config.train_batch_size.value(), 2 * 3 * 4);
  EXPECT_DOUBLE_EQ(done->config.optimizer.lr.value(), 2e-5);
}

TEST(ConfigParse, SuppliedValuesAreTypeChecked) {
  ParseOptions o;
  o.auto_values = {{"train_micro_batch_size_per_gpu", "\"many\""}, {"optimizer.params.lr", "{"}};
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_micro_batch_size_per_gpu": "auto",
      "optimizer": {"type": "Adam", "params": {"lr": "auto"}}})",
                                       o);
  EXPECT_NE(FindDiag(c.errors, Kind::kType, "train_micro_batch_size_per_gpu"), nullptr)
      << Dump(c.errors);
  EXPECT_NE(FindDiag(c.errors, Kind::kType, "optimizer.params.lr"), nullptr) << Dump(c.errors);
}

TEST(ConfigParse, AliasesAreAccepted) {
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "bfloat16": {"enabled": true},
      "aio": {"thread_count": 4},
      "zero_optimization": {"stage": 3, "prefetch_bucket_size": 123,
        "param_persistence_threshold": 7, "model_persistence_threshold": 9,
        "max_live_parameters": 11, "max_reuse_distance": 13,
        "gather_16bit_weights_on_model_save": true}})");
  const EngineConfig& c = p.config;
  EXPECT_TRUE(c.bf16.enabled.value());
  EXPECT_EQ(c.aio.intra_op_parallelism, 4);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size.value(), 123);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold.value(), 7);
  EXPECT_EQ(c.zero.stage3_model_persistence_threshold, 9);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 11);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance, 13);
  EXPECT_TRUE(c.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(p.warnings.empty()) << Dump(p.warnings);
}

// (aio's old thread_count next to intra_op_parallelism is not an error: config_auto_test.cc.)
TEST(ConfigParse, KeyAndItsAliasTogetherIsAnError) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}})");
  EXPECT_NE(FindDiag(c.errors, Kind::kConflict, "zero_optimization.prefetch_bucket_size"), nullptr)
      << Dump(c.errors);
}

TEST(ConfigParse, DeprecatedKeysAreMappedWithANote) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 3, "cpu_offload": true, "cpu_offload_param": true,
      "cpu_offload_use_pin_memory": true, "stage3_gather_fp16_weights_on_model_save": true}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  const ZeroConfig& z = c.parsed->config.zero;
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(z.offload_optimizer.pin_memory);
  EXPECT_TRUE(z.offload_param.pin_memory);
  EXPECT_TRUE(z.stage3_gather_16bit_weights_on_model_save);
  for (const char* key : {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
                          "stage3_gather_fp16_weights_on_model_save"}) {
    const ConfigDiagnostic* d =
        FindDiag(c.warnings, Kind::kDeprecated, std::string("zero_optimization.") + key);
    ASSERT_NE(d, nullptr) << key << "\n" << Dump(c.warnings);
    EXPECT_NE(d->message.find("deprecated"), std::string::npos);
  }
}

TEST(ConfigParse, DeprecatedPinMemoryDoesNotOverrideAnExplicitOne) {
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": false},
      "cpu_offload_use_pin_memory": true}})");
  EXPECT_FALSE(p.config.zero.offload_optimizer.pin_memory);
  EXPECT_TRUE(p.config.zero.offload_param.pin_memory);
}

TEST(ConfigParse, DeprecatedKeyWithItsReplacementIsAnError) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 2, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}}})");
  EXPECT_NE(FindDiag(c.errors, Kind::kConflict, "zero_optimization.cpu_offload"), nullptr)
      << Dump(c.errors);
}

TEST(ConfigParse, BooleanZeroOptimizationIsTheOldStage1Form) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": true})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_EQ(c.parsed->config.zero.stage, 1);
  EXPECT_NE(FindDiag(c.warnings, Kind::kDeprecated, "zero_optimization"), nullptr);
}

TEST(ConfigParse, UnactedKeysAreKeptAndListed) {
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "wall_clock_breakdown": true,
      "activation_checkpointing": {"partition_activations": true},
      "zero_optimization": {"round_robin_gradients": true}})");
  ASSERT_EQ(p.config.unacted_keys.size(), 3u);
  EXPECT_EQ(p.config.unacted_keys[0].path, "zero_optimization.round_robin_gradients");
  EXPECT_EQ(p.config.unacted_keys[0].json_text, "true");
  EXPECT_EQ(p.config.unacted_keys[1].path, "wall_clock_breakdown");
  EXPECT_EQ(p.config.unacted_keys[2].path, "activation_checkpointing");
  EXPECT_EQ(p.config.unacted_keys[2].json_text, R"({"partition_activations":true})");
  EXPECT_TRUE(p.warnings.empty()) << Dump(p.warnings);  // known DeepSpeed keys: no warning
  // The Python adapter's own: its loader's drop_last and DeepSpeed's monitors (strata.monitor).
  ParsedConfig adapter = MustParse(R"({"train_batch_size": 8, "dataloader_drop_last": true,
      "tensorboard": {"enabled": true}, "csv_monitor": {"enabled": true, "job_name": "j"},
      "wandb": {"enabled": false}, "comet": {"enabled": true}})");
  ASSERT_EQ(adapter.config.unacted_keys.size(), 1u);
  EXPECT_EQ(adapter.config.unacted_keys[0].path, "comet");
  EXPECT_TRUE(adapter.warnings.empty()) << Dump(adapter.warnings);
}

// `checkpoint`: strata's retention keys are read (default: keep every checkpoint, recycle), its
// DeepSpeed keys kept unacted without a warning, a typo warned with the nearest key, and bad
// values are errors naming the JSON path.
TEST(ConfigParse, CheckpointRetentionKeys) {
  ParsedConfig d = MustParse(R"({"train_batch_size": 8})");
  EXPECT_EQ(d.config.checkpoint.keep_last, 0);
  EXPECT_TRUE(d.config.checkpoint.recycle_files);
  ParsedConfig p = MustParse(R"({"train_batch_size": 8, "checkpoint": {"keep_last": "3",
      "recycle_files": false, "tag_validation": "Warn", "keep_lats": 1}})");
  EXPECT_EQ(p.config.checkpoint.keep_last, 3);
  EXPECT_FALSE(p.config.checkpoint.recycle_files);
  ASSERT_EQ(p.config.unacted_keys.size(), 2u);
  EXPECT_EQ(p.config.unacted_keys[0].path, "checkpoint.tag_validation");
  const ConfigDiagnostic* typo = FindDiag(p.warnings, Kind::kUnknownKey, "checkpoint.keep_lats");
  ASSERT_NE(typo, nullptr) << Dump(p.warnings);
  EXPECT_NE(typo->message.find("'keep_last'"), std::string::npos) << typo->message;
  EXPECT_NE(EffectiveConfigJson(p.config).find("\"keep_last\": 3"), std::string::npos);

  ConfigCheck bad =
      CheckDeepSpeedConfig(R"({"checkpoint": {"keep_last": -1, "recycle_files": "sometimes"}})");
  EXPECT_NE(FindDiag(bad.errors, Kind::kRange, "checkpoint.keep_last"), nullptr)
      << Dump(bad.errors);
  EXPECT_NE(FindDiag(bad.errors, Kind::kType, "checkpoint.recycle_files"), nullptr)
      << Dump(bad.errors);
  Result<ParsedConfig> r = ParseDeepSpeedConfig(R"({"checkpoint": {"keep_last": 1.5}})");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("checkpoint.keep_last"), std::string::npos)
      << r.status().ToString();
}

TEST(ConfigParse, EffectiveConfigReparsesToTheSameConfig) {
  ParsedConfig p = MustParse(R"({"train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2, "fp16": {"enabled": true, "loss_scale": 128},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "amsgrad": false}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
        "nvme_path": "/nvme", "buffer_count": 6}}})");
  std::string once = EffectiveConfigJson(p.config);
  ParsedConfig q = MustParse(once);
  EXPECT_EQ(EffectiveConfigJson(q.config), once);
  EXPECT_EQ(q.config.zero.offload_param.buffer_count, 6);
}

TEST(ConfigParse, ParseAndLoadReportErrorsAsStatus) {
  Result<ParsedConfig> r = ParseDeepSpeedConfig(R"({"zero_optimization": {"stage": 7,
      "reduce_bucket_size": -1}})");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().IsInvalidArgument());
  EXPECT_NE(r.status().message().find("zero_optimization.stage"), std::string::npos);
  EXPECT_NE(r.status().message().find("zero_optimization.reduce_bucket_size"), std::string::npos);

  Result<ParsedConfig> missing = LoadDeepSpeedConfig("/nonexistent/strata/ds.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(missing.status().IsNotFound()) << missing.status().ToString();

  Result<ParsedConfig> dir = LoadDeepSpeedConfig("/");
  ASSERT_FALSE(dir.ok());
  EXPECT_TRUE(dir.status().IsInvalidArgument()) << dir.status().ToString();
  EXPECT_NE(dir.status().message().find("is a directory"), std::string::npos);
}

// zero_optimization.leaf_module (DeepSpeed's ZeRO-3 leaf modules, applied by the Python adapter):
// taken, not listed as unacted; its shape is checked, each finding at its path.
TEST(ConfigParse, LeafModuleIsTakenAndItsShapeChecked) {
  auto with = [](const std::string& leaf) {
    return CheckDeepSpeedConfig(R"({"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 3, "leaf_module": )" +
                                leaf + "}}");
  };
  ConfigCheck ok = with(R"({"classes": ["Qwen3MoeSparseMoeBlock"], "names": "model.moe",
                             "name_suffixes": []})");
  ASSERT_TRUE(ok.ok()) << Dump(ok.errors);
  EXPECT_TRUE(ok.warnings.empty()) << Dump(ok.warnings);
  for (const UnactedKey& k : ok.parsed->config.unacted_keys) {
    EXPECT_EQ(k.path.find("leaf_module"), std::string::npos) << k.path << " listed as unacted";
  }
  using K = ConfigDiagnostic::Kind;
  ConfigCheck not_object = with("[\"X\"]");
  EXPECT_NE(FindDiag(not_object.errors, K::kType, "zero_optimization.leaf_module"), nullptr)
      << Dump(not_object.errors);
  ConfigCheck typo = with(R"({"clases": ["X"]})");
  EXPECT_NE(FindDiag(typo.errors, K::kUnknownKey, "zero_optimization.leaf_module.clases"), nullptr)
      << Dump(typo.errors);
  ConfigCheck not_strings = with(R"({"classes": ["X", 1]})");
  EXPECT_NE(FindDiag(not_strings.errors, K::kType, "zero_optimization.leaf_module.classes"),
            nullptr)
      << Dump(not_strings.errors);
}

}  // namespace
}  // namespace strata
