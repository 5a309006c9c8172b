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
constexpr std::string_view kOneCycleParams[] = {"cycle_min_lr",
                                                "cycle_max_lr",
                                                "decay_lr_rate",
                                                "cycle_first_step_size",
                                                "cycle_second_step_size",
                                                "cycle_first_stair_count",
                                                "cycle_second_stair_count",
                                                "decay_step_size",
                                                "cycle_momentum",
                                                "cycle_min_mom",
                                                "cycle_max_mom",
                                                "decay_mom_rate",
                                                "last_batch_iteration"};
constexpr std::string_view kRangeTestParams[] = {"lr_range_test_min_lr", "lr_range_test_step_size",
                                                 "lr_range_test_step_rate",
                                                 "lr_range_test_staircase", "last_batch_iteration"};
constexpr double kAnyValue = -std::numeric_limits<double>::infinity();

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

// A finite JSON number >= `min`; `*out` unchanged when absent (or null, when `null_ok`), then
// an error if `required_by`.
Status ReadDouble(const EngineConfig& c, std::string_view name, double min, double* out,
                  const char* required_by = nullptr, bool null_ok = false) {
  STRATA_ASSIGN_OR_RETURN(std::optional<Json> v, Get(c, name));
  if (v && v->is_null() && null_ok) v.reset();
  if (!v) {
    if (required_by == nullptr) return Status::OK();
    return Bad(name, std::string("missing; ") + required_by + " requires it");
  }
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

// A JSON boolean; `*out` unchanged when absent.
Status ReadBool(const EngineConfig& c, std::string_view name, bool* out) {
  STRATA_ASSIGN_OR_RETURN(std::optional<Json> v, Get(c, name));
  if (!v) return Status::OK();
  if (!v->is_boolean()) return Bad(name, v->dump() + " is not a boolean");
  *out = v->get<bool>();
  return Status::OK();
}

// Adam's beta1 as a schedule writes it: in [0, 1).
Status CheckMomentum(std::string_view name, double m) {
  if (m >= 0 && m < 1) return Status::OK();
  return Bad(name, Num(m) + " must be in [0, 1): the optimizer's beta1");
}

}  // namespace

Status LrSchedule::ReadOneCycle(const EngineConfig& c) {
  const char* one_cycle = "OneCycle";
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "cycle_min_lr", 0, &min_lr_, one_cycle));
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "cycle_max_lr", 0, &max_lr_, one_cycle));
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "decay_lr_rate", kAnyValue, &decay_lr_rate_));
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "cycle_first_step_size", kAnyValue, &first_size_));
  if (!(first_size_ > 0)) {
    return Bad("cycle_first_step_size", Num(first_size_) + " must be > 0");
  }
  second_size_ = first_size_;
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "cycle_second_step_size", 0, &second_size_, nullptr,
                                    /*null_ok=*/true));
  total_size_ = first_size_ + second_size_;
  step_ratio_ = first_size_ / total_size_;
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "cycle_first_stair_count", kAnyValue, &first_stairs_));
  second_stairs_ = first_stairs_;
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "cycle_second_stair_count", kAnyValue, &second_stairs_,
                                    nullptr, /*null_ok=*/true));
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "decay_step_size", kAnyValue, &decay_step_size_));
  STRATA_RETURN_IF_ERROR(ReadBool(c, "cycle_momentum", &cycle_momentum_));
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "cycle_min_mom", kAnyValue, &min_mom_));
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "cycle_max_mom", kAnyValue, &max_mom_));
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "decay_mom_rate", kAnyValue, &decay_mom_rate_));
  // DeepSpeed's math.isclose(x, 0), which holds for 0 alone.
  skip_lr_decay_ = decay_step_size_ == 0 || decay_lr_rate_ == 0;
  skip_mom_decay_ = decay_step_size_ == 0 || decay_mom_rate_ == 0;
  if (!cycle_momentum_) return Status::OK();
  STRATA_RETURN_IF_ERROR(CheckMomentum("cycle_min_mom", min_mom_));
  STRATA_RETURN_IF_ERROR(CheckMomentum("cycle_max_mom", max_mom_));
  const std::pair<double, double> betas = c.optimizer.betas.value_or({0.9, 0.999});
  if (betas.second != 0.99) {
    notes_.push_back(Path("cycle_momentum") + ": the optimizer's betas are (momentum, 0.99), " +
                     "as DeepSpeed's OneCycle writes them; optimizer.params.betas[1] " +
                     Num(betas.second) + " is not used");
  }
  if (!skip_mom_decay_ && decay_mom_rate_ > 0 && decay_step_size_ > 0) {
    // beta1 = cycle_max_mom * (1 + decay_mom_rate * (t - total + 1) / decay_step_size) for
    // t >= total: it reaches 1 where (t - total + 1) >= decay_step_size * (1 / max - 1) / rate.
    const double after = decay_step_size_ * (1 / max_mom_ - 1) / decay_mom_rate_;
    if (std::isfinite(after) && total_size_ + after < 1e15) {
      int64_t t = std::max<int64_t>(static_cast<int64_t>(std::ceil(total_size_)),
                                    static_cast<int64_t>(std::ceil(total_size_ - 1 + after)));
      while (BetasAt(t)->first < 1) ++t;  // rounding of the closed form: at most a step or two
      while (t > 0 && static_cast<double>(t - 1) >= total_size_ && BetasAt(t - 1)->first >= 1) --t;
      const int64_t step = t + 1 + 1;  // IterationForStep(n) = n - 1, counted from step 1
      const std::string w =
          Path("decay_mom_rate") + ": beta1 grows after the cycle (cycle_max_mom * (1 + " +
          "decay_mom_rate * steps / decay_step_size)) and reaches 1 at optimizer step " +
          std::to_string(step) + ", where the run stops: Adam needs beta1 < 1 " +
          "(DeepSpeed trains on with it); set decay_mom_rate 0, or a rate that keeps it below 1 " +
          "for the run's steps";
      warnings_.push_back(w);
      notes_.push_back(w);
    }
  }
  return Status::OK();
}

Status LrSchedule::CheckBetasForStep(int64_t applied_steps) const {
  const std::optional<std::pair<double, double>> b = BetasForStep(applied_steps);
  if (!b || b->first < 1) return Status::OK();
  return Status::InvalidArgument(
      Path("decay_mom_rate") + ": OneCycle's beta1 has grown to " + Num(b->first) +
      " at optimizer step " + std::to_string(applied_steps + 1) + " (cycle_max_mom * (1 + " +
      "decay_mom_rate * steps after the cycle / decay_step_size)); Adam needs beta1 < 1. Set " +
      "decay_mom_rate 0, or a rate that keeps it below 1 for the run's steps, and resume from " +
      "the last checkpoint");
}

Status LrSchedule::ReadRangeTest(const EngineConfig& c) {
  min_lr_ = 1e-3;
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "lr_range_test_min_lr", 0, &min_lr_));
  STRATA_RETURN_IF_ERROR(ReadInt(c, "lr_range_test_step_size", 1, &range_step_size_));
  STRATA_RETURN_IF_ERROR(ReadDouble(c, "lr_range_test_step_rate", kAnyValue, &range_step_rate_));
  return ReadBool(c, "lr_range_test_staircase", &staircase_);
}

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
    case SchedulerType::kOneCycle:
      s.kind_ = Kind::kOneCycle;
      break;
    case SchedulerType::kLRRangeTest:
      s.kind_ = Kind::kLRRangeTest;
      break;
    default:
      return Status::InvalidArgument(
          "scheduler.type: \"" + sc.type_name +
          "\" is not supported; strata runs WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, "
          "LRRangeTest or no scheduler (constant optimizer.lr); a torch scheduler goes to "
          "initialize as lr_scheduler=");
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
  using Names = std::span<const std::string_view>;
  const Names names = cosine                          ? Names(kCosineParams)
                      : s.kind_ == Kind::kOneCycle    ? Names(kOneCycleParams)
                      : s.kind_ == Kind::kLRRangeTest ? Names(kRangeTestParams)
                                                      : Names(kWarmupParams);
  for (const auto& [name, text] : sc.params) {
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
  if (s.kind_ == Kind::kOneCycle) {
    STRATA_RETURN_IF_ERROR(s.ReadOneCycle(config));
    return s;
  }
  if (s.kind_ == Kind::kLRRangeTest) {
    STRATA_RETURN_IF_ERROR(s.ReadRangeTest(config));
    return s;
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
    STRATA_RETURN_IF_ERROR(
        ReadDouble(config, "total_num_steps", 0, &s.total_, sc.type_name.c_str()));
    if (s.total_ < static_cast<double>(s.warmup_)) {
      s.notes_.push_back(Path("total_num_steps") + ": " + Num(s.total_) +
                         " is less than warmup_num_steps " + std::to_string(s.warmup_) +
                         ", as DeepSpeed warns");
    }
  }
  if (cosine) {
    STRATA_RETURN_IF_ERROR(ReadDouble(config, "warmup_min_ratio", kAnyValue, &s.warmup_min_ratio_));
    STRATA_RETURN_IF_ERROR(ReadDouble(config, "cos_min_ratio", kAnyValue, &s.cos_min_ratio_));
    return s;
  }
  // WarmupDecayLR's own default is 0.001 for every group; WarmupLR's, and a null (None) for
  // either, each group's lr.
  s.max_lr_ = decay ? 0.001 : s.lr_;
  STRATA_RETURN_IF_ERROR(ReadDouble(config, "warmup_min_lr", 0, &s.min_lr_));
  STRATA_ASSIGN_OR_RETURN(std::optional<Json> max_lr, Get(config, "warmup_max_lr"));
  s.max_is_group_lr_ = max_lr ? max_lr->is_null() : !decay;
  if (s.max_is_group_lr_) s.max_lr_ = s.lr_;
  STRATA_RETURN_IF_ERROR(
      ReadDouble(config, "warmup_max_lr", 0, &s.max_lr_, nullptr, /*null_ok=*/true));
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

double LrSchedule::CycleScale(int64_t t) const {
  const double batch_iteration = static_cast<double>(t + 1);
  const double cycle = std::floor(1 + batch_iteration / total_size_);
  const double x = 1. + batch_iteration / total_size_ - cycle;
  double scale;
  double stairs;
  if (x <= step_ratio_) {
    scale = x / step_ratio_;
    stairs = first_stairs_;
  } else {
    scale = (x - 1) / (step_ratio_ - 1);
    stairs = second_stairs_;
  }
  if (stairs > 0) {
    const double cycle_iteration = std::fmod(batch_iteration, total_size_);
    const double position = cycle_iteration <= first_size_
                                ? cycle_iteration * stairs / first_size_
                                : (total_size_ - cycle_iteration) * stairs / second_size_;
    scale = std::floor(position) / stairs;
  }
  return scale;
}

std::optional<std::pair<double, double>> LrSchedule::BetasAt(int64_t t) const {
  if (kind_ != Kind::kOneCycle || !cycle_momentum_) return std::nullopt;
  constexpr double kBeta2 = 0.99;  // DeepSpeed's OneCycle: (momentum, 0.99)
  if (t < 0) return std::pair{min_mom_, kBeta2};
  if (static_cast<double>(t) < total_size_) {
    const double base_height = (max_mom_ - min_mom_) * CycleScale(t);
    return std::pair{max_mom_ - base_height, kBeta2};
  }
  if (skip_mom_decay_) return std::pair{max_mom_, kBeta2};
  const double decay_interval = (static_cast<double>(t) - total_size_ + 1) / decay_step_size_;
  return std::pair{max_mom_ * (1 + decay_mom_rate_ * decay_interval), kBeta2};
}

double LrSchedule::LrAt(int64_t t, std::optional<double> group_lr) const {
  const double lr = group_lr.value_or(lr_);
  switch (kind_) {
    case Kind::kConstant:
      return lr;
    case Kind::kLRRangeTest: {
      double interval = static_cast<double>(t + 1) / static_cast<double>(range_step_size_);
      if (staircase_) interval = std::floor(interval);
      return min_lr_ * (1 + range_step_rate_ * interval);
    }
    case Kind::kOneCycle: {
      if (t < 0) return min_lr_;
      if (static_cast<double>(t) < total_size_) {
        return min_lr_ + (max_lr_ - min_lr_) * CycleScale(t);
      }
      if (skip_lr_decay_) return min_lr_;
      const double decay_interval = (static_cast<double>(t) - total_size_ + 1) / decay_step_size_;
      return min_lr_ / (1 + decay_lr_rate_ * decay_interval);
    }
    case Kind::kWarmupCosineLR: {
      if (t < 0) return 0.0;
      double ratio;
      if (t < warmup_) {
        ratio = warmup_min_ratio_ + WarmupGamma(t) * (1. - warmup_min_ratio_);
      } else {
        const int64_t real_last_step = t - warmup_ + 1;
        const double real_total_steps = std::max(1.0, total_ - static_cast<double>(warmup_));
        const double progress =
            std::min(1.0, static_cast<double>(real_last_step) / real_total_steps);
        ratio = (1 + std::cos(std::numbers::pi * progress)) / 2;
        ratio = std::max(0.0, cos_min_ratio_ + (1. - cos_min_ratio_) * ratio);
      }
      return lr * ratio;
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
    gamma = std::max(0.0, (total_ - static_cast<double>(t)) /
                              std::max(1.0, total_ - static_cast<double>(warmup_)));
  }
  const double max_lr = max_is_group_lr_ ? lr : max_lr_;
  return min_lr_ + (max_lr - min_lr_) * gamma;
}

std::string LrSchedule::Describe() const {
  const std::string w = std::to_string(warmup_) + (log_warmup_ ? " steps, log" : " steps, linear");
  const std::string total = Num(total_) + " total steps";
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
    case Kind::kOneCycle:
      return "OneCycle(lr " + Num(min_lr_) + ".." + Num(max_lr_) + ", " + Num(first_size_) + "+" +
             Num(second_size_) + " steps" +
             (cycle_momentum_ ? ", momentum " + Num(max_mom_) + ".." + Num(min_mom_) : "") +
             (skip_lr_decay_ ? "" : ", lr decay " + Num(decay_lr_rate_)) + ")";
    case Kind::kLRRangeTest:
      return "LRRangeTest(min " + Num(min_lr_) + ", rate " + Num(range_step_rate_) + " per " +
             std::to_string(range_step_size_) + " steps" + (staircase_ ? ", staircase" : "") + ")";
  }
  return "?";
}

}  // namespace strata::zero
