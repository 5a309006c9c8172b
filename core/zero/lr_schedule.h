// LrSchedule: the learning rate of each optimizer step, DeepSpeed 0.19.8's WarmupLR,
// WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest (runtime/lr_schedules.py) as pure
// functions of `t`, DeepSpeed's `last_batch_iteration`, and OneCycle's Adam betas. W = max(2,
// warmup_num_steps); gamma(t) = ln(t + 1) / ln(W) ("log") or t / W ("linear") while t < W.
// - WarmupLR: min_lr + (max_lr - min_lr) * (t < W ? gamma : 1).
// - WarmupDecayLR: as WarmupLR, after warmup gamma = max(0, (total - t) / max(1, total - W)).
// - WarmupCosineLR: lr * ratio; warmup ratio = warmup_min_ratio + gamma * (1 - warmup_min_ratio);
//   after it p = min(1, (t - W + 1) / max(1, total - W)),
//   ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi p)) / 2).
// - LRRangeTest: min_lr * (1 + step_rate * i), i = (t + 1) / step_size, floored when staircase.
// - OneCycle: T = first + second step sizes, r = first / T, b = t + 1, x = 1 + b / T -
//   floor(1 + b / T); scale = x / r while x <= r, else (x - 1) / (r - 1); with a stair count n
//   of the half-cycle, scale = floor(n * c / half) / n (c: b mod T, from the end in the second
//   half). While t < T: lr = min_lr + (max_lr - min_lr) * scale and, with cycle_momentum,
//   beta1 = max_mom - (max_mom - min_mom) * scale. After it (d = t - T + 1): lr = min_lr /
//   (1 + decay_lr_rate * d / decay_step_size), beta1 = max_mom * (1 + decay_mom_rate * d /
//   decay_step_size) (no decay when the rate or decay_step_size is 0). DeepSpeed writes the
//   betas as (beta1, 0.99): beta2 is 0.99 under cycle_momentum whatever optimizer.params says.
//   At t < 0 (its constructor) lr = min_lr and beta1 = min_mom (not max_mom).
//
// Which t an optimizer step uses (DeepSpeed 0.19.8):
// - Each scheduler's __init__ (last_batch_iteration = -1) writes get_lr() at t = -1 into the
//   optimizer and does not call step(): WarmupLR / WarmupDecayLR give warmup_min_lr there,
//   WarmupCosineLR gives 0 (not warmup_min_ratio * lr). The engine's _configure_lr_scheduler
//   only builds the scheduler.
// - engine._take_model_step calls lr_scheduler.step() (t += 1, lr = get_lr()) after
//   optimizer.step(), and only when the optimizer did not overflow (`if overflow:
//   skipped_steps += 1 else: ... lr_scheduler.step()`). A skipped step does not advance t.
// So the applied step that has `n` applied steps before it runs at t = n - 1
// (IterationForStep): the first at t = -1, the second at t = 0 (gamma 0: WarmupLR's first two
// steps both use warmup_min_lr), and a skipped step's retry reuses the same t. A checkpoint keeps
// last_batch_iteration and the optimizer's lr (the value at t = n - 1 for the next step), so `n`
// counts applied steps since the start of training, across resumes.
//
// Thread safety: an immutable value after FromConfig; LrAt may be called concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "strata/config.h"
#include "strata/status.h"

namespace strata::zero {

class LrSchedule {
 public:
  enum class Kind : uint8_t {
    kConstant,
    kWarmupLR,
    kWarmupDecayLR,
    kWarmupCosineLR,
    kOneCycle,
    kLRRangeTest
  };

  // scheduler.type none -> the constant optimizer.lr. Errors are kInvalidArgument naming the
  // JSON path: optimizer.lr "auto" (or absent); a scheduler.type DeepSpeed does not define
  // ("scheduler.type", with the supported ones); a parameter the scheduler's constructor does
  // not take (DeepSpeed: a TypeError), missing total_num_steps (WarmupDecayLR, WarmupCosineLR)
  // or cycle_min_lr / cycle_max_lr (OneCycle),
  // a value still "auto", not JSON, or of the wrong kind ("scheduler.params.<name>"):
  // warmup_num_steps a JSON integer >= 1 (DeepSpeed's own check), total_num_steps a number >= 0
  // (DeepSpeed computes with it in floats: 1e4 or epochs * len / gas), the lrs finite and >= 0, the
  // ratios finite, last_batch_iteration only -1 (another value makes DeepSpeed skip its initial lr;
  // resume from a checkpoint instead); OneCycle: cycle_first_step_size > 0, cycle_second_step_size
  // >= 0 (or null), the momenta in [0, 1) (Adam's betas), cycle_momentum a boolean; LRRangeTest:
  // lr_range_test_step_size a JSON integer >= 1, lr_range_test_staircase a boolean. A per-group
  // list is refused (one number). Defaults as DeepSpeed's constructors: warmup_min_lr 0;
  // warmup_max_lr optimizer.lr for WarmupLR but 0.001 for WarmupDecayLR; warmup_num_steps 1000;
  // warmup_type "log"; warmup_min_ratio 0; cos_min_ratio 1e-4; OneCycle's cycle_first_step_size
  // 2000, cycle_second_step_size = the first, stair counts 0 (the second = the first), decay rates
  // and decay_step_size 0, cycle_momentum true, cycle_min_mom 0.8, cycle_max_mom 0.9;
  // LRRangeTest's lr_range_test_min_lr 1e-3, step_size 2000, step_rate 1, staircase false.
  // Notes (notes()), as DeepSpeed's warnings: an unknown warmup_type falls back to "log";
  // total_num_steps < W; warmup_num_steps 1 runs as 2.
  static Result<LrSchedule> FromConfig(const EngineConfig& config);

  // DeepSpeed's last_batch_iteration for the applied (not skipped) optimizer step that has
  // `applied_steps` applied steps before it (see above): applied_steps - 1.
  static constexpr int64_t IterationForStep(int64_t applied_steps) { return applied_steps - 1; }

  // The lr at t = last_batch_iteration; any t < 0 is the value set before the first step.
  // `group_lr`: an optimizer group's own lr (DeepSpeed's param_groups[i]["lr"] when the
  // scheduler is made), which, as DeepSpeed's schedulers, the constant schedule keeps,
  // WarmupCosineLR scales and WarmupLR without warmup_max_lr warms up to; the other schedules
  // set every group to the same lr. nullopt: optimizer.lr's group.
  double LrAt(int64_t t, std::optional<double> group_lr = std::nullopt) const;
  // The lr of the applied step with `applied_steps` applied steps before it.
  double LrForStep(int64_t applied_steps, std::optional<double> group_lr = std::nullopt) const {
    return LrAt(IterationForStep(applied_steps), group_lr);
  }
  // OneCycle with cycle_momentum: Adam's (beta1, beta2) at t, which every optimizer group uses
  // (DeepSpeed writes them into every param group). nullopt: the schedule leaves the betas alone.
  std::optional<std::pair<double, double>> BetasAt(int64_t t) const;
  std::optional<std::pair<double, double>> BetasForStep(int64_t applied_steps) const {
    return BetasAt(IterationForStep(applied_steps));
  }

  // OK, or kInvalidArgument naming scheduler.params.decay_mom_rate when OneCycle's scheduled
  // beta1 for that step has grown to 1 or more (Adam needs beta1 < 1; DeepSpeed trains on).
  Status CheckBetasForStep(int64_t applied_steps) const;

  Kind kind() const { return kind_; }
  const std::vector<std::string>& notes() const { return notes_; }
  // "path: message" of what the config check warns about (a run that will fail part-way:
  // OneCycle's decay_mom_rate taking beta1 to 1 at a step it names); also in notes().
  const std::vector<std::string>& warnings() const { return warnings_; }
  // One line, e.g. "WarmupLR(min 0, max 0.001, 1000 steps, log)".
  std::string Describe() const;

 private:
  LrSchedule() = default;
  double WarmupGamma(int64_t t) const;  // REQUIRES: 0 <= t < W
  double CycleScale(int64_t t) const;   // OneCycle's scale factor; REQUIRES: t >= 0
  Status ReadOneCycle(const EngineConfig& config);
  Status ReadRangeTest(const EngineConfig& config);

  Kind kind_ = Kind::kConstant;
  double lr_ = 0;          // constant lr; WarmupCosineLR's base lr
  double min_lr_ = 0;      // WarmupLR / WarmupDecayLR
  double max_lr_ = 0;      // WarmupLR / WarmupDecayLR
  bool max_is_group_lr_ = false;  // WarmupLR without warmup_max_lr: each group's own lr
  int64_t warmup_ = 1000;  // W, after max(2, warmup_num_steps)
  double total_ = 0;  // WarmupDecayLR / WarmupCosineLR (a number: DeepSpeed computes in floats)
  bool log_warmup_ = true;
  double warmup_min_ratio_ = 0;
  double cos_min_ratio_ = 1e-4;
  // OneCycle (min_lr_ / max_lr_: cycle_min_lr / cycle_max_lr).
  double first_size_ = 2000, second_size_ = 2000, total_size_ = 4000, step_ratio_ = 0.5;
  double first_stairs_ = 0, second_stairs_ = 0;
  double decay_step_size_ = 0, decay_lr_rate_ = 0, decay_mom_rate_ = 0;
  bool skip_lr_decay_ = true, skip_mom_decay_ = true;
  bool cycle_momentum_ = true;
  double min_mom_ = 0.8, max_mom_ = 0.9;
  // LRRangeTest (min_lr_: lr_range_test_min_lr).
  int64_t range_step_size_ = 2000;
  double range_step_rate_ = 1.0;
  bool staircase_ = false;
  std::vector<std::string> notes_;
  std::vector<std::string> warnings_;
};

}  // namespace strata::zero
