"""The native module without torch: config checks, the planner, the raw Engine."""
import json

import numpy as np
import pytest

import strata


def test_check_config_reports_errors():
    r = strata.check_config({"zero_optimization": {"stage": 5}})
    assert not r["ok"]
    assert r["errors"][0]["path"] == "zero_optimization.stage"
    assert strata.check_config({"train_micro_batch_size_per_gpu": 1})["ok"]


def test_a_dict_configs_findings_name_the_key_not_a_line_of_text_the_user_never_saw(tmp_path):
    """The HF Trainer, accelerate and OpenRLHF pass dicts: their findings name the key's path
    only; a file's (and JSON text's) keep the line and column."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
           "sequence_parallel": 2}
    w = strata.check_config(cfg)["warnings"][0]
    assert w["path"] == "sequence_parallel" and w["line"] == 0
    assert w["text"].startswith("sequence_parallel: ") and "line" not in w["text"]
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(cfg, indent=1))
    w = strata.check_config(str(p))["warnings"][0]
    assert w["line"] > 1 and w["text"].startswith(f"sequence_parallel (line {w['line']}, ")


def test_check_config_file(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text('{"zero_optimization": {"stage": 3}, // a comment\n}')
    assert strata.check_config(str(p))["ok"]
    with pytest.raises(strata.StrataError, match="NotFound"):
        strata.check_config(str(tmp_path / "missing.json"))


def test_a_config_in_base64_reads_as_its_json(tmp_path):
    """DeepSpeed reads a config string that is neither JSON nor an existing file as base64 of
    JSON (launchers pass it that way on a command line); so do strata's readers. A missing file
    that is not base64 is still named."""
    import base64
    text = '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}'
    b64 = base64.urlsafe_b64encode(text.encode()).decode()
    assert strata.load_config(b64) == strata.load_config(text)
    assert strata.load_config(b64)["zero_optimization"]["stage"] == 2
    bad = base64.urlsafe_b64encode(b'{"zero_optimization": {"stage": 5}}').decode()
    assert strata.check_config(bad)["errors"][0]["path"] == "zero_optimization.stage"
    with pytest.raises(strata.StrataError, match="missing.json"):
        strata.check_config(str(tmp_path / "missing.json"))
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 4)
    cfg = base64.urlsafe_b64encode(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}).encode()).decode()
    engine = strata.initialize(model=model, config=cfg)[0]
    assert engine.zero_optimization_stage() == 2
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    assert engine.global_steps == 1
    engine.close()


def test_check_config_compares_nvme_paths_with_what_the_engine_writes(tmp_path):
    """check_here with params: the free space of the nvme_path against the planner's bytes for
    the configured setting, which are what the engine's swap file holds (each block rounded up
    to 4 KiB for O_DIRECT)."""
    nvme = str(tmp_path)
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                                 "offload_param": {"device": "nvme", "nvme_path": nvme}}}
    groups = [(f"l{i}", [("w", [256, 1000]), ("b", [1000])]) for i in range(4)]
    params = 4 * (256 * 1000 + 1000)
    r = strata.check_config(cfg, check_here=True, params=params)
    assert r["ok"] and not r["warnings"], r
    assert [p["key"] for p in r["nvme_paths"]] == ["zero_optimization.offload_optimizer.nvme_path",
                                                   "zero_optimization.offload_param.nvme_path"]
    held = [n for n in r["notes"] if " holds " in n]
    assert len(held) == 1, r["notes"]  # one directory for both
    need = int(held[0].split(" holds ")[1].split()[0])
    assert need == params * (12 + 2 + 2)  # optimizer state, bf16 gradient, bf16 params
    e = strata.Engine(groups, json.dumps(cfg))
    written = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    e.close()
    assert need <= written <= need + 4096 * 5 * len(groups), (need, written)
    # Less free than that (here: an impossible model size) is an error naming the key at one
    # rank (the run could not start), a warning at several (they may run on other machines).
    r = strata.check_config(cfg, check_here=True, params="1000T")
    assert not r["ok"]
    assert [e["path"] for e in r["errors"]] == ["zero_optimization.offload_optimizer.nvme_path"]
    assert "needs 16000000000000000 bytes" in r["errors"][0]["message"]
    r = strata.check_config(cfg, check_here=True, params="1000T", world_size=8)
    assert r["ok"]
    assert [w["path"] for w in r["warnings"]] == ["zero_optimization.offload_optimizer.nvme_path"]
    with pytest.raises(ValueError, match="check_here"):
        strata.check_config(cfg, params=params)


def test_plan():
    p = strata.plan("7B", {"zero_optimization": {"stage": 3}}, gpus=2)
    assert "ledger" in p and "ladder" in p
    assert "stage" in strata.plan(7e9, stage=3, text=True).lower()
    # A LoRA fine-tune of 7B: the frozen base at 2 B/param, the 40M adapters at 16 B/param, and
    # the speculative step's rollback copies at 14 B/param: of all the adapters, each rank's 5M
    # being below the default's floor (256 MiB of copies); of a quarter of 800M on 2 GPUs.
    lora = strata.plan("7B", stage=3, offload_optimizer="cpu", offload_param="cpu", gpus=8,
                       trainable="40M")
    assert lora["configured"]["host_bytes_per_node"] == 2 * 7e9 + 16 * 40e6 + 14 * 40e6
    big = strata.plan("7B", stage=3, offload_optimizer="cpu", offload_param="cpu", gpus=2,
                      trainable="800M")
    assert big["configured"]["host_bytes_per_node"] == 2 * 7e9 + 16 * 800e6 + 14 * 800e6 / 4


@pytest.mark.parametrize("call", ["init_from_fill", "init_from_rank0_fill"])
def test_a_fill_that_returns_the_wrong_thing_is_named(call):
    """A fill that returns no float32 array, or the wrong count of values, is an error naming the
    parameter and the range; a good fill then initialises the same engine, exactly."""
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3}}
    e = strata.Engine([("g", [("w", [2, 3]), ("b", [2])])], json.dumps(cfg))
    init = getattr(e, call)
    with pytest.raises(strata.StrataError,
                       match=r"fill returned NoneType for g\.w\[0:6\], not a contiguous "
                             r"float32 array of 6 values"):
        init(lambda g, p, b, end: None)
    with pytest.raises(strata.StrataError, match=r"fill returned 5 values for g\.w\[0:6\]"):
        init(lambda g, p, b, end: np.zeros(end - b - 1, np.float32))
    init(lambda g, p, b, end: np.arange(b, end, dtype=np.float32) + 10 * p)
    np.testing.assert_array_equal(e.read_master(0), [0, 1, 2, 3, 4, 5, 10, 11])
    e.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_rank0s_fill_that_raises_part_way_fails_every_rank_and_can_be_retried(stage, tmp_path):
    """Two ranks: rank 0's init_from_rank0_fill raises part way. Rank 0 raises its own error,
    rank 1 (whose fill is never called) the engine's saying rank 0's values failed, and neither
    hangs; a second call initialises both to rank 0's values."""
    from launch import launch
    outs = launch(tmp_path, "init_fill_worker.py", lambda r, nvme: [stage], 2, 20000, 120)
    res = []
    for rc, out in outs:
        assert rc == 0, out
        res.append(json.loads(out.strip().splitlines()[-1]))
    assert res[0]["first"] == "ValueError: the fill broke at its second range"
    assert res[1]["first"].startswith("StrataError: InvalidArgument: InitFromRank0: rank 0's "
                                      "values failed part way"), res[1]["first"]
    assert res[0]["calls"] == 2 and res[1]["calls"] == 0
    sizes = [(64 * 3, 64), (5,)]
    for r in res:
        for g, params in enumerate(sizes):
            want = np.concatenate([(np.arange(n, dtype=np.float32) + 1000 * (2 * g + p)) / 7
                                   for p, n in enumerate(params)])
            np.testing.assert_array_equal(np.asarray(r["master"][g], np.float32), want)


def test_raw_engine_zero_copy():
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3}}
    e = strata.Engine([("g", [("w", [2, 3]), ("b", [2])])], json.dumps(cfg))
    assert e.dtype == "float32" and e.num_groups == 1
    e.init_from_tensors([[np.arange(6, dtype=np.float32).reshape(2, 3),
                          np.zeros(2, np.float32)]])
    w, b = (np.from_dlpack(v) for v in e.gather(0))
    assert w.shape == (2, 3) and w[1, 2] == 5
    e.release(0)
    gw, gb = (np.from_dlpack(v) for v in e.grad_buffer(0))
    assert not gw.any()
    gw[:] = 1.0
    e.reduce_gradients(0)
    rep = e.step()
    assert rep["global_step"] == 1 and not rep["skipped"]
    m = e.read_master(0)
    np.testing.assert_allclose(m[:6], np.arange(6) - 0.1, rtol=1e-6)
    np.testing.assert_allclose(m[6:], 0, atol=0)
    with pytest.raises(IndexError):
        e.gather(3)
    e.close()
    with pytest.raises(strata.StrataError, match="closed"):
        e.step()
