#include "tools/offloadctl/bench_common.h"

#include <cctype>
#include <limits>

namespace strata::cli {

std::optional<size_t> ParseCount(const std::string& s) {
  if (s.empty() || !std::isdigit(static_cast<unsigned char>(s[0]))) return std::nullopt;
  size_t pos = 0;
  unsigned long long v = 0;
  while (pos < s.size() && std::isdigit(static_cast<unsigned char>(s[pos]))) {
    const unsigned digit = static_cast<unsigned>(s[pos] - '0');
    if (v > (std::numeric_limits<unsigned long long>::max() - digit) / 10) return std::nullopt;
    v = v * 10 + digit;
    ++pos;
  }
  int shift = 0;
  if (pos < s.size()) {
    switch (std::toupper(static_cast<unsigned char>(s[pos]))) {
      case 'K':
        shift = 10;
        break;
      case 'M':
        shift = 20;
        break;
      case 'G':
        shift = 30;
        break;
      default:
        return std::nullopt;
    }
    ++pos;
  }
  if (pos != s.size() || v == 0) return std::nullopt;
  if (v > (std::numeric_limits<size_t>::max() >> shift)) return std::nullopt;
  return static_cast<size_t>(v) << shift;
}

}  // namespace strata::cli
