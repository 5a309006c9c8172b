// Typed reading of one JSON object of a DeepSpeed config: lenient scalars as DeepSpeed accepts
// them (numbers as strings, "auto" where a trainer fills it), every finding recorded with its
// JSON path. Internal to strata_core.
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

#include "strata/config.h"

namespace strata::config {

using Json = nlohmann::ordered_json;

// A section being read: an object of the (mutable) document, or absent (obj == nullptr).
struct Section {
  Json* obj = nullptr;
  std::string path;                // "" for the root
  std::set<std::string> consumed;  // keys read so far
  bool present() const { return obj != nullptr; }
};

// Whether a field may be written "auto".
enum class AutoPolicy : uint8_t { kNo, kYes };

class Reader {
 public:
  Reader(const ParseOptions& options, ConfigCheck* check) : opts_(options), check_(check) {}

  std::string PathOf(const Section& s, std::string_view key) const;

  void Error(ConfigDiagnostic::Kind kind, std::string path, std::string message);
  void Warn(ConfigDiagnostic::Kind kind, std::string path, std::string message);

  // The child object `key` of `s` (absent if missing; a type error if not an object).
  Section Child(Section& s, std::string_view key);

  // Finds the first present name among `names` (a key and its aliases), marks all consumed; an
  // error when two are present. *used receives the name found.
  Json* Find(Section& s, std::initializer_list<std::string_view> names, std::string* used);

  // Typed getters: leave *out unchanged when the key is absent or invalid; true when a value
  // (or "auto") was read. `min` is the smallest accepted value. The plain getters accept "auto"
  // only under AutoPolicy::kYes (keys Accelerate fills): *out then keeps its default and the
  // path is listed as unresolved.
  bool Int(Section& s, std::initializer_list<std::string_view> names, int64_t* out, int64_t min = 0,
           AutoPolicy policy = AutoPolicy::kNo);
  bool AutoInt(Section& s, std::initializer_list<std::string_view> names, AutoOr<int64_t>* out,
               int64_t min = 0);
  bool Double(Section& s, std::initializer_list<std::string_view> names, double* out,
              double min = 0.0);
  bool AutoDouble(Section& s, std::initializer_list<std::string_view> names, AutoOr<double>* out,
                  double min = 0.0);
  bool Bool(Section& s, std::initializer_list<std::string_view> names, bool* out,
            AutoPolicy policy = AutoPolicy::kNo);
  bool AutoBool(Section& s, std::initializer_list<std::string_view> names, AutoOr<bool>* out);
  bool String(Section& s, std::initializer_list<std::string_view> names, std::string* out,
              AutoPolicy policy = AutoPolicy::kNo);

  // Conversions of one value (path for messages). nullopt after recording an error.
  std::optional<int64_t> ToInt(const Json& v, const std::string& path, int64_t min);
  std::optional<double> ToDouble(const Json& v, const std::string& path, double min);
  std::optional<bool> ToBool(const Json& v, const std::string& path);

  // If *v is "auto": substitutes the caller's value for `path` when given (writing it into the
  // document) and returns false; otherwise records the path as unresolved (or errors when the
  // field does not take "auto") and returns true.
  bool IsUnresolvedAuto(Json* v, const std::string& path, AutoPolicy policy);

  // Keys of `s` not consumed: kept as unacted; unknown ones also warned about with a suggestion.
  void FinishSection(Section& s);

  void MarkResolved(const std::string& path);
  // Whether `path` is (still) an unresolved "auto".
  bool IsUnresolved(std::string_view path) const;
  ConfigCheck& check() { return *check_; }
  const ParseOptions& options() const { return opts_; }
  std::vector<UnactedKey>& unacted() { return unacted_; }
  std::vector<std::string>& unresolved() { return unresolved_; }
  // Paths of ParseOptions::auto_values that replaced an "auto".
  const std::set<std::string>& used_auto_values() const { return used_auto_values_; }

 private:
  const ParseOptions& opts_;
  ConfigCheck* check_;
  std::vector<UnactedKey> unacted_;
  std::vector<std::string> unresolved_;
  std::set<std::string> used_auto_values_;
};

// "a JSON string", "a number", ... for messages.
std::string_view JsonTypeName(const Json& v);

}  // namespace strata::config
