"""Frozen parameters (requires_grad=False): a LoRA fine-tune and a frozen embedding against plain
torch AdamW over the trainable parameters, their memory, checkpoints and refusals, and a PEFT
adapter on a transformers Llama. Two processes: test_distributed.py's "lora" / "gptfe" cases."""
import warnings

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
import strata.utils  # noqa: E402

from models import batch, ds_config, make_model, reference  # noqa: E402

STEPS = 3
LR, WD = 1e-2, 0.01

CASES = [("lora", 0, "none"), ("lora", 1, "cpu"), ("lora", 2, "cpu"), ("lora", 3, "none"),
         ("lora", 3, "nvme"), ("gptfe", 2, "none"), ("gptfe", 3, "cpu")]


def train(engine, kind, steps=STEPS, first=0):
    losses = []
    for step in range(first, steps):
        loss = engine(*batch(kind, step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind,stage,offload", CASES, ids=[f"{k}-stage{s}-{o}" for k, s, o in CASES])
def test_frozen_base_trains_as_torch_and_never_changes(kind, stage, offload, tmp_path):
    model = make_model(kind)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(
        stage, offload, lr=LR, wd=WD, nvme_path=str(tmp_path)))
    frozen = [g.name for g in engine._groups if not g.trainable]
    assert frozen, "the model has frozen groups"
    losses = train(engine, kind)
    ref_losses, ref_params = reference(kind, STEPS, LR, WD)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    master = engine.read_master()
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(master[n], ref_params[n], atol=2e-5, rtol=1e-4, msg=n)
        else:
            assert torch.equal(master[n], init[n]), n  # frozen: exactly as initialised
    engine.close()


def state_bytes(model):
    """Every tier's model-state bytes (params on the device, the optimizer's on the host)."""
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, "cpu"))
    state = sum(engine.layout()["state_bytes"].values())
    groups = len(engine._groups)
    engine.close()
    return state, groups


def test_frozen_parameters_cost_their_working_params_only():
    # fp32 at stage 3, optimizer on cpu: a trainable element holds param 4 + master 4 + m 4 +
    # v 4 + fp32 grad 4 = 20 bytes, a frozen one its param's 4. Host blocks take whole 4 KiB
    # units and shards 128 elements: at most that much more per block.
    lora = make_model("lora")
    n_all = sum(p.numel() for p in lora.parameters())
    n_train = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    frozen_bytes, groups = state_bytes(lora)
    formula = 4 * n_all + 16 * n_train
    assert formula <= frozen_bytes <= formula + groups * 5 * (4096 + 128 * 4)
    whole = make_model("lora")
    for p in whole.parameters():
        p.requires_grad_(True)
    whole_bytes, _ = state_bytes(whole)
    assert whole_bytes - frozen_bytes >= 16 * (n_all - n_train)


def rank_file_bytes(path):
    return sum(f.stat().st_size for f in path.iterdir() if f.name.startswith("rank"))


def test_checkpoint_of_a_fine_tune_resumes_bit_exact(tmp_path):
    cfg = ds_config(3, "cpu", lr=LR, wd=WD)
    engine, _, _, _ = strata.initialize(model=make_model("lora"), config=cfg)
    train(engine, "lora", steps=2)
    # Whole, and as transformers' Trainer saves a PEFT model: the frozen base left out.
    engine.save_checkpoint(tmp_path / "whole")
    engine.save_checkpoint(tmp_path / "lean", exclude_frozen_parameters=True)
    frozen_numel = sum(p.numel() for p in make_model("lora").parameters() if not p.requires_grad)
    assert rank_file_bytes(tmp_path / "lean" / "global_step2") + 4 * frozen_numel <= \
        rank_file_bytes(tmp_path / "whole" / "global_step2")
    # zero_to_fp32: the trained adapters' masters and the frozen base as it was; the lean one
    # holds the adapters only (said unless asked for).
    saved = engine.read_master()
    trained = {n for n, p in make_model("lora").named_parameters() if p.requires_grad}
    sd = strata.utils.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "whole")
    for n, p in make_model("lora").named_parameters():
        assert torch.equal(sd[n], saved[n] if p.requires_grad else p.detach()), n
    adapters = strata.utils.get_fp32_state_dict_from_zero_checkpoint(
        tmp_path / "whole", exclude_frozen_parameters=True)  # DeepSpeed's: the trained ones only
    assert set(adapters) == trained
    with pytest.warns(UserWarning, match="without its .* frozen parameter"):
        lean = strata.utils.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "lean")
    assert set(lean) == trained
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lean = strata.utils.get_fp32_state_dict_from_zero_checkpoint(
            tmp_path / "lean", exclude_frozen_parameters=True)
    assert not [w for w in seen if "frozen parameter" in str(w.message)]
    for n in trained:
        assert torch.equal(lean[n], saved[n]), n
    train(engine, "lora", steps=4, first=2)
    straight = engine.read_master()
    engine.close()

    def resume(ckpt, seed, **kw):
        resumed, _, _, _ = strata.initialize(model=make_model("lora", seed=seed), config=cfg)
        resumed.load_checkpoint(tmp_path / ckpt, **kw)
        train(resumed, "lora", steps=4, first=2)
        again = resumed.read_master()
        resumed.close()
        assert straight.keys() == again.keys()
        for n in straight:
            assert torch.equal(straight[n], again[n]), n

    resume("whole", seed=1)  # another base: restored from the checkpoint
    # The lean one into the model built from the same base, as a PEFT resume does.
    resume("lean", seed=0, load_module_strict=False)
    # Into another base (as a script that forgot from_pretrained): the frozen values are not the
    # run's, told by their fingerprints.
    wrong, _, _, _ = strata.initialize(model=make_model("lora", seed=1), config=cfg)
    with pytest.raises(strata.StrataError, match="not the ones the saving run started from"):
        wrong.load_checkpoint(tmp_path / "lean", load_module_strict=False)
    wrong.close()
    base = make_model("lora")
    other, _, _, _ = strata.initialize(model=base, config=cfg)
    before = other.read_master()
    with pytest.raises(strata.StrataError, match=r"(?s)without its \d+ frozen group.*"
                                                 r"load_module_strict=False"):
        other.load_checkpoint(tmp_path / "lean")
    after = other.read_master()  # nothing changed
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    # load_module_only reads the weights it holds and names what it does not.
    with pytest.raises(RuntimeError, match="frozen parameter.*left out at save"):
        other.load_checkpoint(tmp_path / "lean", load_module_only=True)
    other.load_checkpoint(tmp_path / "lean", load_module_only=True, load_module_strict=False)
    master = other.read_master()
    for n, p in make_model("lora").named_parameters():
        assert torch.equal(master[n], saved[n] if p.requires_grad else p.detach()), n
    other.close()
    # A group saved frozen has no optimizer state to load into a trainable one.
    thawed = make_model("lora")
    for p in thawed.parameters():
        p.requires_grad_(True)
    other, _, _, _ = strata.initialize(model=thawed, config=cfg)
    with pytest.raises(strata.StrataError, match="is frozen in the checkpoint"):
        other.load_checkpoint(tmp_path / "whole")
    with pytest.raises(strata.StrataError, match=r"(?s)is frozen in the checkpoint.*"
                                                 r"load_module_only=True"):
        other.load_checkpoint(tmp_path / "whole", load_module_strict=False)
    other.close()


def test_lean_checkpoint_of_a_bf16_run_initialised_again_before_its_first_step(tmp_path):
    """bf16 from an fp32 model, a trainable weight written through GatheredParameters before the
    first step (InitParameters again, every frozen group from its stored bf16 copy): the frozen
    values are the same weights, and the lean checkpoint loads into the model built as before
    (the fingerprint is of the values as stored)."""
    cfg = ds_config(3, "cpu", dtype="bf16", lr=LR, wd=WD)
    model = make_model("lora")
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    trained = next(p for p in model.parameters() if p.requires_grad)
    with strata.zero.GatheredParameters([trained], modifier_rank=0):
        with torch.no_grad():
            trained.mul_(0.5)
    train(engine, "lora", steps=2)
    engine.save_checkpoint(tmp_path / "lean", exclude_frozen_parameters=True)
    saved = engine.read_master()
    engine.close()
    resumed, _, _, _ = strata.initialize(model=make_model("lora"), config=cfg)
    resumed.load_checkpoint(tmp_path / "lean", load_module_strict=False)
    got = resumed.read_master()
    resumed.close()
    for n in saved:
        assert torch.equal(saved[n], got[n]), n


def test_changing_requires_grad_after_initialize_is_refused_naming_it():
    model = make_model("lora")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(2))
    model.layers[0].k.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="layers.0.k.weight had requires_grad=False"):
        engine.backward(engine(*batch("lora", 0)))
    engine.close()


def peft_llama(transformers, peft, prepare=None, adapter=None):
    """A transformers Llama (seed 0) with a PEFT adapter, by default a LoRA on q_proj and
    v_proj; prepare(base) runs on the base model before the adapter is added."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16)
    base = transformers.LlamaForCausalLM(cfg)
    if prepare is not None:
        prepare(base)
    return peft.get_peft_model(base, adapter or peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"))


def lm_data(step):
    return torch.randint(0, 37, (4, 12), generator=torch.Generator().manual_seed(step))


def train_lm_torch(model, steps):
    """torch AdamW on the model's trainable parameters: the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WD)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(input_ids=lm_data(step), labels=lm_data(step)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_lm_engine(engine, steps):
    """The engine's losses, and the external-parameter notices its steps gave."""
    losses = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(steps):
            loss = engine(input_ids=lm_data(step), labels=lm_data(step)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, [str(w.message) for w in seen
                    if "registered as an external parameter" in str(w.message)]


def test_peft_lora_on_a_transformers_llama_trains_as_torch(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    def make():
        return peft_llama(transformers, peft)

    ref = make()
    ref_losses = train_lm_torch(ref, STEPS)
    model = make()
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(
        3, "nvme", lr=LR, wd=WD, nvme_path=str(tmp_path)))
    losses, notices = train_lm_engine(engine, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # Each LoRA layer reads its lora_A's weight.dtype in its own forward, which does not own
    # it: initialize registered the adapters of the four LoRA layers (two layers x q_proj,
    # v_proj) as their layers' external parameters ahead, so no notice.
    assert not notices, notices
    assert "_strata_external" not in model.__dict__
    assert sum(len(m.__dict__.get("_strata_external", {})) for m in model.modules()) == 8
    master = engine.read_master()
    for n, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(master[n], p.detach(), atol=2e-5, rtol=1e-4, msg=n)
    # The 16-bit export without the frozen base (DeepSpeed's exclude_frozen_parameters): the
    # adapter's trained weights alone.
    engine.save_16bit_model(tmp_path / "out", "adapter.bin", exclude_frozen_parameters=True)
    sd = torch.load(tmp_path / "out" / "adapter.bin")
    trained = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert set(sd) == trained
    for n in trained:
        torch.testing.assert_close(sd[n], master[n], atol=0, rtol=0, msg=n)
    engine.close()


@pytest.mark.parametrize("variant", ["dora", "embedding", "ia3"])
def test_peft_adapters_that_read_other_modules_weights_train_as_torch_without_notices(variant):
    """DoRA's magnitude module reads the base weight and the adapters, an embedding LoRA its
    lora_embedding_A / _B, IA3's layer its ia3_l vectors, each in a forward that does not own
    them: initialize registers them ahead on the reading module, so stage 3 trains as torch
    with no notice."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    def make():
        if variant == "ia3":
            adapter = peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                     feedforward_modules=["down_proj"], init_ia3_weights=False)
        else:
            adapter = peft.LoraConfig(
                r=4, lora_alpha=8, init_lora_weights="gaussian", use_dora=variant == "dora",
                target_modules=["q_proj", "v_proj"] if variant == "dora" else ["embed_tokens"])
        return peft_llama(transformers, peft, adapter=adapter)

    ref = make()
    want = train_lm_torch(ref, 3)
    model = make()
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, lr=LR, wd=WD))
    got, notices = train_lm_engine(engine, 3)
    assert got == pytest.approx(want, rel=1e-5)
    assert not notices, notices
    master = engine.read_master()
    engine.close()
    for n, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(master[n], p.detach(), atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("reentrant", [False, True])
def test_peft_lora_with_gradient_checkpointing_trains_as_without(reentrant):
    """A PEFT LoRA fine-tune with transformers' gradient checkpointing at stage 3 (the usual
    memory-saving fine-tune): its bits equal the run without checkpointing. torch's non-reentrant
    checkpoint keeps a frozen parameter saved by the recomputation as the tensor it is given; it
    was handed the parameter itself, which the release empties before checkpoint compares it with
    the forward's ("Recomputed values ... have different metadata")."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    def checkpointed(base):
        base.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        base.enable_input_require_grads()  # what PEFT users call for the reentrant one

    def run(checkpointing):
        model = peft_llama(transformers, peft, checkpointed if checkpointing else None)
        engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, lr=LR, wd=WD))
        losses = []
        for step in range(STEPS):
            idx = torch.randint(0, 37, (4, 12), generator=torch.Generator().manual_seed(step))
            loss = engine(input_ids=idx, labels=idx).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        master = engine.read_master()
        engine.close()
        return losses, master

    plain_losses, plain = run(False)
    losses, master = run(True)
    assert losses == plain_losses
    assert master.keys() == plain.keys() and all(torch.equal(master[k], plain[k]) for k in plain)


@pytest.mark.parametrize("stage,offload_param", [(0, "none"), (3, "none"), (3, "cpu")])
def test_a_frozen_model_runs_forward_without_an_optimizer(stage, offload_param):
    """Every parameter frozen (a reference model, a teacher) and no "optimizer" section: the
    engine partitions and gathers it as any model (stage 3: nothing of it stays whole between
    calls), computes what the torch module computes, and returns no optimizer, as DeepSpeed.
    A model with trainable parameters and no optimizer (DeepSpeed-Chat's reference, reward and
    EMA models) runs forward only the same way, its parameters frozen; the missing optimizer is
    refused where model_parameters= names parameters to train."""
    kind = "gpt"
    whole = make_model(kind)
    model = make_model(kind)
    model.requires_grad_(False)
    cfg = ds_config(stage)
    del cfg["optimizer"]
    if offload_param != "none":
        cfg["zero_optimization"]["offload_param"] = {"device": offload_param}
    engine, optimizer, _, _ = strata.initialize(model=model, config=cfg)
    assert optimizer is None
    assert all(not g.trainable for g in engine._groups)
    with torch.no_grad():
        for step in range(2):
            x, y = batch(kind, step)
            torch.testing.assert_close(engine(x, y), whole(x, y), rtol=0, atol=0)
    if stage == 3:
        assert all(p.numel() == 0 for p in model.parameters())  # released after the call
    engine.close()
    trainable = make_model(kind)
    with pytest.raises(ValueError, match=r"no \"optimizer\" section.*model_parameters= names"):
        strata.initialize(model=trainable, config=cfg, model_parameters=trainable.parameters())
    assert all(p.requires_grad for p in trainable.parameters())  # untouched by the refusal
    bad = dict(cfg, zero_optimization=dict(cfg["zero_optimization"], stage=7))
    with pytest.raises(strata.ConfigError):
        strata.initialize(model=trainable, config=bad)
    assert all(p.requires_grad for p in trainable.parameters())  # given back on the failure
    engine, optimizer, _, _ = strata.initialize(model=trainable, config=cfg)
    assert optimizer is None and all(not g.trainable for g in engine._groups)
    assert not any(p.requires_grad for p in trainable.parameters())
    x, y = batch(kind, 0)
    with torch.no_grad():
        torch.testing.assert_close(engine(x, y), whole(x, y), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="without an optimizer and without model_parameters"):
        engine.backward(engine(x, y))
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_weights_assigned_by_data_into_a_forward_only_engine_stand(tmp_path, stage):
    """`p_ref.data = p.data.clone()` (copying a policy into its reference or EMA model) on an
    engine with no optimizer: the forward, save_16bit_model, save_checkpoint and the forward
    after the save all have the new weights, as under DeepSpeed, whose forward-only engine keeps
    plain torch parameters. A save used to put the weights from initialize back."""
    from strata.utils import get_fp32_state_dict_from_zero_checkpoint

    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4))

    policy = net(1)
    ref, *_ = strata.initialize(model=net(0), config={"train_micro_batch_size_per_gpu": 4,
                                                      "zero_optimization": {"stage": stage}})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for p_ref, p in zip(ref.module.parameters(), policy.parameters()):
            p_ref.data = p.data.clone()
        want = policy(x)
        assert torch.equal(ref(x), want)
        ref.save_checkpoint(str(tmp_path), tag="t")
        assert torch.equal(ref(x), want)
    saved = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    for k, v in policy.state_dict().items():
        assert torch.equal(saved[k], v), k
    ref.close()  # the views of the engine's memory go with it: a later call names the close
    with pytest.raises(Exception, match="closed"):
        ref.save_checkpoint(str(tmp_path), tag="t3")


def test_data_assigned_to_a_trainable_parameter_is_noticed():
    """The same assignment on a trained parameter lasts until the next step, which works from
    the fp32 masters (as DeepSpeed's ZeRO optimizers): strata says so once."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    engine, *_ = strata.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    model.weight.data = torch.zeros(4, 4)
    with pytest.warns(UserWarning,
                      match=r"\.data of trainable parameter\(s\) 'weight' was replaced"):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    engine.destroy()


def test_a_transposed_view_assigned_to_a_frozen_square_weight_stands(tmp_path):
    """`w.data = w.data.t()`: the engine's own memory seen with other strides is a new value."""
    from strata.utils import get_fp32_state_dict_from_zero_checkpoint
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    want = lin.weight.detach().t().clone()
    ref, *_ = strata.initialize(model=lin, config={"train_micro_batch_size_per_gpu": 1,
                                                   "zero_optimization": {"stage": 2}})
    with torch.no_grad():
        lin.weight.data = lin.weight.data.t()
    ref.save_checkpoint(str(tmp_path), tag="t")
    assert torch.equal(lin.weight.detach(), want)
    assert torch.equal(get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")["weight"],
                       want)
    ref.destroy()
