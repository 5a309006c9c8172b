#include "core/zero/lr_schedule.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <numbers>
#include <optional>
#include <span>
#include <string_view>

#include <nlohmann/json.hpp>

namespace strata::zero {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kWarmupParams[] = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                              "warmup_type", "last_batch_iteration"};
constexpr std::string_view kCosineParams[] = {"total_num_steps",  "warmup_min_ratio",
                                              "warmup_num_steps", "cos_min_ratio",
                                              "warmup_type",      "last_batch_iteration"};

std::string Num(double v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::general);
  return ec == std::errc() ? std::string(buf, end) : std::string("?");
}

std::string Path(std::string_view name) { return "scheduler.params." + std::string(name); }

Status Bad(std::string_view name, const std::string& what) {
  return Status::InvalidArgument(Path(name) + ": " + what);
}

// params[name] parsed; nullopt when absent.
Result<std::optional<Json>> Get(const EngineConfig& c, std::string_view name) {
  auto it = c.scheduler.params.find(std::string(name));
  if (it == c.scheduler.params.end()) return std::optional<Json>();
  Json j = Json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad(name, "not JSON: " + it->second);
  if ((j.is_string() && j.get<std::string>() == "auto") || c.IsAuto(Path(name))) {
    return Bad(name, "still \"auto\"; resolve it (ParseOptions::auto_values) first");
  }
  return std::optional<Json>(std::move(j));
}

// A JSON integer >= `min`; `*out` unchanged when absent (then an error if `required_by`).
Status ReadInt(const EngineConfig& c, std::string_view name, int64_t min, int64_t* out,
               const char* required_by = nullptr) {
  STRATA_ASSIGN_OR_RETURN(std::optional<Json> v, Get(c, name));
  if (!v) {
    if (required_by == nullptr) return Status::OK();
    return Bad(name, std::string("missing; ") + required_by + " requires it");
  }
  const bool fits = v->is_number_integer() &&
                    !(v->is_number_unsigned() &&
                      v->get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()});
  if (!fits) return Bad(name, v->dump() + " is not an integer");
  const int64_t n = v->get<int64_t>();
  if (n < min) return Bad(name, std::to_string(n) + " must be >= " + std::to_string(min));
  *out = n;
  return Status::OK();
}

// A finite JSON number >= `min`; `*out` unchanged when absent.
Status ReadDouble(const EngineConfig& c, std::string_view name, double min, double* out) {
  STRATA_ASSIGN_OR_RETURN(std::optional<Json> v, Get(c, name));
  if (!v) return Status::OK();
  if (!v->is_number()) {
    return Bad(name, v->dump() + " is not a number (per-group lists are not supported)");
  }
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < min) {
    return Bad(name, Num(d) + " must be finite" + (std::isinf(min) ? "" : " and >= " + Num(min)));
  }
  *out = d;
  return Status::OK();
}

}  // namespace

Result<LrSchedule> LrSchedule::FromConfig(const EngineConfig& config) {
  const SchedulerConfig& sc = config.scheduler;
  LrSchedule s;
  switch (sc.type) {
    case SchedulerType::kNone:
      s.kind_ = Kind::kConstant;
      break;
    case SchedulerType::kWarmupLR:
      s.kind_ = Kind::kWarmupLR;
      break;
    case SchedulerType::kWarmupDecayLR:
      s.kind_ = Kind::kWarmupDecayLR;
      break;
    case SchedulerType::kWarmupCosineLR:
      s.kind_ = Kind::kWarmupCosineLR;
      break;
    default:
      return Status::InvalidArgument("scheduler.type: \"" + sc.type_name +
                                     "\" is not supported; strata runs WarmupLR, WarmupDecayLR, "
                                     "WarmupCosineLR or no scheduler (constant optimizer.lr)");
  }
  const AutoOr<double>& lr = config.optimizer.lr;
  if (!lr.has_value()) {
    return Status::InvalidArgument(lr.is_auto() ? "optimizer.lr: still \"auto\"; resolve it first"
                                                : "optimizer.lr: absent");
  }
  if (!std::isfinite(lr.value()) || lr.value() < 0) {
    return Status::InvalidArgument("optimizer.lr: " + Num(lr.value()) + " must be finite and >= 0");
  }
  s.lr_ = lr.value();
  if (s.kind_ == Kind::kConstant) return s;

  // DeepSpeed passes the params as keyword arguments: any other name is a TypeError there.
  const bool cosine = s.kind_ == Kind::kWarmupCosineLR;
  const bool decay = s.kind_ == Kind::kWarmupDecayLR;
  for (const auto& [name, text] : sc.params) {
    using Names = std::span<const std::string_view>;
    const Names names = cosine ? Names(kCosineParams) : Names(kWarmupParams);
    const bool known = (decay && name == "total_num_steps") ||
                       std::find(names.begin(), names.end(), name) != names.end();
    if (!known) return Bad(name, "not a parameter of " + sc.type_name);
  }
  int64_t last = -1;
  STRATA_RETURN_IF_ERROR(ReadInt(config, "last_batch_iteration", -1, &last));
  if (last != -1) {
    return Bad("last_batch_iteration",
               std::to_string(last) + ": only -1 is supported (resume from a checkpoint)");
  }
  int64_t warmup = 1000;
  STRATA_RETURN_IF_ERROR(ReadInt(config, "warmup_num_steps", 1, &warmup));
  s.warmup_ = std::max<int64_t>(2, warmup);
  if (warmup == 1) s.notes_.push_back(Path("warmup_num_steps") + ": 1 runs as 2, as in DeepSpeed");

  STRATA_ASSIGN_OR_RETURN(std::optional<Json> type, Get(config, "warmup_type"));
  const std::string type_name = type && type->is_string() ? type->get<std::string>() : "";
  if (type && type_name != "log" && type_name != "linear") {
    s.notes_.push_back(Path("warmup_type") + ": unknown warmup_type " + type->dump() +
                       "; using \"log\", as DeepSpeed does");
  }
  s.log_warmup_ = type_name != "linear";

  if (decay || cosine) {
    STRATA_RETURN_IF_ERROR(ReadInt(config, "total_num_steps", 0, &s.total_, sc.type_name.c_str()));
    if (s.total_ < s.warmup_) {
      s.notes_.push_back(Path("total_num_steps") + ": " + std::to_string(s.total_) +
                         " is less than warmup_num_steps " + std::to_string(s.warmup_) +
                         ", as DeepSpeed warns");
    }
  }
  if (cosine) {
    constexpr double kAny = -std::numeric_limits<double>::infinity();
    STRATA_RETURN_IF_ERROR(ReadDouble(config, "warmup_min_ratio", kAny, &s.warmup_min_ratio_));
    STRATA_RETURN_IF_ERROR(ReadDouble(config, "cos_min_ratio", kAny, &s.cos_min_ratio_));
    return s;
  }
  s.max_lr_ = decay ? 0.001 : s.lr_;  // WarmupDecayLR's own default, not optimizer.lr
  STRATA_RETURN_IF_ERROR(ReadDouble(config, "warmup_min_lr", 0, &s.min_lr_));
  STRATA_RETURN_IF_ERROR(ReadDouble(config, "warmup_max_lr", 0, &s.max_lr_));
  return s;
}

// DeepSpeed's expressions and order of operations, so results match bit-for-bit.
double LrSchedule::WarmupGamma(int64_t t) const {
  if (log_warmup_) {
    const double inverse_log_warm_up = 1.0 / std::log(static_cast<double>(warmup_));
    return inverse_log_warm_up * std::log(static_cast<double>(t + 1));
  }
  return static_cast<double>(t) / static_cast<double>(warmup_);
}

double LrSchedule::LrAt(int64_t t) const {
  switch (kind_) {
    case Kind::kConstant:
      return lr_;
    case Kind::kWarmupCosineLR: {
      if (t < 0) return 0.0;
      double ratio;
      if (t < warmup_) {
        ratio = warmup_min_ratio_ + WarmupGamma(t) * (1. - warmup_min_ratio_);
      } else {
        const int64_t real_last_step = t - warmup_ + 1;
        const int64_t real_total_steps = std::max<int64_t>(1, total_ - warmup_);
        const double progress = std::min(
            1.0, static_cast<double>(real_last_step) / static_cast<double>(real_total_steps));
        ratio = (1 + std::cos(std::numbers::pi * progress)) / 2;
        ratio = std::max(0.0, cos_min_ratio_ + (1. - cos_min_ratio_) * ratio);
      }
      return lr_ * ratio;
    }
    case Kind::kWarmupLR:
    case Kind::kWarmupDecayLR:
      break;
  }
  if (t < 0) return min_lr_;
  double gamma = 1.0;
  if (t < warmup_) {
    gamma = WarmupGamma(t);
  } else if (kind_ == Kind::kWarmupDecayLR) {
    gamma = std::max(0.0, static_cast<double>(total_ - t) /
                              std::max(1.0, static_cast<double>(total_ - warmup_)));
  }
  return min_lr_ + (max_lr_ - min_lr_) * gamma;
}

std::string LrSchedule::Describe() const {
  const std::string w = std::to_string(warmup_) + (log_warmup_ ? " steps, log" : " steps, linear");
  const std::string total = std::to_string(total_) + " total steps";
  switch (kind_) {
    case Kind::kConstant:
      return "constant lr " + Num(lr_);
    case Kind::kWarmupLR:
      return "WarmupLR(min " + Num(min_lr_) + ", max " + Num(max_lr_) + ", " + w + ")";
    case Kind::kWarmupDecayLR:
      return "WarmupDecayLR(min " + Num(min_lr_) + ", max " + Num(max_lr_) + ", " + w + ", " +
             total + ")";
    case Kind::kWarmupCosineLR:
      return "WarmupCosineLR(lr " + Num(lr_) + ", min ratio " + Num(warmup_min_ratio_) + ", " + w +
             ", cos min ratio " + Num(cos_min_ratio_) + ", " + total + ")";
  }
  return "?";
}

}  // namespace strata::zero
