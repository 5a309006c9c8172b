// LossScaler: the loss-scale policy of one training run, DeepSpeed 0.19.8's `DynamicLossScaler`
// (runtime/fp16/loss_scaler.py) reproduced exactly, plus its static scale and the "no scaling"
// of bf16 / fp32. Pure policy: the engine multiplies the loss by scale(), finds whether any
// rank's gradients hold an inf/NaN, skips the step if so, and reports the outcome to Update().
//
// Modes (from the config, as DeepSpeed's CreateLossScaler picks them):
// - kDynamic: fp16.enabled and fp16.loss_scale == 0. Starts at 2^initial_scale_power. On an
//   overflow, while hysteresis is left (hysteresis_left > 1 and fp16.hysteresis > 1) one unit of
//   it is spent and the scale stays; otherwise the scale halves, never below min_loss_scale. On a
//   good step, with consecutive_hysteresis the hysteresis is refilled; when
//   `stable = iteration - last_overflow_iteration - 1` is > 0 and a multiple of
//   loss_scale_window, the scale doubles (and, without consecutive_hysteresis, the hysteresis is
//   refilled). `iteration` counts every Update, skipped step or not.
//   At ZeRO stage 0 DeepSpeed runs fp16 through its FP16_Optimizer instead, whose dynamic scale
//   has no hysteresis (every overflow halves it) and stays at min_loss_scale where
//   DynamicLossScaler raises; the doubling rule is the same.
// - kStatic: fp16.enabled and fp16.loss_scale > 0: that scale, forever.
// - kNone: bf16 or fp32: scale 1, forever. DeepSpeed's ZeRO-3 checks bf16 gradients for
//   overflow not at all; strata's engine still skips a step with non-finite gradients, and
//   Update(true) then records it without changing the scale.
//
// Order of calls in DeepSpeed's ZeRO-3 step (stage3.py, `step` and
// `_overflow_check_and_loss_scale_update`): the overflow check, then update_scale, then, on a
// good step, `unscale_and_clip_grads`, which divides by `self.loss_scale` read AFTER the update.
// So on the good step where the scale doubles, DeepSpeed divides gradients made with scale S by
// 2S (and `_global_grad_norm` likewise). An engine matching DeepSpeed bit-for-bit reads scale()
// after Update(); one unscaling exactly reads it before.
//
// Thread safety: a plain value; external synchronization for shared use.
#pragma once

#include <cstdint>
#include <string>

#include "strata/config.h"
#include "strata/status.h"

namespace strata::zero {

// Everything a checkpoint must save to resume bit-for-bit.
struct LossScalerState {
  double scale = 1;
  int64_t iteration = 0;                 // Updates so far (DeepSpeed's cur_iter)
  int64_t last_overflow_iteration = -1;  // -1: none yet (DeepSpeed's last_overflow_iter)
  int64_t hysteresis_left = 0;           // DeepSpeed's cur_hysteresis; 0 unless kDynamic
  bool operator==(const LossScalerState&) const = default;
};

enum class LossScaleMode : uint8_t { kNone, kStatic, kDynamic };

class LossScaler {
 public:
  // fp16.enabled: dynamic unless fp16.loss_scale > 0 (static); otherwise (bf16/fp32) fixed 1.
  // kInvalidArgument naming the JSON path for what DeepSpeed would not run or is nonsense:
  // fp16.enabled still "auto"; fp16.loss_scale < 0 or not finite; in dynamic mode
  // fp16.loss_scale_window < 1, fp16.hysteresis < 1, fp16.min_loss_scale <= 0 or not finite,
  // fp16.initial_scale_power outside [0, 64] (DeepSpeed takes any power whose 2^p is finite;
  // a start scale below 1 or above 2^64 has no use with fp16, whose largest value is 65504).
  static Result<LossScaler> FromConfig(const EngineConfig& config);

  // The factor the loss is multiplied by before backward.
  double scale() const { return state_.scale; }
  bool dynamic() const { return mode_ == LossScaleMode::kDynamic; }
  LossScaleMode mode() const { return mode_; }

  // Records one optimizer step's outcome (call once per engine Step, skipped or not): DeepSpeed's
  // update_scale. `overflow`: some rank's gradients held an inf/NaN (ranks agree).
  // kFailedPrecondition (stages 1-3): an overflow that must halve the scale while it is already
  // exactly min_loss_scale. DeepSpeed (raise_error_at_min_scale, True for the scaler ZeRO-3 builds)
  // raises "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
  // there, before touching any state; so does this: the state is unchanged and the run should
  // stop (the step is skipped either way). Never fails in kStatic / kNone.
  Status Update(bool overflow);

  LossScalerState state() const { return state_; }
  // Resumes from a saved state. kInvalidArgument, state unchanged, when it cannot come from this
  // configuration: scale not finite and > 0 (or, kStatic / kNone, not the fixed scale);
  // iteration < 0; last_overflow_iteration outside [-1, iteration); hysteresis_left outside
  // [1, fp16.hysteresis] (kDynamic) or not 0 (otherwise).
  Status Restore(const LossScalerState& state);
  // A checkpoint's state as this configuration resumes it (call on a scaler fresh from the
  // config): the saved state where the same fp16 loss scaling could have written it; this
  // scaler's own initial state where the scaling changed between save and load (static and
  // dynamic, or another fixed scale), as the new config asks; a dynamic state with its
  // hysteresis_left capped at a smaller fp16.hysteresis. DeepSpeed keeps the saved scaler
  // whole, its old mode included.
  LossScalerState Fit(const LossScalerState& saved) const;

  // One line, e.g. "dynamic loss scale 65536 (window 1000, hysteresis 2/2, min 1)".
  std::string Describe() const;

 private:
  LossScaler() = default;

  LossScaleMode mode_ = LossScaleMode::kNone;
  bool no_hysteresis_ = false;  // stage 0: DeepSpeed's FP16_Optimizer
  int64_t window_ = 1000;
  int64_t hysteresis_ = 2;
  bool consecutive_hysteresis_ = false;
  double min_scale_ = 1;
  LossScalerState state_;
};

}  // namespace strata::zero
