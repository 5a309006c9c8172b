// Names of the config enums and diagnostics.
#include "strata/config.h"

namespace strata {

std::string_view OffloadDeviceName(OffloadDevice d) noexcept {
  switch (d) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "?";
}

std::string_view OptimizerTypeName(OptimizerType t) noexcept {
  switch (t) {
    case OptimizerType::kNone:
      return "none";
    case OptimizerType::kAdam:
      return "Adam";
    case OptimizerType::kAdamW:
      return "AdamW";
  }
  return "?";
}

std::string_view SchedulerTypeName(SchedulerType t) noexcept {
  switch (t) {
    case SchedulerType::kNone:
      return "none";
    case SchedulerType::kWarmupLR:
      return "WarmupLR";
    case SchedulerType::kWarmupDecayLR:
      return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR:
      return "WarmupCosineLR";
    case SchedulerType::kOneCycle:
      return "OneCycle";
    case SchedulerType::kLRRangeTest:
      return "LRRangeTest";
    case SchedulerType::kOther:
      return "other";
  }
  return "?";
}

std::string_view DiagnosticKindName(ConfigDiagnostic::Kind k) noexcept {
  using K = ConfigDiagnostic::Kind;
  switch (k) {
    case K::kSyntax:
      return "syntax";
    case K::kDuplicateKey:
      return "duplicate_key";
    case K::kType:
      return "type";
    case K::kRange:
      return "range";
    case K::kConflict:
      return "conflict";
    case K::kUnresolvedAuto:
      return "unresolved_auto";
    case K::kUnsupported:
      return "unsupported";
    case K::kUnknownKey:
      return "unknown_key";
    case K::kDeprecated:
      return "deprecated";
    case K::kIgnored:
      return "ignored";
    case K::kCase:
      return "case";
    case K::kMachine:
      return "machine";
  }
  return "?";
}

std::string PrintableText(std::string_view s) {
  std::string out;
  out.reserve(s.size());
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
    // C0 controls and DEL, and the C1 controls U+0080..U+009F (0xc2 0x80..0x9f), which some
    // terminals obey as escape sequences.
    const bool control =
        (len == 1 && (c < 0x20 || c == 0x7f)) ||
        (ok && len == 2 && c == 0xc2 && static_cast<unsigned char>(s[i + 1]) < 0xa0);
    if (!ok || control) {
      for (size_t k = 0; k < (ok ? len : 1); ++k) hex(static_cast<unsigned char>(s[i + k]));
      i += ok ? len : 1;
      continue;
    }
    out.append(s, i, len);
    i += len;
  }
  return out;
}

std::string ConfigDiagnostic::ToString() const {
  std::string s = path.empty() ? std::string() : PrintableText(path);
  if (line > 0) {
    std::string where = "line " + std::to_string(line) + ", column " + std::to_string(column);
    s = s.empty() ? where : s + " (" + where + ")";
  }
  if (s.empty()) s = "(root)";
  s += ": ";
  s += PrintableText(message);
  return s;
}

}  // namespace strata
