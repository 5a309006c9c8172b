"""Where a GPU sat idle during one step, and what the host was doing meanwhile.

bench_gpu.py profiles one step after its timed ones (torch.profiler with CPU and CUDA activity:
a Kineto trace in Chrome's JSON format) and summarizes it with analyze():

  window_ms       from the first host or device event of the step to the last
  busy_ms         the union of the device's kernels, copies and memsets on every stream
  busy_fraction   busy_ms / window_ms (1.0: the GPU never waited for the host)
  idle_ms         the rest, split by what the host's threads (Python's, autograd's, the engine's)
                  were doing across each idle gap of at least min_gap_us: "wait:<call>" when one
                  blocking CUDA call (a stream or event synchronize, a synchronous copy) on any
                  thread covered at least half the gap, the host waiting; "host" otherwise, the
                  host late with the next work (Python, the engine's host side, a wait on a
                  completion callback); the shorter gaps together as "gaps under N us"
  gaps            the longest gaps: where (ms from the window's start), how long, the CUDA call
                  covering most of it and the innermost torch operator in progress (on any
                  thread, with its thread), and the device work that ended the gap

A step paced by the GPU has busy_fraction near 1; idle in "wait:*" names a synchronize to remove,
idle in "host" names host work to shorten or move off the critical path.
"""
import bisect
import gzip
import json
import os

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_API_CATS = frozenset({"cuda_runtime", "cuda_driver"})
HOST_OP_CATS = frozenset({"cpu_op", "user_annotation"})


def _blocking(name):
    """A CUDA API call in which the host waits for the device."""
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpy", "cudaMemcpy2D",
                                             "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2")


def _spans(events, cats):
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in cats:
            continue
        ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        out.append((ts, ts + max(dur, 0.0), str(e.get("name", "?")), e.get("tid")))
    out.sort()
    return out


def _union(spans):
    merged = []
    for s, e, *_ in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _overlap(a0, a1, b0, b1):
    return max(0.0, min(a1, b1) - max(a0, b0))


def _outermost(spans):
    """One thread's calls less those nested in another (a driver call inside a runtime call):
    disjoint, in time order."""
    out = []
    for sp in spans:
        if out and sp[1] <= out[-1][1]:
            continue
        out.append(sp)
    return out


class _Innermost:
    """The innermost of one thread's nested operators in progress at a time; queried with
    non-decreasing times (a sweep)."""

    def __init__(self, spans):
        self.spans, self.next, self.stack = spans, 0, []

    def at(self, t):
        while self.next < len(self.spans) and self.spans[self.next][0] <= t:
            sp = self.spans[self.next]
            while self.stack and self.stack[-1][1] < sp[0]:
                self.stack.pop()
            self.stack.append(sp)
            self.next += 1
        while self.stack and self.stack[-1][1] < t:
            self.stack.pop()
        return self.stack[-1] if self.stack else None


class _Calls:
    """One thread's outermost CUDA calls, for the call covering most of an interval."""

    def __init__(self, spans):
        self.calls = _outermost(spans)
        self.ends = [e for _, e, *_ in self.calls]

    def covering(self, g0, g1, blocking_only):
        best, covered = None, 0.0
        k = bisect.bisect_right(self.ends, g0)  # the calls that end after the gap starts
        while k < len(self.calls) and self.calls[k][0] < g1:
            c = _overlap(self.calls[k][0], self.calls[k][1], g0, g1)
            if c > covered and (not blocking_only or _blocking(self.calls[k][2])):
                best, covered = self.calls[k], c
            k += 1
        return best, covered


def _by_thread(spans):
    out = {}
    for sp in spans:
        out.setdefault(sp[3], []).append(sp)
    return out


def analyze(events, min_gap_us=20.0, top=8):
    """The summary above for a trace's events (Chrome trace "traceEvents"; times in us)."""
    device = _spans(events, DEVICE_CATS)
    ops = _spans(events, HOST_OP_CATS)
    apis = _spans(events, HOST_API_CATS)
    every = device + ops + apis
    if not every:
        return {"error": "the trace has no host or device events"}
    start = min(s for s, *_ in every)
    end = max(e for _, e, *_ in every)
    window = end - start
    out = {"window_ms": window / 1e3, "device_events": len(device)}
    if not device:
        out["note"] = "no device activity in the trace (a CPU run, or CUPTI unavailable)"
        return out
    busy = _union(device)
    busy_us = sum(e - s for s, e in busy)
    calls = [_Calls(v) for v in _by_thread(apis).values()]
    inner = [_Innermost(v) for v in _by_thread(ops).values()]
    starts = [s for s, *_ in device]

    gaps, idle_by, counted = [], {}, 0.0
    edges = [start] + [x for span in busy for x in span] + [end]
    for i in range(0, len(edges), 2):
        g0, g1 = edges[i], edges[i + 1]
        if g1 - g0 < min_gap_us:
            continue
        counted += g1 - g0
        wait, waited = max((c.covering(g0, g1, True) for c in calls), key=lambda r: r[1],
                           default=(None, 0.0))
        if wait is not None and waited >= 0.5 * (g1 - g0):
            call, kind = wait, f"wait:{wait[2]}"
        else:
            call = max((c.covering(g0, g1, False) for c in calls), key=lambda r: r[1],
                       default=(None, 0.0))[0]
            kind = "host"
        idle_by[kind] = idle_by.get(kind, 0.0) + (g1 - g0) / 1e3
        mid = (g0 + g1) / 2
        op = min((o for o in (t.at(mid) for t in inner) if o is not None),
                 key=lambda o: o[1] - o[0], default=None)
        j = bisect.bisect_left(starts, g1)
        gaps.append({"at_ms": (g0 - start) / 1e3, "idle_ms": (g1 - g0) / 1e3, "kind": kind,
                     "host_call": call[2] if call else None,
                     "host_call_thread": call[3] if call else None,
                     "host_op": op[2] if op else None, "host_op_thread": op[3] if op else None,
                     "next": device[j][2][:80] if j < len(device) else None})
    short = (window - busy_us) - counted
    if short > 0:
        idle_by[f"gaps under {min_gap_us:g} us"] = short / 1e3
    gaps.sort(key=lambda g: -g["idle_ms"])
    out.update({"busy_ms": busy_us / 1e3, "busy_fraction": busy_us / window if window else None,
                "idle_ms": (window - busy_us) / 1e3, "idle_gaps": len(gaps),
                "min_gap_us": min_gap_us,
                "idle_ms_by_host_state": dict(sorted(idle_by.items(), key=lambda kv: -kv[1])),
                "gaps": gaps[:top]})
    return out


def load_events(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def profile_step(step, cuda, trace_path=None, max_trace_bytes=8 << 20):
    """Runs step() once under torch.profiler and returns analyze() of its trace. With
    trace_path, the trace is also kept there gzipped when it compresses to max_trace_bytes."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "trace.json")
        prof.export_chrome_trace(raw)
        events = load_events(raw)
        out = analyze(events)
        if trace_path:
            with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
                dst.write(src.read())
            if os.path.getsize(trace_path) > max_trace_bytes:
                os.remove(trace_path)
                out["trace"] = f"not kept (over {max_trace_bytes >> 20} MiB gzipped)"
            else:
                out["trace"] = os.path.basename(trace_path)
    return out


def summary_line(t):
    """One line for the printed table."""
    if not isinstance(t, dict) or "busy_fraction" not in t:
        return None
    by = ", ".join(f"{k} {v:.1f}" for k, v in list(t["idle_ms_by_host_state"].items())[:3])
    return (f"timeline: GPU busy {t['busy_fraction']:.0%} of {t['window_ms']:.1f} ms; idle "
            f"{t['idle_ms']:.1f} ms in {t['idle_gaps']} gaps ({by or '-'})")
