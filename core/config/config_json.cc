// The strict JSON parse of a DeepSpeed config: nesting bounded, duplicate keys named, malformed
// input located, all in time linear in the text.
#include <cctype>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config_index.h"
#include "core/config/config_text.h"

namespace strata::config {

namespace {

using Json = nlohmann::ordered_json;

// The first byte of the token whose last byte is at `end` (a string, number or literal; other
// tokens are one byte).
size_t TokenStart(std::string_view s, size_t end) {
  if (end >= s.size()) return end;
  if (s[end] == '"') {
    size_t i = end;
    while (i > 0) {
      --i;
      if (s[i] != '"') continue;
      size_t backslashes = 0;
      while (i >= backslashes + 1 && s[i - backslashes - 1] == '\\') ++backslashes;
      if (backslashes % 2 == 0) return i;
    }
    return end;
  }
  auto word = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '+' || c == '-';
  };
  size_t i = end;
  while (i > 0 && word(s[end]) && word(s[i - 1])) --i;
  return i;
}

// Offset of the first '{' or '[' that opens level max_depth + 1 (outside strings), or npos.
size_t FindTooDeep(std::string_view s, size_t max_depth) {
  size_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return i;
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return std::string_view::npos;
}

// Duplicate keys named one by one; past this, only counted. Naming one costs its whole path,
// which under a long parent key is long: unbounded, a text of many duplicates would take
// quadratic time and memory to report.
constexpr size_t kMaxDuplicatesNamed = 20;

// Objects up to this many members are searched for a duplicate key directly; larger ones are
// indexed.
constexpr size_t kLinearScanMembers = 16;

// A SAX handler for Json::sax_parse that builds the document. nlohmann's own builders insert
// each member through ordered_map::operator[], a linear scan of the object's keys (quadratic
// for one large object), and its callback builder rescans the parent after every nested value.
// Here members are appended to the object's vector and duplicates found as described above.
// Pointers into a parent stay valid while a child is open: a parent grows only between members.
class DocumentBuilder {
 public:
  DocumentBuilder(Json* root, std::vector<ConfigDiagnostic>* errors)
      : root_(root), errors_(errors) {}

  bool null() { return Put(nullptr); }
  bool boolean(bool v) { return Put(v); }
  bool number_integer(Json::number_integer_t v) { return Put(v); }
  bool number_unsigned(Json::number_unsigned_t v) { return Put(v); }
  bool number_float(Json::number_float_t v, const Json::string_t& /*text*/) { return Put(v); }
  bool string(Json::string_t& v) { return Put(std::move(v)); }
  bool binary(Json::binary_t& v) { return Put(Json::binary(std::move(v))); }  // not in JSON text
  bool start_object(size_t /*size*/) { return Open(Json::object()); }
  bool start_array(size_t /*size*/) { return Open(Json::array()); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }

  bool key(Json::string_t& k) {
    Level& l = open_.back();
    Json::object_t& obj = l.node->get_ref<Json::object_t&>();
    bool duplicate = false;
    if (obj.size() < kLinearScanMembers) {
      for (const auto& member : obj) duplicate = duplicate || member.first == k;
    }
    // A duplicate is appended too: the document is not used once a diagnostic is recorded.
    obj.Json::object_t::Container::emplace_back(std::move(k), nullptr);
    member_ = &obj.back().second;
    if (obj.size() > kLinearScanMembers) {
      // Earlier duplicates (found by the scan while the object was small) are passed over.
      const size_t last = obj.size() - 1;
      l.keys.Update(obj, [&](size_t pos, size_t) { duplicate = duplicate || pos == last; });
    }
    if (duplicate) NameDuplicate();
    return true;
  }

  // Throws the parser's exception: ParseJsonStrict turns each kind into its diagnostic.
  template <class Exception>
  bool parse_error(size_t /*byte*/, const std::string& /*token*/, const Exception& e) {
    throw e;
  }

  // After the parse: one diagnostic counting the duplicates that were not named.
  void Finish() {
    if (duplicates_ <= kMaxDuplicatesNamed) return;
    errors_->push_back(
        ConfigDiagnostic{ConfigDiagnostic::Kind::kDuplicateKey, "",
                         "... and " + std::to_string(duplicates_ - kMaxDuplicatesNamed) +
                             " more duplicate keys (DeepSpeed rejects duplicate keys)",
                         0, 0});
  }

 private:
  struct Level {
    Json* node;
    MemberIndex keys;  // objects past kLinearScanMembers members
  };

  // Where the next value goes: the root, a new array element, or the member just keyed.
  Json* Slot() {
    if (open_.empty()) return root_;
    Json* parent = open_.back().node;
    if (parent->is_array()) return &parent->get_ref<Json::array_t&>().emplace_back();
    return member_;
  }

  bool Put(Json v) {
    *Slot() = std::move(v);
    return true;
  }

  bool Open(Json empty) {
    Json* slot = Slot();
    *slot = std::move(empty);
    open_.push_back(Level{slot, {}});
    return true;
  }

  bool Close() {
    open_.pop_back();
    return true;
  }

  // Records the duplicate just appended (the last member of the innermost object).
  void NameDuplicate() {
    if (++duplicates_ > kMaxDuplicatesNamed) return;
    std::vector<std::string> parts;
    for (const Level& l : open_) {
      if (l.node->is_object()) {
        parts.push_back(l.node->get_ref<const Json::object_t&>().back().first);
      } else {
        parts.push_back("[" + std::to_string(l.node->size() - 1) + "]");
      }
    }
    errors_->push_back(ConfigDiagnostic{
        ConfigDiagnostic::Kind::kDuplicateKey, JoinPath(parts),
        "duplicate key '" + parts.back() + "' (DeepSpeed rejects duplicate keys; keep one)", 0, 0});
  }

  Json* root_;
  std::vector<ConfigDiagnostic>* errors_;
  std::vector<Level> open_;
  Json* member_ = nullptr;
  size_t duplicates_ = 0;
};

}  // namespace

bool ParseJsonStrict(std::string_view stripped, nlohmann::ordered_json* out,
                     std::vector<ConfigDiagnostic>* errors) {
  // nlohmann's reader takes a NUL byte for the end of the input and would drop what follows it
  // without a word; JSON text has none (inside strings it is written \u0000).
  if (const size_t at = stripped.find('\0'); at != std::string_view::npos) {
    ConfigDiagnostic d{ConfigDiagnostic::Kind::kSyntax, "",
                       "malformed JSON: a NUL byte (JSON text has none; is this a config file?)", 0,
                       0};
    LineColumn(stripped, at, &d.line, &d.column);
    errors->push_back(std::move(d));
    return false;
  }
  // Deeper documents are refused before parsing: nlohmann's dump and our path building recurse
  // per level, so 100k levels would overflow the stack. No DeepSpeed config nests beyond ~5.
  if (const size_t at = FindTooDeep(stripped, kMaxJsonDepth); at != std::string_view::npos) {
    ConfigDiagnostic d{ConfigDiagnostic::Kind::kSyntax, "",
                       "malformed JSON: nesting deeper than " + std::to_string(kMaxJsonDepth) +
                           " levels (objects and arrays)",
                       0, 0};
    LineColumn(stripped, at, &d.line, &d.column);
    errors->push_back(std::move(d));
    return false;
  }
  const size_t before = errors->size();
  try {
    DocumentBuilder builder(out, errors);
    Json::sax_parse(stripped.begin(), stripped.end(), &builder, Json::input_format_t::json,
                    /*strict=*/true, /*ignore_comments=*/false);
    builder.Finish();
  } catch (const nlohmann::json::parse_error& e) {
    ConfigDiagnostic d{ConfigDiagnostic::Kind::kSyntax, "", "", 0, 0};
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 3, column 5: syntax error ..."
    size_t colon = what.find(": ");
    d.message = "malformed JSON: " +
                PrintableText(colon == std::string::npos ? what : what.substr(colon + 2));
    // e.byte is the 1-based offset of the offending token's last byte; point at its start.
    size_t offset = TokenStart(stripped, e.byte > 0 ? e.byte - 1 : 0);
    LineColumn(stripped, offset, &d.line, &d.column);
    errors->push_back(std::move(d));
    return false;
  } catch (const nlohmann::json::exception& e) {
    // out_of_range: a number beyond double ("number overflow parsing '1e400'"); no offset is
    // given, so locate the quoted token in the text.
    ConfigDiagnostic d{ConfigDiagnostic::Kind::kRange, "", "", 0, 0};
    std::string what = e.what();
    size_t colon = what.find("] ");
    d.message = "malformed JSON: " +
                PrintableText(colon == std::string::npos ? what : what.substr(colon + 2));
    size_t q1 = what.find('\'');
    size_t q2 = q1 == std::string::npos ? q1 : what.find('\'', q1 + 1);
    if (q2 != std::string::npos && q2 > q1 + 1) {
      size_t at = stripped.find(what.substr(q1 + 1, q2 - q1 - 1));
      if (at != std::string_view::npos) LineColumn(stripped, at, &d.line, &d.column);
    }
    errors->push_back(std::move(d));
    return false;
  }
  return errors->size() == before;
}

}  // namespace strata::config
