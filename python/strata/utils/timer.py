"""As deepspeed.utils.timer: the wall-clock timers DeepSpeed's engine keeps (engine.timers) and
scripts use for their own phases, and the throughput timer (engine.tput_timer).

SynchronizedWallClockTimer()("name").start() / .stop() accumulate intervals; elapsed(reset)
sums them in milliseconds, mean() takes their 10 % trimmed mean. On a GPU the intervals are CUDA
events on the current stream (read when elapsed() is asked, as DeepSpeed's), on the CPU the host
clock. With the config's "wall_clock_breakdown" the engine times its forward, backward (the
autograd pass, "bwd_inner", and the gradient reduction, "bwd_allreduce") and step under
DeepSpeed's timer names and logs them on rank 0, as DeepSpeed's engine does; without it
engine.timers records nothing the engine does, and a script's own timers still work.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6


def trim_mean(data, trim_percent: float) -> float:
    """The mean of `data` without the `trim_percent` smallest and largest values (0 when
    empty), as DeepSpeed's."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_mean: trim_percent {trim_percent} is not within [0, 1]")
    if not data:
        return 0
    data = sorted(data)
    n = len(data)
    k = int(round(n * trim_percent))
    kept = data[k:n - k]
    return sum(kept) / len(kept) if kept else 0


class SynchronizedWallClockTimer:
    """A group of named timers (DeepSpeed's, from Megatron): timers(name) makes or finds one.
    use_host_timer: the host clock (None: when no GPU is present); else CUDA events."""

    class Timer:
        def __init__(self, name: str, use_host_timer: bool):
            self.name_ = name
            self.started_ = False
            self.use_host_timer = use_host_timer
            self.event_timers = []  # seconds (host) or (start, end) CUDA events
            self.elapsed_records = None
            self.start_time = 0.0
            self.start_event = None

        def start(self) -> None:
            if self.started_:
                raise RuntimeError(f"{self.name_} timer has already been started")
            if self.use_host_timer:
                self.start_time = time.time()
            else:
                self.start_event = torch.cuda.Event(enable_timing=True)
                self.start_event.record()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            if not self.started_:
                raise RuntimeError(f"{self.name_} timer is not started")
            if self.use_host_timer:
                self.event_timers.append(time.time() - self.start_time)
            else:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.event_timers.append((self.start_event, end))
                self.start_event = None
            self.started_ = False

        def _get_elapsed_msec(self) -> float:
            if self.use_host_timer:
                self.elapsed_records = [s * 1000.0 for s in self.event_timers]
            else:
                records = []
                for start, end in self.event_timers:
                    end.synchronize()
                    records.append(start.elapsed_time(end))
                self.elapsed_records = records
            return sum(self.elapsed_records)

        def reset(self) -> None:
            self.started_ = False
            self.start_event = None
            self.elapsed_records = None
            self.event_timers.clear()

        def elapsed(self, reset: bool = True) -> float:
            """The recorded intervals' sum in milliseconds (a running one is closed and
            reopened); `reset` clears them."""
            started = self.started_
            if started:
                self.stop()
            elapsed = self._get_elapsed_msec()
            if reset:
                self.reset()
            if started:
                self.start()
            return elapsed

        def mean(self) -> float:
            self.elapsed(reset=False)
            return trim_mean(self.elapsed_records, 0.1)

    def __init__(self, use_host_timer: Optional[bool] = None):
        self.timers = {}
        self._use_host_timer = (not torch.cuda.is_available()) if use_host_timer is None \
            else bool(use_host_timer)

    def get_timers(self) -> dict:
        return self.timers

    def __call__(self, name: str) -> "SynchronizedWallClockTimer.Timer":
        if name not in self.timers:
            self.timers[name] = self.Timer(name, self._use_host_timer)
        return self.timers[name]

    @staticmethod
    def memory_usage() -> str:
        if not torch.cuda.is_available():
            return ""
        gib = 1024 ** 3
        return (f" | mem_allocated: {torch.cuda.memory_allocated() / gib:.4f} GB"
                f" | max_mem_allocated: {torch.cuda.max_memory_allocated() / gib:.4f} GB"
                f" | cache_allocated: {torch.cuda.memory_reserved() / gib:.4f} GB"
                f" | max_cache_allocated: {torch.cuda.max_memory_reserved() / gib:.4f} GB")

    def _line(self, names, normalizer: float, reset: bool, memory_breakdown: bool) -> str:
        if normalizer <= 0.0:
            raise ValueError(f"timers.log: normalizer {normalizer} is not positive")
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                line += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        if memory_breakdown:
            line += self.memory_usage()
        return line

    def log(self, names, normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool = False, ranks=None) -> None:
        """Prints "time (ms) | name: ms | ..." on `ranks` (default rank 0), as DeepSpeed's."""
        from . import print_dist
        print_dist(self._line(names, normalizer, reset, memory_breakdown), ranks=ranks or [0])

    def get_mean(self, names, normalizer: float = 1.0, reset: bool = True) -> dict:
        """{name: trimmed mean of its intervals, x1000 / normalizer}, as DeepSpeed's (whose
        mean is of milliseconds: the values it returns are microseconds)."""
        if normalizer <= 0.0:
            raise ValueError(f"timers.get_mean: normalizer {normalizer} is not positive")
        return {name: self.timers[name].mean() * 1000.0 / normalizer
                for name in names if name in self.timers}


class NoopTimer:
    """DeepSpeed's stand-in for SynchronizedWallClockTimer when timing is off."""

    class Timer:
        def start(self) -> None:
            pass

        def reset(self) -> None:
            pass

        def stop(self, **kwargs) -> None:
            pass

        def elapsed(self, **kwargs) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self):
        self.timer = self.Timer()

    def __call__(self, name: str) -> "NoopTimer.Timer":
        return self.timer

    def get_timers(self) -> dict:
        return {}

    def log(self, names, normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool = False, ranks=None) -> None:
        pass

    def get_mean(self, names, normalizer: float = 1.0, reset: bool = True) -> dict:
        return {}


class EngineTimers:
    """The timer names the engine starts and stops in each phase (DeepSpeed's EngineTimers):
    the micro-step ones, logged at every step(), and the global ones, logged at each
    accumulation boundary."""

    def __init__(self, enable_micro_timers: bool, enable_global_timers: bool):
        self.forward_timers, self.backward_timers = [], []
        self.backward_inner_timers, self.backward_reduce_timers = [], []
        self.step_timers, self.global_timers, self.micro_timers = [], [], []
        for enabled, names, kept in (
                (enable_micro_timers, (FORWARD_MICRO_TIMER, BACKWARD_MICRO_TIMER,
                                       BACKWARD_INNER_MICRO_TIMER, BACKWARD_REDUCE_MICRO_TIMER,
                                       STEP_MICRO_TIMER), self.micro_timers),
                (enable_global_timers, (FORWARD_GLOBAL_TIMER, BACKWARD_GLOBAL_TIMER,
                                        BACKWARD_INNER_GLOBAL_TIMER,
                                        BACKWARD_REDUCE_GLOBAL_TIMER, STEP_GLOBAL_TIMER),
                 self.global_timers)):
            if not enabled:
                continue
            fwd, bwd, inner, reduce, step = names
            self.forward_timers.append(fwd)
            self.backward_timers.append(bwd)
            self.backward_inner_timers.append(inner)
            self.backward_reduce_timers.append(reduce)
            self.step_timers.append(step)
            kept.extend(names)

    def active_timers(self) -> list:
        return self.micro_timers + self.global_timers


class ThroughputTimer:
    """engine.tput_timer, DeepSpeed's ThroughputTimer as its scripts read it: started by each
    training forward, stopped by each engine.step() (global_step at the accumulation boundary),
    timing from the `start_step`-th global step on; epoch_count / micro_step_count /
    global_step_count, update_epoch_count(), avg_samples_per_sec() (batch_size, the
    train_batch_size, per second of timed steps; -inf before the first step). It does not
    synchronize the GPU: the engine's step has waited for the device's work when it returns."""

    def __init__(self, batch_size: int, start_step: int = 2, clock: Callable[[], float] = time.time):
        self.batch_size = batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.started = False
        self.start_time = 0.0
        self._clock = clock

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._clock()

    def stop(self, global_step: bool = False) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.total_elapsed_time += self._clock() - self.start_time
            self.start_time = 0.0

    def avg_samples_per_sec(self) -> float:
        timed = self.global_step_count - self.start_step
        if self.global_step_count <= 0 or timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)
