"""python/bench/bench_gpu.py, the GPU run's benchmark, on the CPU stand-in (--device cpu --tiny):
the script the prepared GPU run depends on runs every part, writes the JSON it documents (step
medians, ratios, the floor, io_efficiency, each run's phases and host waits) and reports a part that cannot run
(--deepspeed without DeepSpeed installed) as an error while the others still run."""
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
    try:
        import deepspeed  # noqa: F401
        has_deepspeed = True
    except Exception:  # noqa: BLE001 - any import failure means "not installed here"
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


def test_offload_sizing_takes_the_host_state_from_the_planner():
    """zero_offload's largest model is chosen by the engine's host state as strata.plan resolves
    it (bf16 ZeRO-Offload: fp32 master, m, v and grads, 16 bytes per parameter, no speculative
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
        assert need == pytest.approx(16 * n, rel=1e-3), stage
    assert bench.host_refusal("7b", need, 123 * GiB) is None
    why = bench.host_refusal("7b", need, 96 * GiB)
    assert why is not None and "strata.plan" in why and "96 GiB" in why
