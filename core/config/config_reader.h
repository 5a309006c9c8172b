// Typed reading of one JSON object of a DeepSpeed config: lenient scalars as DeepSpeed accepts
// them (numbers as strings, "auto" as DeepSpeed and the trainers treat it), every finding
// recorded with its JSON path. Internal to strata_config.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config/config_index.h"
#include "strata/config.h"

namespace strata::config {

using Json = nlohmann::ordered_json;

// A section being read: an object of the (mutable) document, or absent (obj == nullptr).
struct Section {
  Json* obj = nullptr;
  std::string path;                // "" for the root
  std::set<std::string> consumed;  // keys read so far
  // Its members' positions by key, kept by Reader::Member for a large object: ordered_json finds
  // a key by a linear scan, and a section is searched for every key strata reads. Members added
  // to `obj` later are indexed on the next lookup.
  MemberIndex index;
  bool present() const { return obj != nullptr; }
};

// Who gives a field its value when the config says "auto".
enum class AutoPolicy : uint8_t {
  // No trainer fills it: DeepSpeed's rule applies. In a DeepSpeed config-model section (see
  // SectionKeys::deepspeed_model) the key is dropped and the field keeps its default, with a
  // note (an error under ParseOptions::strict, as in DeepSpeed's strict mode); elsewhere "auto"
  // is an error, since DeepSpeed hands the string on to code that expects a value.
  kDeepSpeedRule,
  // Hugging Face or Accelerate fills it: it stays "auto" (listed as unresolved) until a value
  // is supplied through ParseOptions.
  kTrainerFills,
};

// A key whose "auto" was dropped as DeepSpeed drops it.
struct DroppedAuto {
  std::string path;            // as written, e.g. "zero_optimization.max_live_parameters"
  std::string effective_path;  // its field in EffectiveConfigJson; "" when strata has none
};

class Reader {
 public:
  Reader(const ParseOptions& options, ConfigCheck* check);

  std::string PathOf(const Section& s, std::string_view key) const;

  void Error(ConfigDiagnostic::Kind kind, std::string path, std::string message);
  void Warn(ConfigDiagnostic::Kind kind, std::string path, std::string message);

  // The value of member `key` of `s`, or nullptr (absent key, or absent section).
  Json* Member(Section& s, std::string_view key);

  // The child object `key` of `s` (absent if missing; a type error if not an object).
  Section Child(Section& s, std::string_view key);

  // Finds the first present name among `names` (a key and its aliases), marks all consumed; an
  // error when two are present. *used receives the name found.
  Json* Find(Section& s, std::initializer_list<std::string_view> names, std::string* used);

  // Typed getters: leave *out unchanged when the key is absent or invalid; true when a value
  // (or an unresolved "auto" of an AutoOr field) was read. `min` is the smallest accepted value.
  // The plain getters treat "auto" by `policy`: kTrainerFills (keys Accelerate fills) keeps *out
  // at its default and lists the path as unresolved; kDeepSpeedRule as IsUnresolvedAuto says.
  // Either way they return false for "auto", as for an absent key.
  bool Int(Section& s, std::initializer_list<std::string_view> names, int64_t* out, int64_t min = 0,
           AutoPolicy policy = AutoPolicy::kDeepSpeedRule);
  bool AutoInt(Section& s, std::initializer_list<std::string_view> names, AutoOr<int64_t>* out,
               int64_t min = 0);
  bool Double(Section& s, std::initializer_list<std::string_view> names, double* out,
              double min = 0.0);
  bool AutoDouble(Section& s, std::initializer_list<std::string_view> names, AutoOr<double>* out,
                  double min = 0.0);
  bool Bool(Section& s, std::initializer_list<std::string_view> names, bool* out,
            AutoPolicy policy = AutoPolicy::kDeepSpeedRule);
  bool AutoBool(Section& s, std::initializer_list<std::string_view> names, AutoOr<bool>* out);
  bool String(Section& s, std::initializer_list<std::string_view> names, std::string* out,
              AutoPolicy policy = AutoPolicy::kDeepSpeedRule);

  // Conversions of one value (path for messages). nullopt after recording an error.
  std::optional<int64_t> ToInt(const Json& v, const std::string& path, int64_t min);
  std::optional<double> ToDouble(const Json& v, const std::string& path, double min);
  std::optional<bool> ToBool(const Json& v, const std::string& path);

  // If *v (the value of `key` in `s`) is "auto": substitutes the caller's value for its path
  // when given (writing it into the document) and returns false. Otherwise returns true (no
  // usable value) after applying `policy`: kTrainerFills lists the path as unresolved;
  // kDeepSpeedRule drops it in a DeepSpeed config-model section (recorded with the field
  // `canonical_key` names, "" = `key`, for the note ReportDroppedAuto writes) and is an error
  // elsewhere.
  bool IsUnresolvedAuto(const Section& s, Json* v, std::string_view key, AutoPolicy policy,
                        std::string_view canonical_key = {});

  // Keys of `s` not consumed: kept as unacted (an "auto" in a DeepSpeed config-model section
  // is dropped instead, as DeepSpeed does); unknown ones also warned about with a suggestion.
  void FinishSection(Section& s);

  // The warning that counts the unknown keys past kMaxUnknownKeyWarnings, if any. Call once,
  // after the last FinishSection.
  void ReportUnlistedUnknownKeys();

  // One note per dropped "auto" naming the value the field took (from `config`, complete by
  // now), or under ParseOptions::strict one error each. Call once, after every check.
  void ReportDroppedAuto(const EngineConfig& config);

  // Information for the user, not a finding (ConfigCheck::notes).
  void Note(std::string text);

  void MarkResolved(const std::string& path);
  // Whether `path` is (still) an unresolved "auto".
  bool IsUnresolved(std::string_view path) const;
  ConfigCheck& check() { return *check_; }
  const ParseOptions& options() const { return opts_; }
  std::vector<UnactedKey>& unacted() { return unacted_; }
  std::vector<std::string>& unresolved() { return unresolved_; }
  // Paths whose "auto" was dropped as DeepSpeed drops it.
  const std::vector<std::string>& dropped_paths() const { return dropped_paths_; }
  // Paths of ParseOptions::auto_values that replaced an "auto".
  const std::set<std::string>& used_auto_values() const { return used_auto_values_; }

 private:
  const ParseOptions& opts_;
  ConfigCheck* check_;
  std::vector<UnactedKey> unacted_;
  std::vector<std::string> unresolved_;
  std::vector<std::string> dropped_paths_;
  std::set<std::string> used_auto_values_;
  std::vector<DroppedAuto> dropped_auto_;
  size_t suggestions_left_;  // kMaxSuggestedKeys, counting down
  size_t unknown_keys_ = 0;  // warned about or not
};

// The effective config (EffectiveConfigJson) as a JSON value. Defined in config_effective.cc.
Json EffectiveJson(const EngineConfig& config);

// "a JSON string", "a number", ... for messages.
std::string_view JsonTypeName(const Json& v);

}  // namespace strata::config
