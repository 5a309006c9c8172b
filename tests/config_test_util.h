// Helpers shared by the DeepSpeed config tests.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "strata/config.h"

namespace strata::testing {

// The first diagnostic of `kind` at `path` in `diags`, or nullptr.
inline const ConfigDiagnostic* FindDiag(const std::vector<ConfigDiagnostic>& diags,
                                        ConfigDiagnostic::Kind kind, std::string_view path) {
  auto it = std::find_if(diags.begin(), diags.end(), [&](const ConfigDiagnostic& d) {
    return d.kind == kind && d.path == path;
  });
  return it == diags.end() ? nullptr : &*it;
}

inline std::string Dump(const std::vector<ConfigDiagnostic>& diags) {
  std::string s;
  for (const auto& d : diags)
    s += "  [" + std::string(DiagnosticKindName(d.kind)) + "] " + d.ToString() + "\n";
  return s;
}

// Parses `text` and asserts success (printing every error otherwise).
inline ParsedConfig MustParse(std::string_view text, const ParseOptions& o = {}) {
  ConfigCheck c = CheckDeepSpeedConfig(text, o);
  EXPECT_TRUE(c.ok()) << "errors:\n" << Dump(c.errors);
  if (!c.ok()) return ParsedConfig{};
  return *c.parsed;
}

}  // namespace strata::testing
