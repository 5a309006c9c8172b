// Readable numeric range checks for CLI11 options. CLI11's PositiveNumber / NonNegativeNumber
// report their upper limit (DBL_MAX) as a 300-digit number; these say "must be >= 1" instead.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

namespace strata::cli {

// Whether all of `s` is a finite number (not "nan", "inf", "1e999" or "3x"); *v is it.
inline bool ParseFinite(const std::string& s, double* v) {
  errno = 0;
  char* end = nullptr;
  *v = std::strtod(s.c_str(), &end);
  return !s.empty() && end == s.c_str() + s.size() && errno != ERANGE && std::isfinite(*v);
}

// Accepts a finite number v with v >= min (inclusive) or v > min; `integer` also requires a
// whole number. The error names the value and the rule, e.g. "must be >= 1, got 0".
inline CLI::Validator AtLeast(double min, bool inclusive = true, bool integer = false) {
  std::string lim = std::to_string(min);
  lim.erase(lim.find_last_not_of('0') + 1);
  if (!lim.empty() && lim.back() == '.') lim.pop_back();
  const std::string rule = std::string(inclusive ? ">= " : "> ") + lim;
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        double v = 0;
        if (!ParseFinite(s, &v)) return "'" + s + "' is not a number";
        if (integer && v != std::floor(v)) return "must be a whole number, got " + s;
        if (inclusive ? !(v >= min) : !(v > min)) return "must be " + rule + ", got " + s;
        return {};
      },
      (integer ? "INT " : "NUMBER ") + rule);
}

// Accepts a finite number in [lo, hi] (CLI::Range lets "nan" through: every comparison with it
// is false).
inline CLI::Validator Between(double lo, double hi) {
  const auto num = [](double v) {
    std::string t = std::to_string(v);
    t.erase(t.find_last_not_of('0') + 1);
    if (!t.empty() && t.back() == '.') t.pop_back();
    return t;
  };
  const std::string rule = "in [" + num(lo) + ", " + num(hi) + "]";
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        double v = 0;
        if (!ParseFinite(s, &v)) return "'" + s + "' is not a number";
        if (!(v >= lo && v <= hi)) return "must be " + rule + ", got " + s;
        return {};
      },
      "NUMBER " + rule);
}

}  // namespace strata::cli
