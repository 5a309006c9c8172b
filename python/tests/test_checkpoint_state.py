"""What save_checkpoint keeps besides the engine's state: the module's persistent buffers
(BatchNorm running statistics; across a reshard 2 -> 1 and 1 -> 2 ranks) and client_state, read
back without unpickling code (torch.load(weights_only=True)): a crafted blob does not run."""
import os
import pickle

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from launch import launch  # noqa: E402
from models import batch, ds_config, make_model  # noqa: E402

BN_STATS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def _train(engine, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        loss = engine(*batch("bn", step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_buffers_and_client_state_round_trip_and_resume_exactly(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model = make_model("bn")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3))
    _train(engine, 2)
    client = {"pos": 2, "name": "run-a", "lr": 0.5, "t": torch.arange(4.0),
              "nested": {"a": [1, 2.5, "x", None], "b": (True, torch.ones(2, dtype=torch.int64))}}
    engine.save_checkpoint(tmp_path / "ckpt", client_state=client)
    saved = {n: b.clone() for n, b in model.state_dict().items() if n in BN_STATS}
    assert saved["bn.num_batches_tracked"] == 2
    tail = _train(engine, 2, first=2)
    # save_16bit_model keeps the buffers (state_dict's names and values)
    engine.save_16bit_model(tmp_path / "out", "model.safetensors")
    exported = safetensors.load_file(str(tmp_path / "out" / "model.safetensors"))
    for n in BN_STATS:
        assert torch.equal(exported[n], model.state_dict()[n]), n
    assert "scratch" not in exported
    engine.close()

    model2 = make_model("bn")
    resumed, _, _, _ = strata.initialize(model=model2, config=ds_config(3))
    _, got = resumed.load_checkpoint(tmp_path / "ckpt")
    assert got.keys() == client.keys()
    assert (got["pos"], got["name"], got["lr"]) == (2, "run-a", 0.5)
    assert torch.equal(got["t"], client["t"]) and got["nested"]["a"] == [1, 2.5, "x", None]
    assert got["nested"]["b"][0] is True
    assert torch.equal(got["nested"]["b"][1], torch.ones(2, dtype=torch.int64))
    for n in BN_STATS:
        assert torch.equal(model2.state_dict()[n], saved[n]), n
    assert _train(resumed, 2, first=2) == tail  # bit for bit, running statistics included
    resumed.close()


def test_buffers_mismatch_is_refused_unless_not_strict(tmp_path):
    engine, _, _, _ = strata.initialize(model=make_model("bn"), config=ds_config(2))
    _train(engine, 1)
    engine.save_checkpoint(tmp_path)
    model = make_model("bn")
    model.bn.register_buffer("extra", torch.zeros(1))
    other, _, _, _ = strata.initialize(model=model, config=ds_config(2))
    with pytest.raises(RuntimeError, match=r"missing: \['bn.extra'\]"):
        other.load_checkpoint(tmp_path)
    other.load_checkpoint(tmp_path, load_module_strict=False)
    assert model.bn.num_batches_tracked == 1
    engine.close()
    other.close()


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("fmt", ["pickle", "torch.save"])
def test_crafted_client_state_does_not_run(tmp_path, fmt):
    """A checkpoint whose client state blob would call os.system when unpickled: load refuses it
    naming the checkpoint, and the command never runs."""
    marker = tmp_path / "pwned"
    payload = {"client_state": {"x": _Evil(marker)}, "micro_steps": 0}
    if fmt == "pickle":
        blob = pickle.dumps(payload)  # what strata wrote before (pickle.dumps)
    else:
        import io
        buf = io.BytesIO()
        torch.save(payload, buf)
        blob = buf.getvalue()
    # stage 3: nothing gathered outside forward, so the native save (any bytes) is allowed
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(3))
    engine._engine.save(str(tmp_path / "ckpt"), "evil", blob)
    with pytest.raises(RuntimeError, match=r"client state of checkpoint .*evil was not loaded"):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()
    # and save_checkpoint refuses to write what load would refuse, before writing anything
    with pytest.raises(ValueError, match=r"client_state\['x'\] \(posix.system\)"):
        engine.save_checkpoint(tmp_path / "ckpt2", client_state={"x": _Evil(marker), "ok": 1})
    assert not marker.exists() and not (tmp_path / "ckpt2").exists()
    # What training loops keep there (Megatron-style): each named, with the way to store it.
    import argparse
    import numpy as np
    with pytest.raises(ValueError, match=r"client_state\['np_rng'\] \(numpy\S*\), "
                                         r"client_state\['args'\] \(argparse.Namespace\).*"
                                         r"vars\(args\).*nothing was written"):
        engine.save_checkpoint(tmp_path / "ckpt2", client_state={
            "np_rng": np.random.get_state(), "args": argparse.Namespace(lr=1), "step": 3})
    assert not (tmp_path / "ckpt2").exists()
    engine.close()


def test_client_state_of_an_older_pickle_blob_still_loads(tmp_path):
    """A blob strata wrote with pickle.dumps (plain containers, numbers, strings) is read by an
    unpickler that resolves no global."""
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(3))
    state = {"client_state": {"pos": 7, "tag": "a"}, "micro_steps": 0, "global_samples": 0}
    engine._engine.save(str(tmp_path), "old", pickle.dumps(state))
    _, client = engine.load_checkpoint(tmp_path)
    assert client == {"pos": 7, "tag": "a"}
    engine.close()


def test_buffers_survive_a_reshard_1_to_2_to_1(tmp_path):
    """Saved on one rank, loaded on two (stage 3): both get the saved running statistics, master
    weights and client_state; the two train on (their statistics differ) and save: one rank loads
    rank 0's statistics and the same master weights."""
    def state(model, engine, client):
        return {"buffers": {n: b.clone() for n, b in model.named_buffers()},
                "master": engine.read_master(), "client": client}

    def same(got, want):
        for n in BN_STATS:
            assert torch.equal(got["buffers"][n], want["buffers"][n]), n
        for n, m in want["master"].items():
            assert torch.equal(got["master"][n], m), n

    model = make_model("bn")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3))
    _train(engine, 2)
    engine.save_checkpoint(tmp_path / "one", client_state={"pos": 2, "t": torch.arange(3)})
    one = state(model, engine, None)
    engine.close()
    outs = launch(tmp_path, "ckpt_worker.py",
                  lambda r, nvme: [tmp_path / "one", tmp_path / "two", tmp_path / "out", 2])
    for rc, text in outs:
        assert rc == 0, text
    ranks = [torch.load(tmp_path / f"out.{w}.rank{r}.pt") for w in ("loaded", "saved")
             for r in range(2)]
    for got in ranks[:2]:
        same(got, one)
        assert got["client"]["pos"] == 2 and torch.equal(got["client"]["t"], torch.arange(3))
    assert not torch.equal(ranks[2]["buffers"]["bn.running_mean"],
                           ranks[3]["buffers"]["bn.running_mean"])  # each rank's own batches
    model = make_model("bn")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3))
    _, client = engine.load_checkpoint(tmp_path / "two")
    same(state(model, engine, client), ranks[2])  # rank 0's
    assert client["pos"] == 2
    engine.close()
    from strata.utils import get_fp32_state_dict_from_zero_checkpoint
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "two")  # saved on 2 ranks
    assert set(sd) == set(model.state_dict())
    same({"buffers": sd, "master": {n: sd[n] for n in ranks[2]["master"]}}, ranks[2])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fp32_state_dict_and_load_module_only(tmp_path, dtype):
    """strata.utils.get_fp32_state_dict_from_zero_checkpoint gives state_dict's names (the tied
    head as the same tensor) with the fp32 masters; load_checkpoint(load_module_only=True) starts
    from those weights with a fresh optimizer and schedule: the same bits as an engine built
    from a model holding them (load_state_dict_from_zero_checkpoint)."""
    from strata.utils import (get_fp32_state_dict_from_zero_checkpoint,
                              load_state_dict_from_zero_checkpoint)
    model = make_model("gpt")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(2, "cpu", dtype=dtype))
    for step in range(2):
        loss = engine(*batch("gpt", step))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(tmp_path, client_state={"pos": 2})
    master = engine.read_master()
    names = set(model.state_dict())
    engine.close()
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert set(sd) == names and sd["head.weight"] is sd["wte.weight"]
    for n, m in master.items():
        assert sd[n].dtype == torch.float32 and torch.equal(sd[n], m), n

    def one_step(engine):
        loss = engine(*batch("gpt", 5))
        engine.backward(loss)
        engine.step()
        out = (loss.item(), engine.read_master(), engine.get_lr())
        engine.close()
        return out
    cfg = ds_config(3, dtype=dtype)
    fine, _, _, _ = strata.initialize(model=make_model("gpt", seed=1), config=cfg)
    path, client = fine.load_checkpoint(tmp_path, load_module_only=True)
    assert client == {"pos": 2} and fine.global_steps == 0
    for n, m in fine.read_master().items():
        assert torch.equal(m, master[n]), n
    ref, _, _, _ = strata.initialize(
        model=load_state_dict_from_zero_checkpoint(make_model("gpt", seed=1), tmp_path), config=cfg)
    got, want = one_step(fine), one_step(ref)
    assert got[0] == want[0] and got[2] == want[2]
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n


def test_load_module_only_after_a_step_is_refused(tmp_path):
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(3))
    loss = engine(*batch("mlp", 0))
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(tmp_path)
    with pytest.raises(strata.StrataError, match="already taken steps"):
        engine.load_checkpoint(tmp_path, load_module_only=True)
    engine.close()


def test_load_module_only_non_strict_refuses_another_shape_and_counts_what_it_skips(tmp_path,
                                                                                    caplog):
    """load_module_strict=False skips names, as torch's load_state_dict(strict=False): a
    parameter of another shape (a head resized after the save) is a size-mismatch error naming
    it, where it was left at its random start without a word; names it skips are counted in a
    warning."""
    def net(out, extra=False):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, out))
        if extra:
            m.add_module("2", torch.nn.Linear(out, 2))
        return m
    saved, _, _, _ = strata.initialize(model=net(2), config=ds_config(3))
    saved.save_checkpoint(tmp_path)
    saved.close()
    resized, _, _, _ = strata.initialize(model=net(3), config=ds_config(3))
    with pytest.raises(RuntimeError, match=r"size mismatch for 1.weight: \[2, 8\] in the "
                                           r"checkpoint, \[3, 8\] in the model"):
        resized.load_checkpoint(tmp_path, load_module_only=True, load_module_strict=False)
    resized.close()
    grown, _, _, _ = strata.initialize(model=net(2, extra=True), config=ds_config(3))
    with caplog.at_level("WARNING", logger="strata"):
        grown.load_checkpoint(tmp_path, load_module_only=True, load_module_strict=False)
    assert "loaded 4 of the model's 6 parameter(s); 2 not in the checkpoint" in caplog.text
    grown.close()


def test_param_groups_listed_in_another_order_are_named_at_load(tmp_path):
    """A module whose weight and bias sit in two optimizer param groups is two engine groups;
    a resume that lists the param_groups the other way round is refused (as torch's and
    DeepSpeed's optimizer loads refuse it), naming the param_groups order as the likely cause,
    where the error spoke only of a group ordering its parameters otherwise."""
    from models import decay_groups
    model = make_model("gpt")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(2),
                                        model_parameters=decay_groups(model))
    engine.save_checkpoint(tmp_path)
    engine.close()
    model = make_model("gpt")
    swapped = decay_groups(model)[::-1]
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(2),
                                        model_parameters=swapped)
    with pytest.raises(strata.StrataError, match="orders its parameters otherwise.*list its "
                                                 "param_groups in another order"):
        engine.load_checkpoint(tmp_path)
    engine.close()


def torch_steps(model, opt, steps, first):
    for step in range(first, first + steps):
        opt.zero_grad()
        model(*batch("mlp", step)).backward()
        opt.step()


@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (3, "nvme")])
def test_fine_tune_resumed_with_fresh_optimizer_state_matches_a_fresh_torch_adamw(
        stage, offload, tmp_path):
    # torch: 2 steps, then a new AdamW (fresh m, v and step) on those weights for 2 more.
    ref = make_model("mlp")
    torch_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01), 2, 0)
    torch_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01), 2, 2)
    cfg = ds_config(stage, offload, nvme_path=str(tmp_path))
    first, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    for step in range(2):
        first.backward(first(*batch("mlp", step)))
        first.step()
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    tuned, _, _, _ = strata.initialize(model=make_model("mlp", seed=5), config=cfg)
    tuned.load_checkpoint(tmp_path / "ckpt", load_optimizer_states=False)
    assert tuned.global_steps == 2
    for step in range(2, 4):
        tuned.backward(tuned(*batch("mlp", step)))
        tuned.step()
    master = tuned.read_master()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), atol=2e-6, rtol=1e-5, msg=n)
    # The restart is kept by a later save: a resume from there continues it bit for bit.
    tuned.save_checkpoint(tmp_path / "ckpt")
    tuned.backward(tuned(*batch("mlp", 4)))
    tuned.step()
    straight = tuned.read_master()
    tuned.close()
    again, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    again.load_checkpoint(tmp_path / "ckpt")
    again.backward(again(*batch("mlp", 4)))
    again.step()
    for n, v in again.read_master().items():
        assert torch.equal(v, straight[n]), n
    again.close()


def test_zero_to_fp32_as_deepspeed_users_call_it(tmp_path):
    """DeepSpeed's zero_to_fp32 as its users reach it: `from deepspeed.utils.zero_to_fp32 import
    ...`, convert_zero_checkpoint_to_fp32_state_dict into a directory (one file, or Hugging Face's
    shards and index past max_shard_size; safetensors or torch.save), and the zero_to_fp32.py that
    save_checkpoint leaves in the checkpoint directory, run as a script. A transformers GPT-2
    trained at stage 3 comes back through from_pretrained with the masters' values."""
    import json
    import subprocess
    import sys
    transformers = pytest.importorskip("transformers")
    from models import lm_batch, lm_loss, make_lm
    strata.register_as_deepspeed()
    from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                              get_fp32_state_dict_from_zero_checkpoint)
    model = make_lm("gpt2")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, "cpu"))
    for step in range(2):
        engine.backward(lm_loss("gpt2", engine, *lm_batch("gpt2", step, 4)))
        engine.step()
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    master = engine.read_master()
    engine.close()
    script = ckpt / "zero_to_fp32.py"
    assert os.access(script, os.X_OK)
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]

    def loaded(out):
        back = transformers.GPT2LMHeadModel.from_pretrained(out)
        got = dict(back.named_parameters())
        for n, m in master.items():
            assert torch.equal(got[n].detach(), m), n
    # One file in a directory, each format; the model's config beside it for from_pretrained.
    for safe, name in ((False, "pytorch_model.bin"), (True, "model.safetensors")):
        out = tmp_path / f"one-{int(safe)}"
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, safe_serialization=safe)
        assert sorted(os.listdir(out)) == [name]
        model.config.save_pretrained(out)
        loaded(out)
    # Shards of at most 40 kB (the embedding, larger, alone in its own), as the script is run.
    out = tmp_path / "shards"
    run = subprocess.run([sys.executable, str(script), str(ckpt), str(out), "--safe_serialization",
                          "--max_shard_size", "40KB"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.iterdir()) == files + ["model.safetensors.index.json"]
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == 4 * sum(m.numel() for m in master.values()) + sum(
        b.numel() * b.element_size() for n, b in sd.items() if n not in master and
        n != "lm_head.weight")
    model.config.save_pretrained(out)
    loaded(out)
    # The file form of DeepSpeed before 0.14, and a bad size named.
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "w.bin")
    assert torch.load(tmp_path / "w.bin").keys() == sd.keys()
    with pytest.raises(ValueError, match="max_shard_size"):
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "x", max_shard_size="5 parsecs")


def test_save_latest_false_leaves_latest_and_loads_by_tag(tmp_path):
    """DeepSpeed's save_checkpoint(save_latest=False) (a "best" checkpoint beside the rolling
    ones): `latest` keeps naming the one it named; the new one loads by its tag."""
    engine, _, _, _ = strata.initialize(model=make_model("bn"), config=ds_config(2))
    _train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="rolling")
    after_one = engine.read_master()
    _train(engine, 1, first=1)
    engine.save_checkpoint(tmp_path, tag="best", save_latest=False, client_state={"k": 2})
    after_two = engine.read_master()
    engine.close()
    with open(tmp_path / "latest") as f:
        assert f.read().strip() == "rolling"
    for tag, want, steps in ((None, after_one, 1), ("best", after_two, 2)):
        other, _, _, _ = strata.initialize(model=make_model("bn"), config=ds_config(2))
        path, _ = other.load_checkpoint(tmp_path, tag=tag)
        assert path.endswith(tag or "rolling") and other.global_steps == steps
        got = other.read_master()
        assert all(torch.equal(got[n], want[n]) for n in want)
        other.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_damaged_rank_file_is_the_error_load_raises(tmp_path, stage):
    """A byte flipped in a rank file: load_checkpoint raises the engine's corruption error naming
    the file, not the refusal of the parameters' gather that follows the failed load (the
    engine refuses every call once a load failed part way)."""
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(stage))
    engine.backward(engine(*batch("mlp", 0)))
    engine.step()
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    rank_file = next(p for p in (tmp_path / "t").iterdir() if p.name.startswith("rank0"))
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x40
    rank_file.write_bytes(bytes(data))
    again, _, _, _ = strata.initialize(model=make_model("mlp"), config=ds_config(stage))
    with pytest.raises(strata.StrataError) as failed:
        again.load_checkpoint(tmp_path)
    assert rank_file.name in str(failed.value) and "damaged" in str(failed.value)
    assert "refuses every call" not in str(failed.value)
    again.close()


@pytest.mark.parametrize("kind", ["steplr", "plateau"])
def test_a_scheduler_the_script_steps_resumes_at_its_lr(tmp_path, kind):
    """A torch scheduler the script steps itself (not passed to initialize: accelerate's and
    DeepSpeed scripts' pattern) that changed the lr after the last step before the save: the
    resumed run takes the lr it left (DeepSpeed's optimizer state keeps param_groups), and
    continues as the run that was not interrupted."""
    x = torch.ones(2, 4)

    def build():
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        sch = (torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1) if kind == "steplr"
               else torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.1, patience=0))
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0,
               "zero_optimization": {"stage": 2}}
        engine, *_ = strata.initialize(model=m, optimizer=opt, config=cfg)
        return engine, opt, sch

    def run(engine, sch, steps, first=0):
        for i in range(first, first + steps):
            engine.backward(engine(x * (i + 1)).sum())
            engine.step()
            sch.step() if kind == "steplr" else sch.step(1.0)  # a plateau: the lr drops

    straight, _, sch = build()
    run(straight, sch, 4)
    want = straight.module.weight.detach().clone()
    straight.destroy()

    engine, opt, sch = build()
    run(engine, sch, 2)
    left = opt.param_groups[0]["lr"]
    assert left < 0.01  # changed after the last step
    engine.save_checkpoint(str(tmp_path), tag="t")
    state = sch.state_dict()
    engine.destroy()
    engine, opt, sch = build()
    engine.load_checkpoint(str(tmp_path), tag="t")
    sch.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == left and engine.get_lr() == [left]
    run(engine, sch, 2, first=2)
    assert torch.equal(engine.module.weight.detach(), want)
    engine.destroy()


def test_betas_eps_and_weight_decay_come_back_with_the_optimizer_states(tmp_path):
    """A run resumed with other betas / weight_decay in its config takes the checkpoint's, as
    DeepSpeed's optimizer load_state_dict restores param_groups (a Trainer resumed with new
    adam_beta1 / weight_decay arguments continues as the run that was not interrupted), unless
    load_optimizer_states=False."""
    x = torch.ones(2, 4)

    def build(wd, beta1):
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0,
               "zero_optimization": {"stage": 2},
               "optimizer": {"type": "AdamW",
                             "params": {"lr": 0.01, "weight_decay": wd, "betas": [beta1, 0.99]}}}
        engine, *_ = strata.initialize(model=torch.nn.Linear(4, 4), config=cfg)
        return engine

    def run(engine, first, steps):
        for i in range(first, first + steps):
            engine.backward(engine(x * (i + 1)).sum())
            engine.step()

    straight = build(0.1, 0.9)
    run(straight, 0, 4)
    want = straight.module.weight.detach().clone()
    straight.destroy()
    engine = build(0.1, 0.9)
    run(engine, 0, 2)
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.destroy()
    for keep in (True, False):
        engine = build(0.5, 0.5)
        engine.load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=keep)
        group = engine.optimizer.param_groups[0]
        assert (group["weight_decay"], group["betas"][0]) == ((0.1, 0.9) if keep else (0.5, 0.5))
        run(engine, 2, 2)
        assert torch.equal(engine.module.weight.detach(), want) == keep
        engine.destroy()


def _gpt2(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=37, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _micro_loop(engine, batches, save_every=None, save_dir=None):
    """A DeepSpeed user's loop: the step counts micro-batches, so a save every N of them falls
    inside an accumulation window when N is not a multiple of gradient_accumulation_steps."""
    losses = []
    for step, (x, _) in enumerate(batches):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save_every and (step + 1) % save_every == 0:
            engine.save_checkpoint(save_dir)
    return losses


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "cpu")])
def test_a_save_inside_an_accumulation_window_keeps_its_gradients_as_deepspeed(
        tmp_path, stage, offload):
    """gradient_accumulation_steps 4 and a save every 6 micro-batches (inside the second window):
    training goes on with the window's gradients, to the bits of a run that never saved; the
    checkpoint holds the state of the last step (global_step1), and a run resumed from it starts
    a whole new window, as DeepSpeed's does (its micro-step count is not saved)."""
    cfg = ds_config(stage, offload, gas=4)
    if stage == 3:  # the optimizer step speculated during the last backward is undone, redone
        cfg["zero_optimization"]["offload_optimizer"]["speculative_step"] = True
    batches = [batch("gpt", i) for i in range(12)]
    plain, _, _, _ = strata.initialize(model=_gpt2(), config=cfg)
    want = _micro_loop(plain, batches)
    want_params = [p.detach().clone() for p in plain.module.parameters()]
    plain.close()

    engine, _, _, _ = strata.initialize(model=_gpt2(), config=cfg)
    got = _micro_loop(engine, batches, save_every=6, save_dir=tmp_path / "ckpt")
    assert got == want
    for p, q in zip(engine.module.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    engine.close()
    # Saved after micro-batches 6 (in the second window) and 12 (at the third step).
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step1", "global_step3", "latest",
                                                      "zero_to_fp32.py"]

    resumed, _, _, _ = strata.initialize(model=_gpt2(seed=1), config=cfg)
    resumed.load_checkpoint(tmp_path / "ckpt", tag="global_step1")
    assert resumed.global_steps == 1 and resumed.micro_steps == 4
    # The next whole window is batches 4-7: losses and weights follow the uninterrupted run's.
    assert _micro_loop(resumed, batches[4:]) == want[4:]
    for p, q in zip(resumed.module.parameters(), want_params):
        assert torch.equal(p.detach(), q)
    resumed.close()


def test_the_recovery_script_written_after_the_commit_warns_on_failure_and_leaves_no_temporary(
        tmp_path, monkeypatch):
    """zero_to_fp32.py is written after the checkpoint is committed: a full disk there is a
    warning naming the file (the save succeeded), and a killed writer's temporary is removed by
    the next save."""
    from strata.utils import zero_to_fp32
    dead = tmp_path / "zero_to_fp32.py.tmp.999999999"  # no such process
    dead.write_text("partial")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(zero_to_fp32.os, "replace", full)
    with pytest.warns(UserWarning, match=r"saved, but its recovery script .*zero_to_fp32.py"):
        zero_to_fp32.write_recovery_script(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    zero_to_fp32.write_recovery_script(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zero_to_fp32.py"]
