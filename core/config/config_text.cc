#include "core/config/config_text.h"

#include <cctype>
#include <set>

namespace strata::config {

namespace {

// Blanks text[begin, end) except newlines, so line/column of later bytes do not move.
void Blank(std::string& s, size_t begin, size_t end) {
  for (size_t i = begin; i < end && i < s.size(); ++i) {
    if (s[i] != '\n' && s[i] != '\r') s[i] = ' ';
  }
}

}  // namespace

void LineColumn(std::string_view text, size_t offset, int* line, int* column) {
  int l = 1;
  int c = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++l;
      c = 1;
    } else {
      ++c;
    }
  }
  *line = l;
  *column = c;
}

std::string StripComments(std::string_view text, ConfigDiagnostic* error) {
  std::string s(text);
  // Offset of the last ',' outside strings and comments; kNoComma once something else followed,
  // kDoubleComma after ",," (then nothing is stripped, so the JSON parser reports it).
  constexpr size_t kNoComma = std::string::npos;
  constexpr size_t kDoubleComma = std::string::npos - 1;
  size_t pending_comma = kNoComma;
  size_t i = 0;
  while (i < s.size()) {
    char c = s[i];
    if (c == '"') {
      pending_comma = kNoComma;
      ++i;
      while (i < s.size() && s[i] != '"') {
        if (s[i] == '\\') ++i;  // skip the escaped character (the JSON parser validates it)
        ++i;
      }
      ++i;  // closing quote (or past the end: the JSON parser reports the open string)
      continue;
    }
    if (c == '#' || (c == '/' && i + 1 < s.size() && s[i + 1] == '/')) {
      size_t end = s.find('\n', i);
      if (end == std::string::npos) end = s.size();
      Blank(s, i, end);
      i = end;
      continue;
    }
    if (c == '/' && i + 1 < s.size() && s[i + 1] == '*') {
      size_t end = s.find("*/", i + 2);
      if (end == std::string::npos) {
        if (error != nullptr && error->message.empty()) {
          error->kind = ConfigDiagnostic::Kind::kSyntax;
          error->message = "unterminated /* comment";
          LineColumn(text, i, &error->line, &error->column);
        }
        Blank(s, i, s.size());
        break;
      }
      Blank(s, i, end + 2);
      i = end + 2;
      continue;
    }
    if (c == ',') {
      pending_comma = pending_comma == kNoComma ? i : kDoubleComma;
    } else if (c == '}' || c == ']') {
      // hjson (and so DeepSpeed) accepts a trailing comma; strict JSON does not.
      if (pending_comma < s.size()) s[pending_comma] = ' ';
      pending_comma = kNoComma;
    } else if (c != ' ' && c != '\t' && c != '\n' && c != '\r') {
      pending_comma = kNoComma;
    }
    ++i;
  }
  return s;
}

std::string JoinPath(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& p : parts) {
    if (!p.empty() && p[0] == '[') {
      out += p;
    } else {
      if (!out.empty()) out += '.';
      out += p;
    }
  }
  return out;
}

namespace {

// Tracks the path of the parser's position to name duplicate keys.
struct Frame {
  bool is_object;
  std::set<std::string> keys;
  std::string key;
  size_t index = 0;
};

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

// `s` with control characters and bytes that are not valid UTF-8 written as \xNN, so messages
// quoting malformed input stay printable and valid JSON strings.
std::string Printable(const std::string& s) {
  std::string out;
  auto hex = [&out](unsigned char c) {
    static const char* kDigits = "0123456789abcdef";
    out += "\\x";
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  };
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xe  ? 3
                 : (c >> 3) == 0x1e ? 4
                                    : 0;
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s[i + k]) >> 6) == 0x2;
    if (!ok || (len == 1 && c < 0x20)) {
      hex(c);
      ++i;
      continue;
    }
    out.append(s, i, len);
    i += len;
  }
  return out;
}

std::string FramePath(const std::vector<Frame>& frames, const std::string& last_key) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < frames.size(); ++i) {
    const Frame& f = frames[i];
    bool top = i + 1 == frames.size();
    if (f.is_object) {
      parts.push_back(top ? last_key : f.key);
    } else if (!top) {
      parts.push_back("[" + std::to_string(f.index) + "]");
    }
  }
  return JoinPath(parts);
}

}  // namespace

KeyPositions IndexKeyPositions(std::string_view s) {
  KeyPositions index;
  struct Level {
    bool is_object;
    std::string key;   // current member key (objects)
    size_t index = 0;  // current element (arrays)
    bool expect_key = true;
  };
  std::vector<Level> stack;
  auto path_parts = [&stack](bool with_last_key) {
    std::vector<std::string> parts;
    for (size_t i = 0; i < stack.size(); ++i) {
      const Level& l = stack[i];
      bool last = i + 1 == stack.size();
      if (l.is_object) {
        if (!last || with_last_key) parts.push_back(l.key);
      } else if (!last) {
        parts.push_back("[" + std::to_string(l.index) + "]");
      }
    }
    return parts;
  };
  int line = 1;
  int col = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '"') {
      int start_line = line;
      int start_col = col;
      std::string text;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != '"'; ++j) {
        if (s[j] == '\\' && j + 1 < s.size()) text += s[j++];
        text += s[j];
      }
      col += static_cast<int>(j - i + 1);  // strings hold no raw newlines in valid JSON
      i = j;
      if (!stack.empty() && stack.back().is_object && stack.back().expect_key) {
        // Keys with escapes are indexed as written; DeepSpeed keys have none.
        stack.back().key = text;
        stack.back().expect_key = false;
        index[JoinPath(path_parts(true))].push_back({start_line, start_col});
      }
      continue;
    }
    if (c == '{' || c == '[') {
      stack.push_back(Level{c == '{', {}, 0, true});
    } else if (c == '}' || c == ']') {
      if (!stack.empty()) stack.pop_back();
    } else if (c == ',' && !stack.empty()) {
      if (stack.back().is_object) {
        stack.back().expect_key = true;
      } else {
        ++stack.back().index;
      }
    }
    if (c == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return index;
}

void LocateDiagnostics(const KeyPositions& index, std::vector<ConfigDiagnostic>* diags) {
  for (ConfigDiagnostic& d : *diags) {
    if (d.line > 0) continue;
    std::string path = d.path;
    while (!path.empty()) {
      auto it = index.find(path);
      if (it != index.end()) {
        size_t which = d.kind == ConfigDiagnostic::Kind::kDuplicateKey && it->second.size() > 1;
        d.line = it->second[which].first;
        d.column = it->second[which].second;
        break;
      }
      size_t cut = path.find_last_of(".[");
      path = cut == std::string::npos ? std::string() : path.substr(0, cut);
    }
  }
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

bool ParseJsonStrict(std::string_view stripped, nlohmann::ordered_json* out,
                     std::vector<ConfigDiagnostic>* errors) {
  using Json = nlohmann::ordered_json;
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
  std::vector<Frame> frames;
  size_t before = errors->size();
  auto after_child = [&frames] {
    if (!frames.empty() && !frames.back().is_object) ++frames.back().index;
  };
  Json::parser_callback_t cb = [&](int /*depth*/, nlohmann::json::parse_event_t event,
                                   Json& parsed) -> bool {
    using E = nlohmann::json::parse_event_t;
    switch (event) {
      case E::object_start:
        frames.push_back(Frame{true, {}, {}, 0});
        break;
      case E::array_start:
        frames.push_back(Frame{false, {}, {}, 0});
        break;
      case E::object_end:
      case E::array_end:
        if (!frames.empty()) frames.pop_back();
        after_child();
        break;
      case E::key: {
        Frame& f = frames.back();
        std::string k = parsed.get<std::string>();
        if (!f.keys.insert(k).second) {
          errors->push_back(ConfigDiagnostic{
              ConfigDiagnostic::Kind::kDuplicateKey, FramePath(frames, k),
              "duplicate key '" + k + "' (DeepSpeed rejects duplicate keys; keep one)", 0, 0});
        }
        f.key = k;
        break;
      }
      case E::value:
        after_child();
        break;
    }
    return true;
  };
  try {
    *out = Json::parse(stripped.begin(), stripped.end(), cb, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const nlohmann::json::parse_error& e) {
    ConfigDiagnostic d{ConfigDiagnostic::Kind::kSyntax, "", "", 0, 0};
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 3, column 5: syntax error ..."
    size_t colon = what.find(": ");
    d.message =
        "malformed JSON: " + Printable(colon == std::string::npos ? what : what.substr(colon + 2));
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
    d.message =
        "malformed JSON: " + Printable(colon == std::string::npos ? what : what.substr(colon + 2));
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
