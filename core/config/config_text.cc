#include "core/config/config_text.h"

#include <algorithm>
#include <cstdint>

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

constexpr uint64_t kMod = (uint64_t{1} << 61) - 1;

// x mod 2^61 - 1 for x < 2^123, by folding at bit 61 (no division).
constexpr uint64_t Fold(unsigned __int128 x) {
  uint64_t r = static_cast<uint64_t>(x & kMod) + static_cast<uint64_t>(x >> 61);
  r = (r & kMod) + (r >> 61);
  return r >= kMod ? r - kMod : r;
}

constexpr uint64_t MulMod(uint64_t a, uint64_t b) {
  return Fold(static_cast<unsigned __int128>(a) * b);
}

// A polynomial hash modulo 2^61 - 1 of a dotted path (as JoinPath writes it), extended part by
// part, so that the path of a key under a long parent costs only the key's own bytes. Two paths
// with the same hash (a chance of about n^2 / 2^61 among n keys) can only move a diagnostic's
// line and column, never its path or message.
class PathHash {
 public:
  void Add(unsigned char c) {
    h_ = Fold(static_cast<unsigned __int128>(h_) * kBase + c + 1);
    ++len_;
  }
  void Add(std::string_view s) {
    // Four bytes a step, h B^4 + (a+1) B^3 + (b+1) B^2 + (c+1) B + d + 1: the value of four
    // single steps with one dependent multiply instead of four (the sum stays below 2^123).
    size_t i = 0;
    for (; i + 4 <= s.size(); i += 4) {
      using U = unsigned __int128;
      const U x = static_cast<U>(h_) * kBase4 + static_cast<U>(Byte(s[i]) + 1) * kBase3 +
                  static_cast<U>(Byte(s[i + 1]) + 1) * kBase2 +
                  static_cast<U>(Byte(s[i + 2]) + 1) * kBase + Byte(s[i + 3]) + 1;
      h_ = Fold(x);
    }
    len_ += i;
    for (; i < s.size(); ++i) Add(Byte(s[i]));
  }
  // JoinPath's rule: a part that opens with '[' is appended as is, any other after a '.'.
  void AddPart(std::string_view part) {
    if ((part.empty() || part[0] != '[') && len_ > 0) Add('.');
    Add(part);
  }
  uint64_t value() const { return h_; }

 private:
  static constexpr uint64_t kBase = 0x1b873593a5f9ULL;
  static constexpr uint64_t kBase2 = MulMod(kBase, kBase);
  static constexpr uint64_t kBase3 = MulMod(kBase2, kBase);
  static constexpr uint64_t kBase4 = MulMod(kBase3, kBase);

  static constexpr uint64_t Byte(char c) { return static_cast<unsigned char>(c); }

  uint64_t h_ = 0;
  size_t len_ = 0;
};

// Appends the hashes a diagnostic's path is looked up by, best first: the whole path, then each
// prefix that ends before a '.' or '[' (the enclosing keys), longest first.
void AddCandidates(std::string_view path, std::vector<uint64_t>* out) {
  const size_t first = out->size();
  PathHash h;
  // A separator at 0 ends no prefix (the old loop cut at it and stopped at "").
  for (size_t i = 0;;) {
    const size_t next = path.find_first_of(".[", i + 1);
    if (next == std::string_view::npos) {
      h.Add(path.substr(i));
      break;
    }
    h.Add(path.substr(i, next - i));
    out->push_back(h.value());
    i = next;
  }
  out->push_back(h.value());
  std::reverse(out->begin() + static_cast<ptrdiff_t>(first), out->end());
}

// Where a key path occurs: its first and second occurrence (a duplicate), 1-based; 0 = none.
struct Where {
  int line = 0;
  int column = 0;
  int line2 = 0;
  int column2 = 0;
};

// The wanted path hashes and where each was found: open addressing, at most half full. Path
// hashes are uniform already, so their low bits pick the slot.
class PathTable {
 public:
  explicit PathTable(size_t wanted) {
    size_t n = 16;
    while (n < 2 * wanted) n *= 2;
    slots_.assign(n, Slot{});
  }
  void Want(uint64_t h) { SlotOf(h).hash = h; }
  // The entry of `h`, or nullptr when it is not wanted.
  Where* Lookup(uint64_t h) {
    Slot& s = SlotOf(h);
    return s.hash == h ? &s.where : nullptr;
  }

 private:
  static constexpr uint64_t kFree = UINT64_MAX;  // no path hash (all are < 2^61)
  struct Slot {
    uint64_t hash = kFree;
    Where where;
  };
  // The slot holding `h`, or the free slot where it belongs.
  Slot& SlotOf(uint64_t h) {
    size_t i = h & (slots_.size() - 1);
    while (slots_[i].hash != kFree && slots_[i].hash != h) i = (i + 1) & (slots_.size() - 1);
    return slots_[i];
  }
  std::vector<Slot> slots_;
};

// The decoded text of the JSON string token s[begin, end] (both quotes included), as the
// parser reads it: keys in diagnostics are decoded, so "a\u002eb" is found as "a.b".
std::string DecodeString(std::string_view s, size_t begin, size_t end) {
  const std::string_view token = s.substr(begin, end - begin + 1);
  nlohmann::json decoded = nlohmann::json::parse(token, nullptr, /*allow_exceptions=*/false);
  if (decoded.is_string()) return decoded.get<std::string>();
  return std::string(token.substr(1, token.size() - 2));
}

// One pass over valid JSON text: records in `table` the positions of the member keys whose
// path hash it wants.
void FindKeys(std::string_view s, PathTable* table) {
  struct Level {
    bool is_object;
    PathHash path;      // of the object or array itself
    PathHash key_path;  // objects: of the current member
    size_t index = 0;   // arrays: the current element
    bool expect_key = true;
  };
  std::vector<Level> stack;
  int line = 1;
  int col = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '"') {
      const int start_col = col;
      bool escaped = false;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != '"'; ++j) {
        if (s[j] == '\\') {
          escaped = true;
          ++j;
        }
      }
      col += static_cast<int>(j - i + 1);  // strings hold no raw newlines in valid JSON
      if (!stack.empty() && stack.back().is_object && stack.back().expect_key) {
        Level& l = stack.back();
        l.key_path = l.path;
        const size_t end = std::min(j, s.size() - 1);
        l.key_path.AddPart(escaped ? std::string_view(DecodeString(s, i, end))
                                   : s.substr(i + 1, j - i - 1));
        l.expect_key = false;
        if (Where* w = table->Lookup(l.key_path.value())) {
          if (w->line == 0) {
            w->line = line;
            w->column = start_col;
          } else if (w->line2 == 0) {
            w->line2 = line;
            w->column2 = start_col;
          }
        }
      }
      i = j;
      continue;
    }
    if (c == '{' || c == '[') {
      Level next{c == '{', {}, {}, 0, true};
      if (!stack.empty()) {
        const Level& parent = stack.back();
        if (parent.is_object) {
          next.path = parent.key_path;
        } else {
          next.path = parent.path;
          next.path.AddPart("[" + std::to_string(parent.index) + "]");
        }
      }
      stack.push_back(next);
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
}

}  // namespace

void LocateDiagnostics(std::string_view stripped,
                       std::initializer_list<std::vector<ConfigDiagnostic>*> lists) {
  // Each diagnostic's candidate hashes are candidates[range[k].first, range[k].second); one
  // with the path of the one before (duplicates of one key) shares its range.
  std::vector<ConfigDiagnostic*> todo;
  std::vector<std::pair<size_t, size_t>> range;
  std::vector<uint64_t> candidates;
  for (std::vector<ConfigDiagnostic>* diags : lists) {
    for (ConfigDiagnostic& d : *diags) {
      if (d.line > 0 || d.path.empty()) continue;
      if (!todo.empty() && todo.back()->path == d.path) {
        range.push_back(range.back());
      } else {
        const size_t first = candidates.size();
        AddCandidates(d.path, &candidates);
        range.emplace_back(first, candidates.size());
      }
      todo.push_back(&d);
    }
  }
  if (todo.empty()) return;
  PathTable table(candidates.size());
  for (uint64_t h : candidates) table.Want(h);
  FindKeys(stripped, &table);
  for (size_t k = 0; k < todo.size(); ++k) {
    ConfigDiagnostic* d = todo[k];
    for (size_t c = range[k].first; c < range[k].second; ++c) {
      const Where* w = table.Lookup(candidates[c]);
      if (w == nullptr || w->line == 0) continue;
      const bool second = d->kind == ConfigDiagnostic::Kind::kDuplicateKey && w->line2 > 0;
      d->line = second ? w->line2 : w->line;
      d->column = second ? w->column2 : w->column;
      break;
    }
  }
}

}  // namespace strata::config
