// Key tables of the DeepSpeed config sections strata reads, and "did you mean" suggestions.
// Internal to strata_config.
#pragma once

#include <cstdint>
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

// Levenshtein distance, or any value above `at_most` once it is known to exceed it (the rows
// of the table stop there).
size_t EditDistance(std::string_view a, std::string_view b, size_t at_most = SIZE_MAX);

// Keys longer than this get no suggestion: no DeepSpeed key is half as long, and the edit distance
// costs |key| x |candidate| per candidate (quadratic in a long key).
inline constexpr size_t kMaxSuggestKeyBytes = 64;

// The nearest key of the section (acted or known) to `key` when it is close enough to be a
// plausible typo (distance <= max(2, |key|/3), or one contains the other); "" otherwise, and
// for a key longer than kMaxSuggestKeyBytes.
std::string Suggest(const SectionKeys& keys, std::string_view key);

// Unknown keys of one config that get a suggestion; later ones get none. A config with more is
// not a typo, and a million unknown keys would otherwise cost a million searches.
inline constexpr size_t kMaxSuggestedKeys = 100;

// Unknown keys of one config warned about one by one; the rest are counted in one more warning
// (all are still kept as unacted keys). A 16 MiB config of unknown keys made a million warnings,
// 30 times its size in memory, that nobody would read.
inline constexpr size_t kMaxUnknownKeyWarnings = 1000;

}  // namespace strata::config
