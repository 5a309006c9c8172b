#include "core/zero/loss_scaler.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace strata::zero {
namespace {

// Shortest text that reads back as `v`, in %g style ("65536", "0.0001", "1e-05").
std::string Num(double v) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::general);
  return ec == std::errc() ? std::string(buf, end) : std::string("?");
}

Status Bad(const char* path, const std::string& what) {
  return Status::InvalidArgument(std::string(path) + ": " + what);
}

}  // namespace

Result<LossScaler> LossScaler::FromConfig(const EngineConfig& config) {
  const Fp16Config& f = config.fp16;
  if (f.enabled.is_auto()) {
    return Bad("fp16.enabled", "still \"auto\"; resolve it (the trainer's --fp16) first");
  }
  LossScaler s;
  if (!f.enabled.value_or(false)) return s;  // bf16 / fp32: kNone, scale 1

  if (!std::isfinite(f.loss_scale) || f.loss_scale < 0) {
    return Bad("fp16.loss_scale", Num(f.loss_scale) + " must be finite and >= 0 (0 = dynamic)");
  }
  if (f.loss_scale > 0) {
    s.mode_ = LossScaleMode::kStatic;
    s.state_.scale = f.loss_scale;
    return s;
  }
  // Dynamic: DeepSpeed validates these only here (its _validated_dynamic_loss_args).
  if (f.initial_scale_power < 0 || f.initial_scale_power > 64) {
    return Bad("fp16.initial_scale_power",
               std::to_string(f.initial_scale_power) + " outside [0, 64]");
  }
  if (f.loss_scale_window < 1) {
    return Bad("fp16.loss_scale_window", std::to_string(f.loss_scale_window) + " must be >= 1");
  }
  if (f.hysteresis < 1) {
    return Bad("fp16.hysteresis", std::to_string(f.hysteresis) + " must be >= 1");
  }
  if (!std::isfinite(f.min_loss_scale) || f.min_loss_scale <= 0) {
    return Bad("fp16.min_loss_scale", Num(f.min_loss_scale) + " must be finite and > 0");
  }
  s.mode_ = LossScaleMode::kDynamic;
  s.no_hysteresis_ = config.zero.stage == 0;
  s.window_ = f.loss_scale_window;
  s.hysteresis_ = f.hysteresis;
  s.consecutive_hysteresis_ = f.consecutive_hysteresis;
  s.min_scale_ = f.min_loss_scale;
  s.state_.scale = std::ldexp(1.0, static_cast<int>(f.initial_scale_power));
  s.state_.hysteresis_left = f.hysteresis;
  return s;
}

Status LossScaler::Update(bool overflow) {
  LossScalerState& s = state_;
  if (mode_ != LossScaleMode::kDynamic) {
    if (overflow) s.last_overflow_iteration = s.iteration;
    ++s.iteration;
    return Status::OK();
  }
  if (overflow && no_hysteresis_) {
    s.scale = std::max(s.scale / 2, min_scale_);  // FP16_Optimizer: at the minimum it stays
    s.last_overflow_iteration = s.iteration;
  } else if (overflow) {
    if (hysteresis_ == 1 || s.hysteresis_left == 1) {
      // Exact equality, as DeepSpeed: a scale started below the minimum is raised to it instead.
      if (s.scale == min_scale_) {
        return Status::FailedPrecondition(
            "Current loss scale already at minimum (fp16.min_loss_scale = " + Num(min_scale_) +
            ") - cannot decrease scale anymore after the overflow at iteration " +
            std::to_string(s.iteration) + "; DeepSpeed exits the run here");
      }
      s.scale = std::max(s.scale / 2, min_scale_);
    } else {
      --s.hysteresis_left;
    }
    s.last_overflow_iteration = s.iteration;
  } else {
    if (consecutive_hysteresis_) s.hysteresis_left = hysteresis_;
    const int64_t stable = s.iteration - s.last_overflow_iteration - 1;
    if (stable > 0 && stable % window_ == 0) {
      if (!consecutive_hysteresis_) s.hysteresis_left = hysteresis_;
      s.scale *= 2;
    }
  }
  ++s.iteration;
  return Status::OK();
}

Status LossScaler::Restore(const LossScalerState& st) {
  const auto bad = [](const std::string& what) {
    return Status::InvalidArgument("loss scaler state: " + what);
  };
  if (!std::isfinite(st.scale) || st.scale <= 0) {
    return bad("scale " + Num(st.scale) + " must be finite and > 0");
  }
  if (mode_ != LossScaleMode::kDynamic && st.scale != state_.scale) {
    return bad("scale " + Num(st.scale) + " differs from the configured fixed scale " +
               Num(state_.scale));
  }
  if (st.iteration < 0) return bad("iteration " + std::to_string(st.iteration) + " < 0");
  if (st.last_overflow_iteration < -1 || st.last_overflow_iteration >= st.iteration) {
    return bad("last_overflow_iteration " + std::to_string(st.last_overflow_iteration) +
               " outside [-1, iteration " + std::to_string(st.iteration) + ")");
  }
  const bool dyn = mode_ == LossScaleMode::kDynamic;
  if (dyn ? (st.hysteresis_left < 1 || st.hysteresis_left > hysteresis_)
          : st.hysteresis_left != 0) {
    return bad("hysteresis_left " + std::to_string(st.hysteresis_left) +
               (dyn ? " outside [1, fp16.hysteresis = " + std::to_string(hysteresis_) + "]"
                    : " must be 0 without dynamic scaling"));
  }
  state_ = st;
  return Status::OK();
}

LossScalerState LossScaler::Fit(const LossScalerState& saved) const {
  const bool saved_dynamic = saved.hysteresis_left > 0;  // 0 unless written in kDynamic
  if (mode_ != LossScaleMode::kDynamic) {
    return !saved_dynamic && saved.scale == state_.scale ? saved : state_;
  }
  if (!saved_dynamic) return state_;
  LossScalerState st = saved;
  st.hysteresis_left = std::min(saved.hysteresis_left, hysteresis_);
  return st;
}

std::string LossScaler::Describe() const {
  switch (mode_) {
    case LossScaleMode::kNone:
      return "no loss scaling (scale 1)";
    case LossScaleMode::kStatic:
      return "static loss scale " + Num(state_.scale);
    case LossScaleMode::kDynamic:
      break;
  }
  const std::string hysteresis = no_hysteresis_
                                     ? "no hysteresis at stage 0"
                                     : "hysteresis " + std::to_string(state_.hysteresis_left) +
                                           "/" + std::to_string(hysteresis_) +
                                           (consecutive_hysteresis_ ? " consecutive" : "");
  return "dynamic loss scale " + Num(state_.scale) + " (window " + std::to_string(window_) + ", " +
         hysteresis + ", min " + Num(min_scale_) + ")";
}

}  // namespace strata::zero
