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

std::string ConfigDiagnostic::ToString() const {
  std::string s = path.empty() ? std::string() : path;
  if (line > 0) {
    std::string where = "line " + std::to_string(line) + ", column " + std::to_string(column);
    s = s.empty() ? where : s + " (" + where + ")";
  }
  if (s.empty()) s = "(root)";
  s += ": ";
  s += message;
  return s;
}

}  // namespace strata
