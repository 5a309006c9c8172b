// Text layer of the DeepSpeed config parser: hjson-style comments and trailing commas removed
// with every byte's line and column kept, then a strict JSON parse that rejects duplicate keys.
// Internal to strata_core.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/config.h"

namespace strata::config_internal {

// Replaces `//`, `#` and `/* */` comments (outside strings) and trailing commas before `}` / `]`
// by spaces, keeping newlines, so offsets in the result are offsets in `text`. An unterminated
// block comment is reported in *error (with line and column) and the rest is blanked.
std::string StripComments(std::string_view text, ConfigDiagnostic* error);

// 1-based line and column of byte `offset` in `text`.
void LineColumn(std::string_view text, size_t offset, int* line, int* column);

// Parses stripped JSON into *out. Malformed JSON: one kSyntax diagnostic with line and column
// (of the original text, same offsets). Duplicate keys: one kDuplicateKey diagnostic per
// duplicate, with its path. Returns false when any diagnostic was added.
bool ParseJsonStrict(std::string_view stripped, nlohmann::ordered_json* out,
                     std::vector<ConfigDiagnostic>* errors);

// "a.b.c" from a path stack; array indices as "[i]".
std::string JoinPath(const std::vector<std::string>& parts);

}  // namespace strata::config_internal
