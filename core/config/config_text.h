// Text layer of the DeepSpeed config parser: hjson-style comments and trailing commas removed
// with every byte's line and column kept, then a strict JSON parse that rejects duplicate keys.
// Internal to strata_config.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/config.h"

namespace strata::config {

// Replaces `//`, `#` and `/* */` comments (outside strings) and trailing commas before `}` / `]`
// by spaces, keeping newlines, so offsets in the result are offsets in `text`. An unterminated
// block comment is reported in *error (with line and column) and the rest is blanked.
std::string StripComments(std::string_view text, ConfigDiagnostic* error);

// 1-based line and column of byte `offset` in `text`.
void LineColumn(std::string_view text, size_t offset, int* line, int* column);

// Deepest nesting of objects and arrays a config may have (deeper: a kSyntax diagnostic).
inline constexpr size_t kMaxJsonDepth = 64;

// Parses stripped JSON into *out. Malformed JSON: one kSyntax diagnostic with line and column
// (of the original text, same offsets). Duplicate keys: one kDuplicateKey diagnostic per
// duplicate, with its path. Returns false when any diagnostic was added.
bool ParseJsonStrict(std::string_view stripped, nlohmann::ordered_json* out,
                     std::vector<ConfigDiagnostic>* errors);

// Where each member key of the (valid, stripped) JSON text starts: dotted path -> 1-based
// (line, column) of every occurrence, in document order. Array elements are "path[i]".
using KeyPositions = std::map<std::string, std::vector<std::pair<int, int>>>;
KeyPositions IndexKeyPositions(std::string_view stripped);

// Sets line/column of each diagnostic without one from the position of its path (or of the
// nearest enclosing key); a duplicate-key diagnostic gets the second occurrence.
void LocateDiagnostics(const KeyPositions& index, std::vector<ConfigDiagnostic>* diags);

// "a.b.c" from a path stack; array indices as "[i]".
std::string JoinPath(const std::vector<std::string>& parts);

}  // namespace strata::config
