// Key tables of the DeepSpeed config sections strata reads, and "did you mean" suggestions.
// Internal to strata_config.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace strata::config {

// Keys of one section (by dotted path: "", "zero_optimization", "zero_optimization.offload_param",
// "fp16", ...): `acted` are read by strata, `known` are DeepSpeed keys strata keeps unread.
struct SectionKeys {
  std::span<const std::string_view> acted;
  std::span<const std::string_view> known;
  // DeepSpeed reads this section into a DeepSpeedConfigModel (runtime/config_utils.py), a
  // pydantic model: it rejects unknown keys (extra="forbid") and, outside its strict mode, drops
  // every key whose value is "auto" before validation, so that field takes its default. The
  // other sections are plain dicts: "auto" reaches the code that uses the value.
  bool deepspeed_model;
};
// nullptr for a section without a table (its keys are free-form, e.g. scheduler.params).
const SectionKeys* KeysOf(std::string_view section_path);

// Levenshtein distance.
size_t EditDistance(std::string_view a, std::string_view b);

// The nearest key of the section (acted or known) to `key` when it is close enough to be a
// plausible typo (distance <= max(2, |key|/3), or one contains the other); "" otherwise.
std::string Suggest(const SectionKeys& keys, std::string_view key);

}  // namespace strata::config
