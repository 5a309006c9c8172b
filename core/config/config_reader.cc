#include "core/config/config_reader.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "core/config/config_keys.h"

namespace strata::config {

namespace {

// A whole-string decimal / scientific number ("5e8", " 1e-4 "); nullopt otherwise.
std::optional<double> ParseNumberString(const std::string& s) {
  const char* b = s.c_str();
  while (*b == ' ' || *b == '\t') ++b;
  if (*b == '\0') return std::nullopt;
  char* end = nullptr;
  double d = std::strtod(b, &end);
  while (*end == ' ' || *end == '\t') ++end;
  if (*end != '\0' || !std::isfinite(d)) return std::nullopt;
  // strtod also reads hex floats and "infinity"; DeepSpeed configs never mean those.
  for (const char* p = b; p < end; ++p) {
    if (*p == 'x' || *p == 'X' || *p == 'n' || *p == 'N' || *p == 'i' || *p == 'I') {
      return std::nullopt;
    }
  }
  return d;
}

std::string Compact(const Json& v) { return v.dump(); }

}  // namespace

std::string_view JsonTypeName(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::object:
      return "an object";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "an integer";
    case Json::value_t::number_float:
      return "a number";
    default:
      return "an unsupported value";
  }
}

namespace {

bool IsAuto(const Json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

bool InDeepSpeedModel(const Section& s) {
  const SectionKeys* keys = KeysOf(s.path);
  return keys != nullptr && keys->deepspeed_model;
}

}  // namespace

Reader::Reader(const ParseOptions& options, ConfigCheck* check)
    : opts_(options), check_(check), suggestions_left_(kMaxSuggestedKeys) {}

Json* Reader::Member(Section& s, std::string_view key) {
  if (!s.present()) return nullptr;
  // Small objects (every real section) are scanned: cheaper than building the index.
  constexpr size_t kScanMembers = 32;
  Json::object_t& members = s.obj->get_ref<Json::object_t&>();
  if (members.size() <= kScanMembers) {
    for (auto& [k, v] : members) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  s.index.Update(members);
  const std::optional<size_t> at = s.index.Find(members, key);
  return at ? &members.begin()[*at].second : nullptr;
}

std::string Reader::PathOf(const Section& s, std::string_view key) const {
  if (s.path.empty()) return std::string(key);
  return s.path + "." + std::string(key);
}

void Reader::Error(ConfigDiagnostic::Kind kind, std::string path, std::string message) {
  check_->errors.push_back(ConfigDiagnostic{kind, std::move(path), std::move(message), 0, 0});
}

void Reader::Warn(ConfigDiagnostic::Kind kind, std::string path, std::string message) {
  check_->warnings.push_back(ConfigDiagnostic{kind, std::move(path), std::move(message), 0, 0});
}

Json* Reader::Find(Section& s, std::initializer_list<std::string_view> names, std::string* used) {
  if (!s.present()) return nullptr;
  Json* found = nullptr;
  for (std::string_view n : names) {
    std::string key(n);
    s.consumed.insert(key);
    Json* v = Member(s, key);
    // null is DeepSpeed's "not set" (its Optional fields): the default applies.
    if (v == nullptr || v->is_null()) continue;
    if (found != nullptr) {
      Error(ConfigDiagnostic::Kind::kConflict, PathOf(s, key),
            "both '" + *used + "' and its alias '" + key + "' are given; keep one");
      continue;
    }
    found = v;
    *used = key;
  }
  return found;
}

Section Reader::Child(Section& s, std::string_view key) {
  Section c;
  c.path = PathOf(s, key);
  std::string used;
  Json* v = Find(s, {key}, &used);
  if (v == nullptr || v->is_null()) return c;
  // A whole sub-model written "auto" (offload_param: "auto") is dropped like any other key:
  // DeepSpeed's default for it is "absent".
  if (IsAuto(*v) && InDeepSpeedModel(s) &&
      IsUnresolvedAuto(s, v, key, AutoPolicy::kDeepSpeedRule)) {
    return c;
  }
  if (!v->is_object()) {
    Error(ConfigDiagnostic::Kind::kType, c.path,
          "expected an object, got " + std::string(JsonTypeName(*v)) + " " + Compact(*v));
    return c;
  }
  c.obj = v;
  return c;
}

bool Reader::IsUnresolvedAuto(const Section& s, Json* v, std::string_view key, AutoPolicy policy,
                              std::string_view canonical_key) {
  if (!IsAuto(*v)) return false;
  const std::string path = PathOf(s, key);
  auto it = opts_.auto_values.find(path);
  if (it != opts_.auto_values.end()) {
    Json supplied = Json::parse(it->second, nullptr, /*allow_exceptions=*/false);
    if (supplied.is_discarded()) {
      Error(ConfigDiagnostic::Kind::kType, path,
            "the value supplied for \"auto\" is not JSON: '" + it->second + "'");
      return true;
    }
    *v = std::move(supplied);
    used_auto_values_.insert(path);
    return false;
  }
  if (policy == AutoPolicy::kTrainerFills && (opts_.trainer_fills_auto || !InDeepSpeedModel(s))) {
    unresolved_.push_back(path);
    return true;
  }
  if (!InDeepSpeedModel(s)) {
    Error(ConfigDiagnostic::Kind::kType, path,
          "\"auto\" is not accepted here: no trainer fills this key, and DeepSpeed reads this "
          "section as a plain dict, so it would use the string \"auto\" itself; give a value");
    return true;
  }
  dropped_auto_.push_back(
      DroppedAuto{path, PathOf(s, canonical_key.empty() ? key : canonical_key)});
  dropped_paths_.push_back(path);
  return true;
}

bool Reader::IsUnresolved(std::string_view path) const {
  return std::find(unresolved_.begin(), unresolved_.end(), path) != unresolved_.end();
}

void Reader::MarkResolved(const std::string& path) {
  unresolved_.erase(std::remove(unresolved_.begin(), unresolved_.end(), path), unresolved_.end());
}

std::optional<int64_t> Reader::ToInt(const Json& v, const std::string& path, int64_t min) {
  std::optional<double> d;
  std::optional<int64_t> i;
  if (v.is_number_integer() && !v.is_number_unsigned()) {
    i = v.get<int64_t>();
  } else if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(INT64_MAX)) i = static_cast<int64_t>(u);
  } else if (v.is_number_float()) {
    d = v.get<double>();
  } else if (v.is_string()) {
    d = ParseNumberString(v.get<std::string>());
  }
  if (!i && d) {
    // 9.2e18 is the largest double below 2^63 that matters here; beyond it is out of range.
    if (*d == std::floor(*d) && std::fabs(*d) < 9.2e18) i = static_cast<int64_t>(*d);
  }
  if (!i) {
    Error(ConfigDiagnostic::Kind::kType, path,
          "expected an integer (a number such as 5e8, or a string \"5e8\"), got " +
              std::string(JsonTypeName(v)) + " " + Compact(v));
    return std::nullopt;
  }
  if (*i < min) {
    Error(ConfigDiagnostic::Kind::kRange, path,
          "expected an integer >= " + std::to_string(min) + ", got " + std::to_string(*i));
    return std::nullopt;
  }
  return i;
}

std::optional<double> Reader::ToDouble(const Json& v, const std::string& path, double min) {
  std::optional<double> d;
  if (v.is_number()) {
    d = v.get<double>();
    if (!std::isfinite(*d)) d.reset();  // 1e400 overflows to infinity
  } else if (v.is_string()) {
    d = ParseNumberString(v.get<std::string>());
  }
  if (!d) {
    Error(ConfigDiagnostic::Kind::kType, path,
          "expected a number, got " + std::string(JsonTypeName(v)) + " " + Compact(v));
    return std::nullopt;
  }
  if (*d < min) {
    Error(ConfigDiagnostic::Kind::kRange, path,
          "expected a number >= " + Json(min).dump() + ", got " + Json(*d).dump());
    return std::nullopt;
  }
  return d;
}

std::optional<bool> Reader::ToBool(const Json& v, const std::string& path) {
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_integer() && (v.get<int64_t>() == 0 || v.get<int64_t>() == 1)) {
    return v.get<int64_t>() == 1;
  }
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    if (s == "true") return true;
    if (s == "false") return false;
  }
  Error(ConfigDiagnostic::Kind::kType, path,
        "expected true or false, got " + std::string(JsonTypeName(v)) + " " + Compact(v));
  return std::nullopt;
}

bool Reader::Int(Section& s, std::initializer_list<std::string_view> names, int64_t* out,
                 int64_t min, AutoPolicy policy) {
  std::string used;
  Json* v = Find(s, names, &used);
  if (v == nullptr) return false;
  std::string path = PathOf(s, used);
  if (IsUnresolvedAuto(s, v, used, policy, *names.begin())) return false;
  auto r = ToInt(*v, path, min);
  if (r) *out = *r;
  return r.has_value();
}

bool Reader::AutoInt(Section& s, std::initializer_list<std::string_view> names,
                     AutoOr<int64_t>* out, int64_t min) {
  std::string used;
  Json* v = Find(s, names, &used);
  if (v == nullptr) return false;
  std::string path = PathOf(s, used);
  if (IsUnresolvedAuto(s, v, used, AutoPolicy::kTrainerFills)) {
    if (!IsUnresolved(path)) return false;  // dropped as DeepSpeed drops it: the default
    *out = AutoOr<int64_t>::Auto();
    return true;
  }
  auto r = ToInt(*v, path, min);
  if (r) *out = *r;
  return r.has_value();
}

bool Reader::Double(Section& s, std::initializer_list<std::string_view> names, double* out,
                    double min) {
  std::string used;
  Json* v = Find(s, names, &used);
  if (v == nullptr) return false;
  std::string path = PathOf(s, used);
  if (IsUnresolvedAuto(s, v, used, AutoPolicy::kDeepSpeedRule, *names.begin())) return false;
  auto r = ToDouble(*v, path, min);
  if (r) *out = *r;
  return r.has_value();
}

bool Reader::AutoDouble(Section& s, std::initializer_list<std::string_view> names,
                        AutoOr<double>* out, double min) {
  std::string used;
  Json* v = Find(s, names, &used);
  if (v == nullptr) return false;
  std::string path = PathOf(s, used);
  if (IsUnresolvedAuto(s, v, used, AutoPolicy::kTrainerFills)) {
    if (!IsUnresolved(path)) return false;  // dropped as DeepSpeed drops it: the default
    *out = AutoOr<double>::Auto();
    return true;
  }
  auto r = ToDouble(*v, path, min);
  if (r) *out = *r;
  return r.has_value();
}

bool Reader::Bool(Section& s, std::initializer_list<std::string_view> names, bool* out,
                  AutoPolicy policy) {
  std::string used;
  Json* v = Find(s, names, &used);
  if (v == nullptr) return false;
  std::string path = PathOf(s, used);
  if (IsUnresolvedAuto(s, v, used, policy, *names.begin())) return false;
  auto r = ToBool(*v, path);
  if (r) *out = *r;
  return r.has_value();
}

bool Reader::AutoBool(Section& s, std::initializer_list<std::string_view> names,
                      AutoOr<bool>* out) {
  std::string used;
  Json* v = Find(s, names, &used);
  if (v == nullptr) return false;
  std::string path = PathOf(s, used);
  if (IsUnresolvedAuto(s, v, used, AutoPolicy::kTrainerFills)) {
    if (!IsUnresolved(path)) return false;  // dropped as DeepSpeed drops it: the default
    *out = AutoOr<bool>::Auto();
    return true;
  }
  auto r = ToBool(*v, path);
  if (r) *out = *r;
  return r.has_value();
}

bool Reader::String(Section& s, std::initializer_list<std::string_view> names, std::string* out,
                    AutoPolicy policy) {
  std::string used;
  Json* v = Find(s, names, &used);
  if (v == nullptr || v->is_null()) return false;
  if (IsUnresolvedAuto(s, v, used, policy, *names.begin())) return false;
  if (!v->is_string()) {
    Error(ConfigDiagnostic::Kind::kType, PathOf(s, used),
          "expected a string, got " + std::string(JsonTypeName(*v)) + " " + Compact(*v));
    return false;
  }
  *out = v->get<std::string>();
  return true;
}

void Reader::FinishSection(Section& s) {
  if (!s.present()) return;
  const SectionKeys* keys = KeysOf(s.path);
  for (auto it = s.obj->begin(); it != s.obj->end(); ++it) {
    const std::string& key = it.key();
    if (s.consumed.count(key) != 0) continue;
    std::string path = PathOf(s, key);
    bool known = keys != nullptr &&
                 std::find(keys->known.begin(), keys->known.end(), key) != keys->known.end();
    bool dropped = keys != nullptr && keys->deepspeed_model && IsAuto(it.value());
    if (dropped && known) {  // a DeepSpeed key strata does not read: nothing to keep
      dropped_auto_.push_back(DroppedAuto{path, ""});
      continue;
    }
    unacted_.push_back(UnactedKey{path, Compact(it.value())});
    if (keys == nullptr || known) continue;
    if (++unknown_keys_ > kMaxUnknownKeyWarnings) continue;
    std::string msg = "unknown key '" + key + "'";
    std::string near;
    if (suggestions_left_ > 0) {
      --suggestions_left_;
      near = Suggest(*keys, key);
    }
    const SectionKeys* top = KeysOf("");
    bool top_level_key = !s.path.empty() && KeysOf(key) != nullptr &&
                         std::find(top->acted.begin(), top->acted.end(), key) != top->acted.end();
    if (top_level_key) {
      msg += "; '" + key + "' is a top-level section (DeepSpeed reads it only there), so here it";
    } else {
      if (!near.empty()) msg += "; did you mean '" + near + "'?";
      msg += near.empty() ? "; it" : " It";
    }
    msg += " is kept but has no effect";
    if (dropped) {
      msg += " (DeepSpeed drops it unread: its value is \"auto\")";
    } else if (keys->deepspeed_model) {
      msg += " (DeepSpeed itself rejects unknown keys here)";
    }
    Warn(ConfigDiagnostic::Kind::kUnknownKey, path, msg);
  }
}

void Reader::ReportUnlistedUnknownKeys() {
  if (unknown_keys_ <= kMaxUnknownKeyWarnings) return;
  Warn(ConfigDiagnostic::Kind::kUnknownKey, "",
       std::to_string(unknown_keys_ - kMaxUnknownKeyWarnings) +
           " more unknown keys, not warned about one by one (" + std::to_string(unknown_keys_) +
           " in all); they are kept but have no effect");
}

void Reader::Note(std::string text) { check_->notes.push_back(std::move(text)); }

namespace {

// The value at dotted `path` in `j`, or nullptr.
const Json* At(const Json& j, const std::string& path) {
  const Json* node = &j;
  size_t start = 0;
  while (node != nullptr) {
    size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? dot : dot - start);
    auto it = node->is_object() ? node->find(part) : node->end();
    node = it != node->end() ? &*it : nullptr;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return node;
}

}  // namespace

void Reader::ReportDroppedAuto(const EngineConfig& config) {
  if (dropped_auto_.empty()) return;
  const Json effective = EffectiveJson(config);
  for (const DroppedAuto& d : dropped_auto_) {
    const Json* value = d.effective_path.empty() ? nullptr : At(effective, d.effective_path);
    std::string used;
    if (value == nullptr) {
      used = d.effective_path.empty() ? "DeepSpeed's default applies (strata does not act on it)"
                                      : "as if absent";
    } else if (value->is_object()) {
      used = "as if absent";
    } else {
      used = "DeepSpeed's default " + value->dump() + " applies";
    }
    if (opts_.strict) {
      Error(ConfigDiagnostic::Kind::kType, d.path,
            "\"auto\" is not accepted under --strict (DeepSpeed's strict mode keeps it, and its "
            "validation rejects it); outside strict mode DeepSpeed drops the key: " +
                used + ". Give a value");
    } else {
      Note(d.path +
           ": \"auto\", which no trainer fills, is dropped as DeepSpeed drops it: " + used);
    }
  }
  dropped_auto_.clear();
}

}  // namespace strata::config
