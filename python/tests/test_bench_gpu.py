"""python/bench/bench_gpu.py, the GPU run's benchmark, on the CPU stand-in (--device cpu --tiny):
the script the prepared GPU run depends on runs every part, writes the JSON it documents (step
medians, ratios, the floor, io_efficiency, each run's phases and host waits) and reports a part that cannot run
(--deepspeed without DeepSpeed installed) as an error while the others still run."""
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "bench_gpu.py")


def test_every_part_runs_on_the_stand_in_and_writes_its_figures(tmp_path):
    out = tmp_path / "b.json"
    env = dict(os.environ, STRATA_BENCH_NVME_DIR=str(tmp_path))
    try:  # installed, as the bench's subprocess sees it (strata may stand in for it here)
        importlib.metadata.version("deepspeed")
        has_deepspeed = True
    except importlib.metadata.PackageNotFoundError:
        has_deepspeed = False
    r = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--tiny", "--deepspeed",
                        "--budget-s", "240", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    parts = res["parts"]
    assert set(parts) == {"fits_in_hbm", "zero_offload", "nvme"}
    fit = parts["fits_in_hbm"]
    for k in ("torch", "strata"):
        assert fit[k]["median_s"] > 0, fit[k]
        assert set(fit[k]["phases"]) == {"forward", "backward", "step"}
        assert all(v["host_s"] > 0 for v in fit[k]["phases"].values())
    assert fit["ratio_strata_over_torch"] == pytest.approx(
        fit["strata"]["median_s"] / fit["torch"]["median_s"])
    o = fit["strata"]["offload_states"]  # the states lent out and back, twice, after the steps
    assert 0 < o["freed_bytes"] <= o["device_bytes"], o
    assert len(o["offload_gb_s"]) == len(o["reload_gb_s"]) == 2 and min(o["offload_gb_s"]) > 0
    off = parts["zero_offload"]
    assert off["floor"]["floor_s"] > 0 and off["ratio_step_over_floor"] > 0
    # Each strata run says where its host waited per step: the engine's reductions and step
    # call (timed in every step), the adapter's GPU waits (none on the stand-in).
    for run in (fit["strata"], off["strata"], parts["nvme"]["strata"]):
        w = run["waits_per_step"]
        assert w["reduce_wait_s"] > 0 and w["step_s"] > 0, w
        assert w["adapter_device_waits"] == 0 and w["adapter_device_wait_s"] == 0, w
    assert "waits/step" in r.stdout
    nvme = parts["nvme"]
    moved = nvme["nvme_read_bytes_per_step"] + nvme["nvme_write_bytes_per_step"]
    if moved > 0:
        assert nvme["io_efficiency"] > 0, nvme
    else:  # the tiny model's NVMe-homed state stays cached in host memory: said, not divided
        assert nvme["io_efficiency"] is None and "cached" in nvme["io_efficiency_note"], nvme
    assert nvme["disk"]["write_bytes_per_s"] > 0 and nvme["disk"]["read_bytes_per_s"] > 0
    if has_deepspeed:
        assert fit["ratio_deepspeed_over_strata"] > 0
    else:  # reported, not fatal: the strata and torch figures above are all there
        assert "error" in fit["deepspeed"] and "error" in off["deepspeed"]
    assert "fits_in_hbm" in r.stdout and "wrote" in r.stdout
    # One profiled step per run asked for; on the stand-in its trace has no device activity.
    for run in (fit["torch"], fit["strata"], off["strata"]):
        t = run["timeline"]
        assert t["device_events"] == 0 and "no device activity" in t["note"], t
        assert t["window_ms"] > 0, t


def test_zero_offload_takes_the_speculative_step_choice(tmp_path):
    """--offload-speculative-step on reaches the engine beside overlap_step (a config the engine
    accepts and runs), and the JSON says which was run."""
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--tiny", "--parts",
                        "zero_offload", "--offload-speculative-step", "on", "--no-timeline",
                        "--budget-s", "120", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    off = json.loads(out.read_text())["parts"]["zero_offload"]
    assert "overlap_step=True, speculative_step=on" in off["strata_config"], off
    assert off["strata"]["median_s"] > 0 and "timeline" not in off["strata"], off["strata"]
    assert "speculative_optimizer_s" in off["strata"]["waits_per_step"], off["strata"]


def test_offload_sizing_takes_the_host_state_from_the_planner():
    """zero_offload's largest model is chosen by the engine's host state as strata.plan resolves
    it (bf16 ZeRO-Offload on one GPU: fp32 master, m and v and the gradient kept in bf16, 14 bytes
    per parameter; 16 with gradient accumulation, where the gradient is fp32; no speculative
    room), not a guess: ~7B runs where 123 GiB is available (the GPU machine) and not where 96."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    GiB = 2**30
    n = bench.param_count(bench.PRESETS["7b"], 32000)
    assert 6.5e9 < n < 7e9
    for stage in (2, 3):
        need = bench.offload_host_bytes(n, bench.ds_config(1, stage, "cpu"))
        assert need == pytest.approx(14 * n, rel=1e-3), stage
        cfg = bench.ds_config(1, stage, "cpu")
        cfg["gradient_accumulation_steps"] = 2
        assert bench.offload_host_bytes(n, cfg) == pytest.approx(16 * n, rel=1e-3), stage
    assert bench.host_refusal("7b", need, 123 * GiB) is None
    why = bench.host_refusal("7b", need, 96 * GiB)
    assert why is not None and "strata.plan" in why and "96 GiB" in why


def test_offload_sizing_keeps_torchs_reference_within_the_gpu():
    """zero_offload's torch fwd+bwd reference must fit the GPU too: at micro-batch 8 x 1024
    tokens 7B fits an H200 (about 140 GiB) and not an 80 GB H100, where 4B is the largest."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    GiB = 2**30
    h200, h100 = 140 * GiB, 79 * GiB

    def refusal(name, total):
        shape = bench.PRESETS[name]
        n = bench.param_count(shape, 32000)
        return bench.device_refusal(name, bench.fwd_bwd_device_bytes(shape, n, 8 * 1024, 32000),
                                    total)

    assert refusal("7b", h200) is None
    why = refusal("7b", h100)
    assert why is not None and "79 GiB" in why
    assert refusal("4b", h100) is None
    assert refusal("7b", None) is None  # no GPU: the host stand-in is not sized by it


def _timeline():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "gpu_timeline", os.path.join(os.path.dirname(BENCH), "gpu_timeline.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(cat, name, ts, dur, tid):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_timeline_splits_the_gpus_idle_time_by_what_the_host_did():
    """gpu_timeline.analyze on a trace built by hand (times in us): the busy time is the union
    of kernels, copies and memsets on every stream; an idle gap that a blocking CUDA call covers
    for at least half is a wait, whichever thread made it (here Python's, while the autograd
    thread ran more operators), else the host's, with the innermost operator in progress on any
    thread; gaps under the threshold are counted apart, so the parts add up to the idle time."""
    tl = _timeline()
    py, ag = 1, 2  # Python's thread and autograd's (which runs the most operators)
    ev = [
        _x("cpu_op", "aten::linear", 0, 40, py),
        _x("cpu_op", "aten::mm", 5, 10, py),
        _x("cuda_runtime", "cudaLaunchKernel", 6, 2, py),
        _x("cuda_runtime", "cudaStreamSynchronize", 150, 100, py),  # most of the third gap
        _x("cuda_driver", "cuStreamSynchronize", 151, 98, py),      # nested in it
        _x("cpu_op", "aten::copy_", 60, 60, ag),  # the host busy through the second gap
        _x("cuda_runtime", "cudaLaunchKernel", 110, 1, ag),
        _x("cpu_op", "aten::mul", 255, 3, ag),
        _x("cpu_op", "aten::mul", 260, 2, ag),
        _x("cpu_op", "aten::mul", 265, 3, ag),
        # device: two streams overlapping (25-70), 120-130, 250-270, 275-280
        _x("kernel", "gemm", 25, 35, 7),
        _x("gpu_memcpy", "Memcpy HtoD", 40, 30, 8),
        _x("kernel", "copy_kernel", 120, 10, 7),
        _x("gpu_memset", "Memset", 250, 20, 8),
        _x("kernel", "tail", 275, 5, 7),  # after a 5 us gap: under the threshold
    ]
    t = tl.analyze(ev, min_gap_us=20.0, top=8)
    assert t["window_ms"] == pytest.approx(0.280)
    assert t["busy_ms"] == pytest.approx(0.080)
    assert t["busy_fraction"] == pytest.approx(80 / 280)
    assert t["idle_ms"] == pytest.approx(0.200)
    # idle gaps >= 20 us: 0-25 (the host before its first launch), 70-120, 130-250
    assert t["idle_gaps"] == 3
    wait, late, first = t["gaps"]
    assert [g["idle_ms"] for g in t["gaps"]] == pytest.approx([0.120, 0.050, 0.025])
    assert wait["kind"] == "wait:cudaStreamSynchronize" and wait["next"] == "Memset"
    assert wait["host_call_thread"] == py
    assert wait["at_ms"] == pytest.approx(0.130) and wait["host_op"] is None
    assert late["kind"] == "host" and late["host_op"] == "aten::copy_"
    assert late["host_op_thread"] == ag and late["host_call"] == "cudaLaunchKernel"
    assert late["next"] == "copy_kernel"
    assert first["kind"] == "host" and first["at_ms"] == 0 and first["host_op"] == "aten::mm"
    assert first["host_call"] == "cudaLaunchKernel" and first["host_call_thread"] == py
    by = t["idle_ms_by_host_state"]
    assert by == pytest.approx({"wait:cudaStreamSynchronize": 0.120, "host": 0.075,
                                "gaps under 20 us": 0.005})
    assert list(by) == ["wait:cudaStreamSynchronize", "host", "gaps under 20 us"]
    assert sum(by.values()) == pytest.approx(t["idle_ms"])
    assert "GPU busy 29%" in tl.summary_line(t)


def test_timeline_of_a_trace_without_device_events_says_so():
    tl = _timeline()
    t = tl.analyze([_x("cpu_op", "aten::mm", 0, 10, 1)])
    assert t["device_events"] == 0 and "no device activity" in t["note"]
    assert tl.summary_line(t) is None
    assert "error" in tl.analyze([])
