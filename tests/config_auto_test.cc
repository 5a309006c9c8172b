// DeepSpeed's "auto" rule, section by section: keys a trainer fills stay "auto" until resolved;
// any other key of a section DeepSpeed reads into a config model (fp16, bf16, zero_optimization,
// offload_optimizer, offload_param) is dropped as DeepSpeed drops it, takes DeepSpeed's default
// and gets a note (an error under --strict); elsewhere (top level, optimizer, scheduler, aio)
// "auto" is an error, since DeepSpeed would use the string itself.
#include <set>
#include <string>
#include <string_view>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/config/config_keys.h"
#include "strata/config.h"
#include "tests/config_test_util.h"

namespace strata {
namespace {

using testing::Dump;
using testing::FindDiag;
using testing::MustParse;
using Json = nlohmann::ordered_json;
using Kind = ConfigDiagnostic::Kind;

// Keys Hugging Face or Accelerate fill in, by section: they keep "auto" until resolved.
const std::set<std::string> kTrainerFilled = {
    "fp16.enabled",
    "bf16.enabled",
    "zero_optimization.stage",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.param_persistence_threshold",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_param.device",
    "zero_optimization.offload_param.nvme_path",
};

// A ZeRO-3 config with both offloads on NVMe (so no key is "ignored" for its device), fp16 on.
Json Base() {
  return Json::parse(R"({"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {},
      "zero_optimization": {"stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}})");
}

// The object of `section` ("zero_optimization.offload_param") inside `doc`.
Json& SectionOf(Json& doc, std::string_view section) {
  Json* node = &doc;
  size_t start = 0;
  while (start <= section.size()) {
    size_t dot = section.find('.', start);
    if (dot == std::string_view::npos) dot = section.size();
    node = &(*node)[std::string(section.substr(start, dot - start))];
    start = dot + 1;
  }
  return *node;
}

bool HasNoteFor(const std::vector<std::string>& notes, const std::string& path,
                const std::string& needle = "") {
  for (const std::string& n : notes) {
    if (n.rfind(path + ": ", 0) == 0 && n.find(needle) != std::string::npos) return true;
  }
  return false;
}

std::string Notes(const std::vector<std::string>& notes) {
  std::string s;
  for (const auto& n : notes) s += "  " + n + "\n";
  return s;
}

// The DeepSpeed config-model sections strata reads, from its own key tables, so a key added to
// a table is covered here without editing this test.
constexpr std::string_view kModelSections[] = {"fp16", "bf16", "zero_optimization",
                                               "zero_optimization.offload_optimizer",
                                               "zero_optimization.offload_param"};

TEST(ConfigAuto, TheModelSectionsAreTheOnesDeepSpeedValidatesWithPydantic) {
  for (std::string_view s : kModelSections) {
    const config::SectionKeys* keys = config::KeysOf(s);
    ASSERT_NE(keys, nullptr) << s;
    EXPECT_TRUE(keys->deepspeed_model) << s;
  }
  for (std::string_view s : {"", "optimizer", "scheduler", "aio"}) {
    ASSERT_NE(config::KeysOf(s), nullptr) << s;
    EXPECT_FALSE(config::KeysOf(s)->deepspeed_model) << s;
  }
}

// Every key of every config-model section that no trainer fills: "auto" parses to exactly the
// config the key's absence gives (DeepSpeed's default), with a note naming the key and value.
TEST(ConfigAuto, EveryKeyNoTrainerFillsTakesDeepSpeedsDefaultWithANote) {
  int checked = 0;
  for (std::string_view section : kModelSections) {
    const config::SectionKeys* keys = config::KeysOf(section);
    std::vector<std::string_view> all(keys->acted.begin(), keys->acted.end());
    all.insert(all.end(), keys->known.begin(), keys->known.end());
    for (std::string_view key : all) {
      const std::string path = std::string(section) + "." + std::string(key);
      if (kTrainerFilled.count(path) != 0) continue;
      if (config::KeysOf(path) != nullptr) continue;  // a sub-section: see the next test
      Json without = Base();
      SectionOf(without, section).erase(std::string(key));
      Json with = without;
      SectionOf(with, section)[std::string(key)] = "auto";
      ConfigCheck c = CheckDeepSpeedConfig(with.dump());
      ASSERT_TRUE(c.ok()) << path << "\n" << Dump(c.errors);
      EXPECT_TRUE(c.warnings.empty()) << path << "\n" << Dump(c.warnings);
      EXPECT_TRUE(c.parsed->unresolved_auto.empty()) << path;
      ParsedConfig reference = MustParse(without.dump());
      const Json effective = Json::parse(EffectiveConfigJson(c.parsed->config));
      EXPECT_EQ(effective, Json::parse(EffectiveConfigJson(reference.config))) << path;
      EXPECT_TRUE(c.parsed->config.unacted_keys.empty()) << path;  // dropped, not kept
      ASSERT_TRUE(HasNoteFor(c.notes, path, "dropped as DeepSpeed drops it")) << path << "\n"
                                                                              << Notes(c.notes);
      EXPECT_EQ(c.parsed->notes, c.notes);
      ++checked;
    }
  }
  EXPECT_GE(checked, 60);  // every section contributed (guards against an empty table walk)
}

TEST(ConfigAuto, NotesNameTheValueUsed) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8,
      "fp16": {"enabled": true, "loss_scale_window": "auto", "hysteresis": "auto"},
      "zero_optimization": {"stage": 3, "sub_group_size": "auto",
        "max_live_parameters": "auto", "stage3_max_reuse_distance": "auto",
        "overlap_comm": "auto",
        "offload_param": {"device": "cpu", "buffer_size": 5e7, "max_in_cpu": "auto"},
        "offload_optimizer": {"device": "cpu", "ratio": "auto", "pin_memory": "auto"}}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  const auto& n = c.notes;
  EXPECT_TRUE(HasNoteFor(n, "fp16.loss_scale_window", "default 1000 applies")) << Notes(n);
  EXPECT_TRUE(HasNoteFor(n, "fp16.hysteresis", "default 2 applies")) << Notes(n);
  EXPECT_TRUE(HasNoteFor(n, "zero_optimization.sub_group_size", "default 1000000000")) << Notes(n);
  // Written with the short alias: the note names the key as written.
  EXPECT_TRUE(HasNoteFor(n, "zero_optimization.max_live_parameters", "default 1000000000"))
      << Notes(n);
  EXPECT_TRUE(HasNoteFor(n, "zero_optimization.stage3_max_reuse_distance", "1000000000"))
      << Notes(n);
  // overlap_comm's default depends on the stage (true at stage 3), as in DeepSpeed.
  EXPECT_TRUE(HasNoteFor(n, "zero_optimization.overlap_comm", "default true")) << Notes(n);
  EXPECT_TRUE(HasNoteFor(n, "zero_optimization.offload_param.max_in_cpu", "1000000000"))
      << Notes(n);
  EXPECT_TRUE(HasNoteFor(n, "zero_optimization.offload_optimizer.ratio", "default 1.0"))
      << Notes(n);
  EXPECT_TRUE(HasNoteFor(n, "zero_optimization.offload_optimizer.pin_memory", "default false"))
      << Notes(n);
  const ZeroConfig& z = c.parsed->config.zero;
  EXPECT_EQ(z.sub_group_size, 1000000000);
  EXPECT_EQ(z.stage3_max_live_parameters, 1000000000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1000000000);
  EXPECT_TRUE(z.overlap_comm);
  EXPECT_EQ(z.offload_param.buffer_size, 50000000);  // given values are unaffected
  EXPECT_EQ(z.offload_param.max_in_cpu, 1000000000);
  EXPECT_DOUBLE_EQ(z.offload_optimizer.ratio, 1.0);
  EXPECT_EQ(c.parsed->config.fp16.loss_scale_window, 1000);
}

TEST(ConfigAuto, AWholeOffloadSectionOrADeprecatedKeyWrittenAutoIsAbsent) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 3, "offload_param": "auto", "offload_optimizer": "auto", "cpu_offload": "auto",
      "cpu_offload_param": "auto", "cpu_offload_use_pin_memory": "auto"}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_TRUE(c.warnings.empty()) << Dump(c.warnings);
  const ZeroConfig& z = c.parsed->config.zero;
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_FALSE(z.offload_param.pin_memory);
  for (const char* key : {"offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_param",
                          "cpu_offload_use_pin_memory"}) {
    EXPECT_TRUE(HasNoteFor(c.notes, std::string("zero_optimization.") + key, "as if absent"))
        << key << "\n"
        << Notes(c.notes);
  }
}

// The dotted paths of every "auto" value in `j`.
void AutoPaths(const Json& j, const std::string& prefix, std::set<std::string>* out) {
  for (const auto& [key, value] : j.items()) {
    const std::string path = prefix.empty() ? key : prefix + "." + key;
    if (value.is_object()) AutoPaths(value, path, out);
    if (value == "auto") out->insert(path);
  }
}

// The keys Hugging Face and Accelerate fill keep today's behaviour: "auto" until supplied.
TEST(ConfigAuto, KeysATrainerFillsStayAutoWithoutANote) {
  const std::string text = R"({"train_batch_size": "auto",
      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
        "weight_decay": "auto", "amsgrad": "auto"}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto",
        "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
      "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": "auto",
        "offload_optimizer": {"device": "auto", "nvme_path": "auto"},
        "offload_param": {"device": "auto", "nvme_path": "auto"}}})";
  ConfigCheck c = CheckDeepSpeedConfig(text);
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_TRUE(c.notes.empty()) << Notes(c.notes);
  std::set<std::string> written;
  AutoPaths(Json::parse(text), "", &written);
  EXPECT_EQ(written.size(), 24u);
  EXPECT_EQ(
      std::set<std::string>(c.parsed->unresolved_auto.begin(), c.parsed->unresolved_auto.end()),
      written);
}

// No trainer (a script's own deepspeed.initialize, as OpenRLHF's): the keys a trainer would fill
// in the config-model sections are dropped as DeepSpeed drops them, each one exactly as if
// absent, listed in dropped_auto and noted; the others stay unresolved.
TEST(ConfigAuto, WithoutATrainerTheFilledKeysOfTheModelSectionsTakeTheirDefaults) {
  ParseOptions no_trainer;
  no_trainer.trainer_fills_auto = false;
  int checked = 0;
  for (const std::string& path : kTrainerFilled) {
    const size_t dot = path.rfind('.');
    const std::string section = path.substr(0, dot), key = path.substr(dot + 1);
    Json without = Base();
    SectionOf(without, section).erase(key);
    Json with = without;
    SectionOf(with, section)[key] = "auto";
    ConfigCheck c = CheckDeepSpeedConfig(with.dump(), no_trainer);
    ++checked;
    if (key == "nvme_path") {  // as absent: device "nvme" without its path is refused
      ASSERT_FALSE(c.ok()) << path;
      EXPECT_NE(Dump(c.errors).find("needs nvme_path"), std::string::npos) << Dump(c.errors);
      continue;
    }
    ASSERT_TRUE(c.ok()) << path << "\n" << Dump(c.errors);
    EXPECT_TRUE(c.parsed->unresolved_auto.empty()) << path;
    EXPECT_EQ(c.parsed->dropped_auto, std::vector<std::string>{path});
    ParsedConfig reference = MustParse(without.dump());
    EXPECT_EQ(Json::parse(EffectiveConfigJson(c.parsed->config)),
              Json::parse(EffectiveConfigJson(reference.config)))
        << path;
    EXPECT_TRUE(HasNoteFor(c.notes, path, "dropped as DeepSpeed drops it")) << Notes(c.notes);
    // With a trainer the same key waits for it.
    ConfigCheck trainer = CheckDeepSpeedConfig(with.dump());
    ASSERT_TRUE(trainer.ok()) << path;
    EXPECT_EQ(trainer.parsed->unresolved_auto, std::vector<std::string>{path});
    EXPECT_TRUE(trainer.parsed->dropped_auto.empty()) << path;
  }
  EXPECT_EQ(checked, static_cast<int>(kTrainerFilled.size()));
  ConfigCheck top = CheckDeepSpeedConfig(
      R"({"train_batch_size": "auto", "gradient_clipping": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})",
      no_trainer);
  ASSERT_TRUE(top.ok()) << Dump(top.errors);
  EXPECT_EQ(
      top.parsed->unresolved_auto,
      (std::vector<std::string>{"train_batch_size", "gradient_clipping", "optimizer.params.lr"}));
  EXPECT_TRUE(top.parsed->dropped_auto.empty());
}

// Outside DeepSpeed's config models "auto" reaches code that expects a value: an error.
TEST(ConfigAuto, OutsideTheModelsAutoOnAKeyNoTrainerFillsIsAnError) {
  const std::string needle = "\"auto\" is not accepted here";
  for (const char* key : {"block_size", "queue_depth", "intra_op_parallelism", "thread_count",
                          "single_submit", "overlap_events", "use_gds"}) {
    Json doc = Json::parse(R"({"train_batch_size": 8, "aio": {}})");
    doc["aio"][key] = "auto";
    ConfigCheck c = CheckDeepSpeedConfig(doc.dump());
    const ConfigDiagnostic* d = FindDiag(c.errors, Kind::kType, std::string("aio.") + key);
    ASSERT_NE(d, nullptr) << key << "\n" << Dump(c.errors);
    EXPECT_NE(d->message.find(needle), std::string::npos) << d->message;
  }
  struct Case {
    const char* text;
    const char* path;
  } cases[] = {
      {R"({"train_batch_size": 8, "steps_per_print": "auto"})", "steps_per_print"},
      {R"({"train_batch_size": 8, "optimizer": {"type": "auto"}})", "optimizer.type"},
      {R"({"train_batch_size": 8, "optimizer": {"type": "Adam",
          "params": {"adam_w_mode": "auto"}}})",
       "optimizer.params.adam_w_mode"},
      {R"({"train_batch_size": 8, "optimizer": {"type": "Adam",
          "params": {"bias_correction": "auto"}}})",
       "optimizer.params.bias_correction"},
      {R"({"train_batch_size": 8, "scheduler": {"type": "auto"}})", "scheduler.type"},
  };
  for (const Case& k : cases) {
    ConfigCheck c = CheckDeepSpeedConfig(k.text);
    const ConfigDiagnostic* d = FindDiag(c.errors, Kind::kType, k.path);
    ASSERT_NE(d, nullptr) << k.path << "\n" << Dump(c.errors);
    EXPECT_NE(d->message.find(needle), std::string::npos) << d->message;
  }
  // A whole top-level section "auto" is not an object (DeepSpeed fails on it too).
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": "auto"})");
  EXPECT_NE(FindDiag(c.errors, Kind::kType, "zero_optimization"), nullptr) << Dump(c.errors);
}

TEST(ConfigAuto, StrictReportsTheDroppedAutoAsAnError) {
  ParseOptions o;
  o.strict = true;
  ConfigCheck c = CheckDeepSpeedConfig(
      R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
          "stage3_max_live_parameters": "auto", "reduce_bucket_size": "auto"}})",
      o);
  ASSERT_FALSE(c.ok());
  ASSERT_EQ(c.errors.size(), 1u) << Dump(c.errors);  // the trainer's key is still fine
  const ConfigDiagnostic* d =
      FindDiag(c.errors, Kind::kType, "zero_optimization.stage3_max_live_parameters");
  ASSERT_NE(d, nullptr) << Dump(c.errors);
  EXPECT_NE(d->message.find("--strict"), std::string::npos) << d->message;
  EXPECT_NE(d->message.find("1000000000"), std::string::npos) << d->message;
  EXPECT_EQ(d->line, 2);  // located like any other diagnostic
  EXPECT_TRUE(c.notes.empty());
}

// What DeepSpeed rejects stays an error (a negative value) or a warning naming DeepSpeed's
// rejection (an unknown key in a section that forbids extras; --strict makes it an error).
TEST(ConfigAuto, WhatDeepSpeedRejectsIsStillReported) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 3, "stage3_max_reuse_distance": -1, "sub_group_size": "auto"}})");
  EXPECT_NE(FindDiag(c.errors, Kind::kRange, "zero_optimization.stage3_max_reuse_distance"),
            nullptr)
      << Dump(c.errors);
  c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 3, "stage3_max_live_params": 5}})");
  const ConfigDiagnostic* w =
      FindDiag(c.warnings, Kind::kUnknownKey, "zero_optimization.stage3_max_live_params");
  ASSERT_NE(w, nullptr) << Dump(c.warnings);
  EXPECT_NE(w->message.find("DeepSpeed itself rejects"), std::string::npos) << w->message;
  // An unknown key whose value is "auto" is dropped by DeepSpeed before it checks for extras:
  // still worth a warning (a typo), but not "DeepSpeed rejects".
  c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "zero_optimization": {
      "stage": 3, "stage3_max_live_params": "auto"}})");
  w = FindDiag(c.warnings, Kind::kUnknownKey, "zero_optimization.stage3_max_live_params");
  ASSERT_NE(w, nullptr) << Dump(c.warnings);
  EXPECT_NE(w->message.find("did you mean 'stage3_max_live_parameters'"), std::string::npos)
      << w->message;
  EXPECT_NE(w->message.find("DeepSpeed drops it unread"), std::string::npos) << w->message;
}

TEST(ConfigAuto, ASuppliedValueReplacesAnyAuto) {
  ParseOptions o;
  o.auto_values["zero_optimization.sub_group_size"] = "2e8";
  ConfigCheck c = CheckDeepSpeedConfig(
      R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, "sub_group_size": "auto"}})", o);
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_EQ(c.parsed->config.zero.sub_group_size, 200000000);
  EXPECT_TRUE(c.notes.empty()) << Notes(c.notes);  // neither dropped nor "not used"
}

// The shape of ZeRO-3 configs that RLHF trainers generate (every ZeRO-3 size "auto", including
// ones no trainer fills), which DeepSpeed runs: strata used to refuse them.
TEST(ConfigAuto, AZero3ConfigWithEverySizeAutoRuns) {
  ParseOptions o;
  o.hidden_size = 4096;
  ConfigCheck c = CheckDeepSpeedConfig(R"({
    "steps_per_print": 100,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": true},
    "zero_optimization": {
      "stage": 3,
      "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "sub_group_size": "auto",
      "stage3_max_live_parameters": "auto",
      "stage3_max_reuse_distance": "auto",
      "stage3_param_persistence_threshold": "auto",
      "stage3_prefetch_bucket_size": "auto",
      "reduce_bucket_size": "auto",
      "zero_hpz_partition_size": 8,
      "zero_quantized_weights": false,
      "zero_quantized_gradients": false
    }})",
                                       o);
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_TRUE(c.warnings.empty()) << Dump(c.warnings);
  EXPECT_TRUE(c.parsed->unresolved_auto.empty());  // the hidden size filled the rest
  const ZeroConfig& z = c.parsed->config.zero;
  EXPECT_EQ(z.sub_group_size, 1000000000);
  EXPECT_EQ(z.stage3_max_live_parameters, 1000000000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1000000000);
  EXPECT_EQ(z.reduce_bucket_size.value(), int64_t{4096} * 4096);
  EXPECT_EQ(c.notes.size(), 3u) << Notes(c.notes);
}

// `aio.thread_count`: the old name DeepSpeed 0.19.8 no longer reads.
TEST(ConfigAuto, TheOldAioThreadCountIsReadWithANote) {
  ConfigCheck c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "aio": {"thread_count": 4}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_TRUE(c.warnings.empty()) << Dump(c.warnings);
  EXPECT_EQ(c.parsed->config.aio.intra_op_parallelism, 4);
  EXPECT_TRUE(HasNoteFor(c.notes, "aio.thread_count", "rename it to 'intra_op_parallelism'"))
      << Notes(c.notes);
  // Both names (DeepSpeed's own AIO_FORMAT lists both): the current one counts.
  c = CheckDeepSpeedConfig(
      R"({"train_batch_size": 8, "aio": {"thread_count": 4, "intra_op_parallelism": 2}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_EQ(c.parsed->config.aio.intra_op_parallelism, 2);
  EXPECT_TRUE(HasNoteFor(c.notes, "aio.thread_count", "ignored")) << Notes(c.notes);
  // The current names alone: nothing to say.
  c = CheckDeepSpeedConfig(R"({"train_batch_size": 8, "aio": {"block_size": 262144,
      "queue_depth": 32, "intra_op_parallelism": 2, "single_submit": false,
      "overlap_events": true, "use_gds": false}})");
  ASSERT_TRUE(c.ok()) << Dump(c.errors);
  EXPECT_TRUE(c.notes.empty()) << Notes(c.notes);
  EXPECT_TRUE(c.warnings.empty()) << Dump(c.warnings);
  EXPECT_TRUE(c.parsed->config.unacted_keys.empty());
}

}  // namespace
}  // namespace strata
