// SpeculationGovernor: whether the speculative step (offload_optimizer.speculative_step) runs
// in the next step, from the step times it is fed. A pure policy: the engine measures each
// step (from one Step's return to the next) and feeds it; the governor says what the next step
// does. No clock, no threads.
//
// The speculation is exact either way (the same bits), so the choice is speed alone, and which
// mode is faster depends on the machine and the model: the speculated Adam runs beside the
// backward, on the cores a CPU-side trainer computes on too. With 30 ms of backward per layer
// it hides the optimizer (bench engine, 200M params, optimizer on cpu: 1.12 s -> 1.01 s per
// step); with 5 ms it slows the step (0.30 s -> 0.43 s), and a run whose every step clips
// undoes every speculation. A fixed mode (the key given) never changes. Adaptive (the key
// unset):
//   warm-up: `warmup` steps speculating (the first steps fill caches, open files; not measured);
//   probe:   `probe` steps each way, alternating (off first), so a drift in the step time falls
//            on both; the mode with the lower median wins (ties: on);
//   settled: `settle` steps in the chosen mode, then another probe (the load or the clipping
//            rate may have changed).
// Every rank feeds the same step times of the same step indices (the collectives keep ranks in
// step), so the ranks probe alike and, but for a tie within noise, choose alike; a rank that
// chooses otherwise costs time, never bits.
//
// Thread safety: none; the engine's trainer thread owns it.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace strata::sched {

class SpeculationGovernor {
 public:
  struct Options {
    int warmup = 2;
    int probe = 3;     // steps each way
    int settle = 500;  // steps between probes
  };
  enum class Phase : uint8_t { kFixed, kWarmup, kProbe, kSettled };
  // What the probes measured, for the stats and the notes (medians in seconds; 0 before any).
  struct Verdict {
    int probes = 0;  // probes completed
    double on_s = 0, off_s = 0;
  };

  // `configured`: the key's value (fixed), or nullopt (adaptive).
  explicit SpeculationGovernor(std::optional<bool> configured)
      : SpeculationGovernor(configured, Options{}) {}
  SpeculationGovernor(std::optional<bool> configured, const Options& options);

  // Whether the next step speculates.
  bool Speculate() const { return speculate_; }
  // The step that ran as Speculate() said took `seconds`.
  void OnStep(double seconds);

  Phase phase() const { return phase_; }
  const Verdict& verdict() const { return verdict_; }

 private:
  void StartProbe();
  void Decide();

  Options options_;
  Phase phase_;
  bool speculate_;
  int left_ = 0;  // steps left in this phase
  std::vector<double> on_, off_;
  Verdict verdict_;
};

}  // namespace strata::sched
