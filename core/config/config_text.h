// Text layer of the DeepSpeed config parser: hjson-style comments and trailing commas removed
// with every byte's line and column kept, then a strict JSON parse that rejects duplicate keys.
// Internal to strata_config.
#pragma once

#include <initializer_list>
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

// Parses stripped JSON into *out, in time linear in its size. Malformed JSON: one kSyntax
// diagnostic with line and column (of the original text, same offsets). Duplicate keys: one
// kDuplicateKey diagnostic per duplicate, with its path (the first 20; the rest are counted in
// one more diagnostic). Returns false when any diagnostic was added; *out is then unspecified.
bool ParseJsonStrict(std::string_view stripped, nlohmann::ordered_json* out,
                     std::vector<ConfigDiagnostic>* errors);

// Sets line/column of each diagnostic in `lists` without one from the position of the key at its
// path in `stripped` (valid JSON, keys matched as decoded), or of the nearest enclosing key; a
// duplicate-key diagnostic gets the second occurrence. One pass over the text, however many
// diagnostics there are.
void LocateDiagnostics(std::string_view stripped,
                       std::initializer_list<std::vector<ConfigDiagnostic>*> lists);

// "a.b.c" from a path stack; array indices as "[i]".
std::string JoinPath(const std::vector<std::string>& parts);

}  // namespace strata::config
