"""strata.integrations.transformers: a Hugging Face Trainer script trained through strata
(TrainingArguments(deepspeed=<config>)) against transformers' own Trainer on the same tiny Llama,
seed and data (fp32: the loss curves agree to the rounding of the engine's Adam against
torch's); "auto" resolution; save_model / from_pretrained; checkpoint and resume; two processes
(hf_dist_worker.py, accelerate's torch.distributed and data sharding) against one process with
twice the batch."""
import contextlib
import copy
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata  # noqa: E402,F401
from strata.integrations import transformers as st  # noqa: E402

if st.unsupported_reason() is not None:  # transformers older than the integration's minimum
    pytest.skip(st.unsupported_reason(), allow_module_level=True)

STEPS = 6
LOSS_RTOL = 1e-4  # fp32; the engine's fused AdamW against torch.optim.AdamW (rounding order)
VOCAB, SEQ, SAMPLES = 64, 16, 32


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=SAMPLES, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Losses(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def auto_config(stage, offload_optimizer="none", offload_param="none", nvme=None, **extra):
    zero = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold=0)
    for key, dev in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if dev != "none":
            zero[key] = {"device": dev, **({"nvme_path": str(nvme)} if dev == "nvme" else {})}
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
           "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    cfg.update(extra)
    return cfg


def args_kw(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=4,
                gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-2,
                weight_decay=0.01, warmup_steps=2, lr_scheduler_type="linear", max_grad_norm=1.0,
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                dataloader_num_workers=0, seed=7, disable_tqdm=True)
    base.update(kw)
    return base


@contextlib.contextmanager
def loads_whole():
    """transformers' zero.Init hook off for the block. strata's TrainingArguments at stage 3 set
    it while they live, as transformers' set DeepSpeed's: a model loaded for comparison beside a
    live stage-3 Trainer would otherwise be built partitioned."""
    import transformers.integrations.deepspeed as hf_deepspeed
    kept = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = kept


def run(out, config=None, model=None, steps=None, resume=None, eval_ds=None, **kw):
    """(trainer, per-step logs): transformers' Trainer when config is None, else strata's."""
    model = model if model is not None else tiny_llama()
    if steps is not None:
        kw["max_steps"] = steps
    if config is None:
        args = transformers.TrainingArguments(**args_kw(out, **kw))
        cls = transformers.Trainer
    else:
        args = st.TrainingArguments(deepspeed=config, **args_kw(out, **kw))
        cls = st.Trainer
    cb = Losses()
    trainer = cls(model=model, args=args, train_dataset=Tokens(), eval_dataset=eval_ds,
                  callbacks=[cb])
    if config is None and trainer.accelerator.gradient_accumulation_steps != 1:
        # transformers 5.3 - 5.5.3 also gave accelerate the gradient_accumulation_steps, whose
        # backward then divided the loss by them again: its own Trainer's gradients were 1/GA of
        # those of its DeepSpeed path, which strata follows (the losses agree, Adam being nearly
        # indifferent to the scale; grad_norm and the weights do not). GA=1 in accelerate, as
        # transformers does from 5.5.4 ("the Trainer handles GAS itself").
        trainer.accelerator.gradient_accumulation_steps = 1
    trainer.train(resume_from_checkpoint=resume)
    return trainer, cb.logs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    _, logs = run(tmp_path_factory.mktemp("ref"))
    return logs


def assert_same_curve(logs, ref):
    assert [l["loss"] for l in logs] == pytest.approx([l["loss"] for l in ref], rel=LOSS_RTOL)
    assert [l["learning_rate"] for l in logs] == pytest.approx(
        [l["learning_rate"] for l in ref], rel=1e-6)
    assert [l["grad_norm"] for l in logs] == pytest.approx(
        [l["grad_norm"] for l in ref], rel=1e-3)


@pytest.mark.parametrize("case", ["stage2-cpu", "stage3-nvme"])
def test_matches_transformers_trainer(tmp_path, reference, case):
    """Config all "auto": the Trainer's AdamW (decay / no-decay groups) and linear warmup run by
    the engine; (a) stage 2 + optimizer on cpu, (b) stage 3 + optimizer on nvme + params on cpu."""
    if case == "stage2-cpu":
        cfg = auto_config(2, offload_optimizer="cpu")
    else:
        (tmp_path / "nvme").mkdir()
        cfg = auto_config(3, offload_optimizer="nvme", offload_param="cpu", nvme=tmp_path / "nvme")
    trainer, logs = run(tmp_path / "out", cfg)
    assert len(logs) == STEPS
    assert_same_curve(logs, reference)
    assert trainer.strata_engine.global_steps == STEPS


def test_accumulation_with_a_short_last_step(tmp_path):
    """gradient_accumulation_steps=3 over 8 micro-batches an epoch: the epoch's last step has 2
    (the boundary is the Trainer's); cosine schedule."""
    kw = dict(gradient_accumulation_steps=3, lr_scheduler_type="cosine", steps=5)
    _, ref = run(tmp_path / "ref", **kw)
    _, logs = run(tmp_path / "st", auto_config(2), **kw)
    assert len(logs) == 5
    assert_same_curve(logs, ref)


def test_config_sections_and_client_parts(tmp_path):
    """The config's own "optimizer" and "scheduler" sections ("auto" filled from the arguments)
    run instead of the Trainer's; the logged lr is the engine's."""
    cfg = auto_config(2, optimizer={"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        scheduler={"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto"}})
    trainer, logs = run(tmp_path, cfg)
    assert len(logs) == STEPS
    assert all(l["loss"] == l["loss"] for l in logs)
    lrs = [l["learning_rate"] for l in logs]  # warmed up to warmup_max_lr, then decaying
    assert max(lrs) == pytest.approx(1e-2) and lrs[-1] < 1e-2 and lrs[0] < 1e-2
    assert trainer.strata_engine.global_steps == STEPS


# -- "auto" resolution ---------------------------------------------------------------------------
def targs(tmp_path, **kw):
    return transformers.TrainingArguments(**args_kw(tmp_path, **kw))


def test_resolve_auto_fills_as_transformers(tmp_path):
    model = tiny_llama()
    cfg = auto_config(3, optimizer={"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        scheduler={"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto"}})
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = "auto"
    before = copy.deepcopy(cfg)
    a = targs(tmp_path, warmup_steps=0.25, adam_beta2=0.95)
    out = st.resolve_auto(cfg, a, model, num_training_steps=40, world_size=3)
    assert cfg == before  # not modified
    assert out["train_micro_batch_size_per_gpu"] == 4
    assert out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 3 * 4 * 2
    assert out["gradient_clipping"] == 1.0
    assert out["optimizer"]["params"] == {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                          "weight_decay": 0.01}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                          "warmup_num_steps": 10, "total_num_steps": 40}
    assert out["fp16"]["enabled"] is False and out["bf16"]["enabled"] is False
    z = out["zero_optimization"]
    assert z["reduce_bucket_size"] == 32 * 32
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert z["stage3_param_persistence_threshold"] == 10 * 32
    assert strata.check_config(out, world_size=3)["ok"]
    # no warmup: warmup_num_steps is kept at 1 (transformers' max(1, ...))
    out = st.resolve_auto(cfg, targs(tmp_path, warmup_steps=0), model, 40, 1)
    assert out["scheduler"]["params"]["warmup_num_steps"] == 1


def test_resolve_auto_mismatches_listed(tmp_path):
    cfg = auto_config(2, optimizer={"type": "AdamW", "params": {"lr": 3e-4}})
    cfg["train_micro_batch_size_per_gpu"] = 8
    cfg["gradient_clipping"] = 0.5
    with pytest.raises(ValueError) as e:
        st.resolve_auto(cfg, targs(tmp_path), tiny_llama(), 10, 1)
    msg = str(e.value)
    for line in ("ds train_micro_batch_size_per_gpu=8 vs hf per_device_train_batch_size=4",
                 "ds gradient_clipping=0.5 vs hf max_grad_norm=1.0",
                 "ds optimizer.params.lr=0.0003 vs hf learning_rate=0.01"):
        assert line in msg
    cfg = auto_config(2)
    cfg["steps_per_print"] = "auto"  # a key no trainer fills, which DeepSpeed would use as is
    with pytest.raises(ValueError, match="steps_per_print"):
        st.resolve_auto(cfg, targs(tmp_path), tiny_llama(), 10, 1)


def test_resolve_auto_fills_accelerates_keys_and_leaves_what_deepspeed_drops(tmp_path,
                                                                             monkeypatch):
    """accelerate's DeepSpeedPlugin, which TrainingArguments builds, fills the stage, the offload
    devices and paths and the 16-bit gather flag (accelerate's ZeRO-3 offload template writes the
    last "auto"); a key nobody fills in a DeepSpeed config-model section is left for initialize,
    which drops it as DeepSpeed does."""
    cfg = auto_config(3)
    z = cfg["zero_optimization"]
    z.update(stage="auto", stage3_gather_16bit_weights_on_model_save="auto", sub_group_size="auto",
             offload_optimizer={"device": "auto", "nvme_path": "auto"})
    out = st.resolve_auto(cfg, targs(tmp_path), tiny_llama(), 10, 1)
    z = out["zero_optimization"]
    assert z["stage"] == 2 and z["stage3_gather_16bit_weights_on_model_save"] is False
    assert z["offload_optimizer"] == {"device": "none", "nvme_path": "none"}
    assert z["sub_group_size"] == "auto"
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    out = st.resolve_auto(cfg, targs(tmp_path), tiny_llama(), 10, 1)
    z = out["zero_optimization"]
    assert z["stage"] == 3 and z["stage3_gather_16bit_weights_on_model_save"] is True
    assert z["offload_optimizer"]["device"] == "cpu"
    # at stage 3 the hidden-size keys are filled too (transformers reads the stage after the plugin)
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)


def test_torch_compile_compiles_the_engines_module_and_trains_as_uncompiled(tmp_path, reference):
    """torch_compile=True (backend "eager": no C++ compiler needed): the Trainer's dynamo plugin
    compiles the engine's module as accelerate compiles DeepSpeed's (engine.compile); the
    stage-3 hooks run between the graphs and the curve is the uncompiled one."""
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    trainer, logs = run(tmp_path, auto_config(3), torch_compile_backend="eager",
                        eval_ds=Tokens(8), eval_strategy="steps", eval_steps=2)
    assert trainer.strata_engine.is_compiled
    assert trainer.model._compiled_call_impl is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    # An evaluation compiles nothing again: the engine stays the Trainer's wrapped model.
    assert trainer.model_wrapped is trainer.strata_engine
    assert_same_curve([l for l in logs if "loss" in l], reference)
    torch._dynamo.reset()


def test_refused_options(tmp_path):
    with pytest.raises(ValueError, match="bf16_full_eval"):
        st.TrainingArguments(deepspeed=auto_config(2), **args_kw(tmp_path, bf16_full_eval=True))
    with pytest.raises(ValueError, match="optim='adafactor'"):
        run(tmp_path, auto_config(2), optim="adafactor")
    # transformers' rule for DeepSpeed: a model-only checkpoint holds no engine state to load
    # the best model from (strata's run went on from its last weights, warning).
    with pytest.raises(ValueError, match="save_only_model` along with `load_best_model_at_end"):
        run(tmp_path, auto_config(3), eval_ds=Tokens(8), save_only_model=True,
            load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps",
            eval_steps=2, save_steps=2)
    trainer, _ = run(tmp_path, auto_config(3), steps=1)
    trainer.state.best_model_checkpoint = str(tmp_path / "checkpoint-0")  # no engine state
    with pytest.raises(ValueError, match="holds no engine state"):
        trainer._load_best_model()


def test_config_from_file_and_no_deepspeed_module(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(auto_config(2)))
    a = st.TrainingArguments(deepspeed=str(path), **args_kw(tmp_path))
    # The precision is applied at once, as accelerate applies it: fp32 arguments.
    want = {**auto_config(2), "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    assert a.deepspeed is None and a.strata_config == want
    import sys
    assert "deepspeed" not in sys.modules or sys.modules["deepspeed"].__spec__ is not None


# -- PEFT, evaluate, save_model, resume ------------------------------------------------------------
def lora_llama():
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    torch.manual_seed(3)
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        task_type="CAUSAL_LM"))


def test_lora_matches_transformers_trainer(tmp_path):
    _, ref = run(tmp_path / "ref", model=lora_llama())
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, logs = run(tmp_path / "st", auto_config(3), model=lora_llama())
    # LoRA layers' reads of their adapters' weights are registered ahead (no notice)
    assert not [w for w in caught if "strata: parameter" in str(w.message)]
    assert_same_curve(logs, ref)
    trainer.save_model(tmp_path / "adapter")
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.safetensors")


@pytest.mark.parametrize("reentrant", [False, True])
def test_lora_with_gradient_checkpointing_matches_transformers_trainer(tmp_path, reentrant):
    """TrainingArguments(gradient_checkpointing=True) on a PEFT LoRA at stage 3, the usual
    memory-saving fine-tune: the same curve as transformers' Trainer with checkpointing too (the
    non-reentrant form failed in backward on strata's frozen base weights)."""
    kw = dict(gradient_checkpointing=True,
              gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    _, ref = run(tmp_path / "ref", model=lora_llama(), **kw)
    _, logs = run(tmp_path / "st", auto_config(3), model=lora_llama(), **kw)
    assert len(logs) == STEPS
    assert_same_curve(logs, ref)


def test_evaluate_and_save_model_from_pretrained(tmp_path):
    (tmp_path / "nvme").mkdir()
    cfg = auto_config(3, offload_optimizer="nvme", offload_param="cpu", nvme=tmp_path / "nvme")
    trainer, _ = run(tmp_path / "out", cfg, eval_ds=Tokens(8, seed=5))
    metrics = trainer.evaluate()
    trainer.save_model(tmp_path / "saved")
    assert os.path.isfile(tmp_path / "saved" / "model.safetensors")
    with loads_whole():  # the Trainer's stage-3 arguments are alive
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    x = Tokens(8, seed=5).x
    trainer.model.eval()
    with torch.no_grad():
        ref = loaded(input_ids=x).logits
        got = trainer.model(input_ids=x).logits  # stage 3: gathered per module by the hooks
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    plain = transformers.Trainer(model=loaded, args=transformers.TrainingArguments(
        **args_kw(tmp_path / "plain")), eval_dataset=Tokens(8, seed=5))
    assert metrics["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-5)


def test_save_model_tied_gpt2_stage3(tmp_path):
    """A tied head (GPT-2: lm_head.weight is transformer.wte.weight, one engine parameter)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4))
    trainer, _ = run(tmp_path / "out", auto_config(3), model=model, steps=2)
    trainer.save_model(tmp_path / "saved")
    with loads_whole():  # the Trainer's stage-3 arguments are alive
        loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    x = Tokens(4, seed=5).x
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.model(input_ids=x).logits,
                                   loaded(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def _stage3():
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("shard", ["1GB", "8KB"], ids=["one-file", "sharded"])
def test_from_pretrained_partitioned_gives_the_same_logits(tmp_path, shard):
    """st.from_pretrained at stage 3: every parameter empty (partitioned under zero.Init), the
    shards read from the files (one or an index of many), the engine's logits those of the model
    saved; GPT-2's tied head (absent from the files) stays tied."""
    x = Tokens(4, seed=5).x
    for kind, make in (("llama", tiny_llama), ("gpt2", lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                    n_head=4)))):
        torch.manual_seed(0)
        saved = make().eval()
        saved.save_pretrained(tmp_path / kind, max_shard_size=shard)
        model = st.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / kind, _stage3())
        assert all(p.numel() == 0 for p in model.parameters()), kind
        engine, _, _, _ = strata.initialize(model=model, config=_stage3())
        with torch.no_grad():
            assert torch.equal(engine(input_ids=x).logits, saved(input_ids=x).logits), kind
        engine.close()


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_from_pretrained_partitioned_loads_models_transformers_converts(tmp_path, kind):
    """st.from_pretrained at stage 3 builds as transformers does under the ZeRO-3 hook: BERT
    (an embedding with a padding_idx, initialised gathered; built under a bare zero.Init its
    init indexed an emptied weight) loads by ranges; ViT, whose save_pretrained writes an older
    layout of names that transformers converts on load, is loaded by transformers' own
    from_pretrained under the hook (strata's reader left 32 of its 38 parameters at their
    random start). Every parameter equals the saved model's."""
    from strata.utils import safe_get_full_fp32_param
    torch.manual_seed(0)
    if kind == "bert":
        saved = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32))
    else:
        saved = transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, num_labels=5))
    with torch.no_grad():  # every value away from any initialisation
        for p in saved.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    saved.save_pretrained(tmp_path / kind)
    with loads_whole():  # only the call's own hook
        model = st.from_pretrained(type(saved), tmp_path / kind, _stage3())
    assert all(p.numel() == 0 for p in model.parameters()), kind
    engine, _, _, _ = strata.initialize(model=model, config=_stage3())
    for name, p in saved.named_parameters():
        got = safe_get_full_fp32_param(dict(engine.module.named_parameters())[name])
        assert torch.equal(got, p.detach()), name
    engine.close()


def test_from_pretrained_partitioned_reads_a_tied_head_named_in_the_files(tmp_path):
    """Hub and merged checkpoints of a tied model often name the head beside the embedding:
    both names carry the same values and the load reads them (it failed with a KeyError on the
    head's name, which named_parameters leaves out as a duplicate)."""
    from safetensors.torch import load_file, save_file
    from strata.utils import safe_get_full_fp32_param
    torch.manual_seed(0)
    saved = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4))
    saved.save_pretrained(tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    tensors = load_file(file)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    with loads_whole():
        model = st.from_pretrained(type(saved), tmp_path / "m", _stage3())
    engine, _, _, _ = strata.initialize(model=model, config=_stage3())
    named = dict(engine.module.named_parameters())
    for name, p in saved.named_parameters():
        assert torch.equal(safe_get_full_fp32_param(named[name]), p.detach()), name
    engine.close()


def test_from_pretrained_reads_only_this_ranks_ranges(tmp_path, monkeypatch):
    """With two ranks, rank 1 keeps exactly its owned range of each module's parameters (read
    from the file, nothing else); below stage 3 it is transformers' from_pretrained."""
    saved = tiny_llama()
    saved.save_pretrained(tmp_path / "m")
    # rank 1 of 2, whatever group this process has started (as RANK=1 WORLD_SIZE=2 give it)
    monkeypatch.setattr(strata.zero, "_rank_world", lambda: (1, 2))
    with loads_whole():  # strata's reader alone, whatever hook an earlier Trainer left alive
        model = st.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "m", _stage3())
    whole = dict(saved.named_parameters())
    held = 0
    for name, p in model.named_parameters():
        part = p._strata_part
        want = whole[name].detach().reshape(-1)[part.begin:part.end]
        assert torch.equal(part.shard, want), name
        held += part.end - part.begin
    total = sum(p.numel() for p in saved.parameters())
    assert 0 < held < total  # a part of the model, not all of it
    monkeypatch.undo()
    cfg = _stage3()
    cfg["zero_optimization"]["stage"] = 2
    plain = st.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "m", cfg)
    assert all(torch.equal(p, whole[n]) for n, p in plain.named_parameters())


def test_from_pretrained_after_the_arguments_loads_partitioned(tmp_path, reference):
    """As transformers' TrainingArguments set up DeepSpeed's zero.Init hook: at stage 3 a model
    that transformers' own from_pretrained loads after strata's arguments is built partitioned
    (strata's HfDeepSpeedConfig, alive with the arguments), and the Trainer trains it as the
    reference."""
    tiny_llama().save_pretrained(tmp_path / "m")
    try:
        args = st.TrainingArguments(deepspeed=auto_config(3, offload_optimizer="cpu"),
                                    **args_kw(tmp_path / "out"))
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
        assert all(p.numel() == 0 and hasattr(p, "ds_numel") for p in model.parameters())
        cb = Losses()
        st.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
        assert_same_curve(cb.logs, reference)
    finally:  # as transformers' own tests do: no hook left for the next test's models
        transformers.integrations.deepspeed.unset_hf_deepspeed_config()


def test_evaluate_predict_and_save_before_training_a_partitioned_model(tmp_path):
    """A baseline evaluation before fine-tuning, on a model from_pretrained built partitioned
    (the documented stage-3 order): evaluate() and predict() run in a forward-only engine (as
    transformers' DeepSpeed path builds an inference engine there), save_model() gathers the
    weights; before, the forward met the empty partitions and the file held empty tensors.
    Training afterwards is the reference's."""
    tiny_llama().save_pretrained(tmp_path / "m")
    with loads_whole():
        plain_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    plain = transformers.Trainer(model=plain_model, args=transformers.TrainingArguments(
        **args_kw(tmp_path / "plain", per_device_eval_batch_size=4)),
        eval_dataset=Tokens(8, seed=5))
    want = plain.evaluate()["eval_loss"]
    want_logits = plain.predict(Tokens(4, seed=6)).predictions
    try:
        args = st.TrainingArguments(deepspeed=auto_config(3), **args_kw(
            tmp_path / "out", per_device_eval_batch_size=4))
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
        assert all(p.numel() == 0 for p in model.parameters())
        trainer = st.Trainer(model=model, args=args, train_dataset=Tokens(),
                             eval_dataset=Tokens(8, seed=5))
        assert trainer.evaluate()["eval_loss"] == pytest.approx(want, rel=1e-5)
        got_logits = trainer.predict(Tokens(4, seed=6)).predictions
        np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
        assert all(p.numel() == 0 for p in model.parameters())  # partitioned as before
        trainer.save_model(tmp_path / "saved")
        with loads_whole():
            saved = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")
        for (n, a), b in zip(plain_model.named_parameters(), saved.parameters()):
            assert torch.equal(a, b), n
        trainer.train()
        assert trainer.state.global_step == STEPS
    finally:
        transformers.integrations.deepspeed.unset_hf_deepspeed_config()


def test_reduce_lr_on_plateau_steps_on_the_eval_metric_as_transformers(tmp_path):
    """lr_scheduler_type="reduce_lr_on_plateau": the Trainer steps the scheduler with the eval
    loss after each evaluation, and the engine reads the lrs it writes (it steps no scheduler
    without its metric); before, the engine's first step called it without one (TypeError)."""
    kw = dict(lr_scheduler_type="reduce_lr_on_plateau", warmup_steps=0, learning_rate=3e-2,
              lr_scheduler_kwargs={"patience": 0, "factor": 0.5}, eval_strategy="steps",
              eval_steps=2, per_device_eval_batch_size=4, steps=8)
    _, want = run(tmp_path / "plain", eval_ds=Tokens(8, seed=5), **kw)
    _, got = run(tmp_path / "strata", auto_config(2), eval_ds=Tokens(8, seed=5), **kw)
    lrs = [l["learning_rate"] for l in want]
    assert min(lrs) < max(lrs)  # the plateau lowered it: the comparison is not of constants
    assert [l["learning_rate"] for l in got] == pytest.approx(lrs, rel=1e-6)
    assert [l["loss"] for l in got] == pytest.approx([l["loss"] for l in want], rel=LOSS_RTOL)


@pytest.mark.parametrize("source", ["config-file", "fields"])
def test_config_from_accelerate_launch(tmp_path, reference, monkeypatch, source):
    """`accelerate launch` with a DeepSpeed config sets ACCELERATE_USE_DEEPSPEED and either its
    config file or the ACCELERATE_DEEPSPEED_* / ACCELERATE_GRADIENT_* fields accelerate builds one
    from: strata's arguments without deepspeed= take that config as transformers' take it, the
    variable is turned off so that neither transformers nor accelerate sets DeepSpeed up, and
    the Trainer trains on the reference curve."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    if source == "config-file":
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(auto_config(2, offload_optimizer="cpu")))
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    else:
        for key, value in (("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"),
                           ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu"),
                           ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2"),
                           ("ACCELERATE_GRADIENT_CLIPPING", "1.0")):
            monkeypatch.setenv(key, value)
    args = st.TrainingArguments(**args_kw(tmp_path / "out"))
    assert args.deepspeed is None and os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"
    assert args.strata_config["zero_optimization"]["stage"] == 2
    cb = Losses()
    trainer = st.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=[cb])
    assert not trainer.is_deepspeed_enabled
    trainer.train()
    assert trainer.strata_engine.layout()["stage"] == 2
    assert_same_curve(cb.logs, reference)


def test_checkpoint_and_resume_equal_uninterrupted(tmp_path):
    cfg = auto_config(2, offload_optimizer="cpu")
    _, full = run(tmp_path / "full", cfg, save_strategy="steps", save_steps=3)
    ckpt = tmp_path / "full" / "checkpoint-3"
    for name in ("latest", "trainer_state.json", "rng_state.pth", "model.safetensors"):
        assert os.path.isfile(ckpt / name), name
    _, resumed = run(tmp_path / "resumed", cfg, resume=str(ckpt))
    assert [l["epoch"] for l in resumed] == [l["epoch"] for l in full[3:]]
    for a, b in zip(resumed, full[3:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-9)


def test_lora_checkpoint_leaves_the_base_out_and_resumes_as_uninterrupted(tmp_path):
    """transformers' Trainer saves a PEFT model with save_checkpoint(exclude_frozen_parameters=
    True) and resumes it with load_module_strict=False: the checkpoint holds the adapters, their
    optimizer state and the counters, not the frozen base, and the resumed run (its base built
    from the same weights) follows the uninterrupted one."""
    cfg = auto_config(3, offload_optimizer="cpu")
    _, full = run(tmp_path / "full", cfg, model=lora_llama(), save_strategy="steps", save_steps=3)
    ckpt = tmp_path / "full" / "checkpoint-3"
    with open(ckpt / "latest") as f:
        tag_dir = ckpt / f.read().strip()
    with open(tag_dir / "manifest.json") as f:
        groups = json.load(f)["model"]["groups"]
    model = lora_llama()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(g["numel"] for g in groups if g.get("excluded")) == frozen
    assert all(g.get("trainable") is False for g in groups if g.get("excluded"))
    # fp32 at one rank: param, master, m, v of each trained element, headers and padding aside.
    rank_bytes = sum(f.stat().st_size for f in tag_dir.glob("rank*.safetensors"))
    assert 16 * trainable <= rank_bytes < 16 * trainable + 4 * frozen // 2
    _, resumed = run(tmp_path / "resumed", cfg, model=lora_llama(), resume=str(ckpt))
    assert [l["epoch"] for l in resumed] == [l["epoch"] for l in full[3:]]
    for a, b in zip(resumed, full[3:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-9)


def test_bf16_and_a_second_train_call(tmp_path, reference):
    """bf16=True fills bf16.enabled (the engine's bf16 with fp32 masters: the curve follows fp32
    loosely); a second train() closes the first engine and builds another."""
    trainer, logs = run(tmp_path, auto_config(2), bf16=True, steps=3)
    assert trainer.strata_engine.layout()["stage"] == 2
    assert [l["loss"] for l in logs] == pytest.approx([l["loss"] for l in reference[:3]],
                                                      rel=1e-2)
    first = trainer.strata_engine
    trainer.train()
    assert trainer.strata_engine is not first and trainer.strata_engine.global_steps == 3


def test_precision_arguments_apply_to_a_config_without_the_section(tmp_path):
    """As accelerate sets every DeepSpeed run of the Trainer up (DeepSpeedPlugin
    .set_mixed_precision): bf16=True with a config that has no "bf16" section trains in bf16
    (TRL's configs default to bf16=True; short configs are common), fp16=True adds fp16 with
    auto_cast, and a config that enables the other dtype is refused."""
    short = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "zero_optimization": {"stage": 2}}
    trainer, logs = run(tmp_path / "bf16", copy.deepcopy(short), bf16=True, steps=2)
    assert trainer.args.strata_config["bf16"] == {"enabled": True}
    assert trainer.strata_engine.bfloat16_enabled()
    assert trainer.strata_engine.layout()["dtype"] == "bfloat16"
    assert len(logs) == 2
    fp32 = st.TrainingArguments(deepspeed=copy.deepcopy(short), **args_kw(tmp_path / "fp32"))
    assert fp32.strata_config["bf16"] == {"enabled": False}
    assert fp32.strata_config["fp16"] == {"enabled": False}
    with pytest.raises(ValueError, match="cannot be set to `bf16` when `fp16` is set"):
        st.TrainingArguments(deepspeed={**short, "fp16": {"enabled": True}},
                             **args_kw(tmp_path / "both", bf16=True))


# -- two processes -------------------------------------------------------------------------------
def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STRATEGIES = ["sequential", "random"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """One launch of hf_dist_worker on 2 ranks for every sampling strategy (one engine each)."""
    from launch import launch
    tmp = tmp_path_factory.mktemp("two")
    with pytest.MonkeyPatch.context() as mp:  # accelerate initialises torch.distributed (env://)
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        outs = launch(tmp, "hf_dist_worker.py", lambda r, nvme: [tmp, *STRATEGIES], world=2,
                      timeout_s=280)
    return tmp, outs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_processes_match_one_with_twice_the_batch(tmp_path, two_process_runs, strategy):
    """strata's Trainer on 2 ranks (stage 3, optimizer on cpu, "auto" config, fp32; hf_dist_worker)
    against transformers' own Trainer in this one process with per_device_train_batch_size
    doubled. What makes them comparable: accelerate shards the Trainer's DataLoader by batches in
    turn (rank r takes micro-batches r, r+2, ... of the sampler's order, which is the same on
    every rank: sequential, or random from the same seed), so a step's two micro-batches are the
    one process's doubled micro-batch; the loss each rank computes is scaled by the token count
    gathered over both ranks (average_tokens_across_devices) and the engine averages the ranks'
    gradients, so the gradient is that of the doubled batch's mean; and the logged loss is the
    mean over ranks (the Trainer gathers it). Compared: the logged loss per step (rel 1e-4), lr
    and grad norm; the final master weights bit-equal on both ranks and equal to the one
    process's weights to 1e-6 (measured: 1.3e-7 apart; one process with the undoubled batch ends
    5e-2 away and its losses differ from the third step on)."""
    tmp, outs = two_process_runs
    for rc, out in outs:
        assert rc == 0, out
    res = [torch.load(tmp / f"{strategy}.rank{r}.pt") for r in range(2)]
    ref_trainer, ref = run(tmp_path / "ref", per_device_train_batch_size=8,
                           train_sampling_strategy=strategy)
    for r in range(2):
        assert res[r]["steps"] == STEPS
        assert len(res[r]["logs"]) == STEPS
    for n, p in res[0]["master"].items():
        assert torch.equal(p, res[1]["master"][n]), n  # both ranks agree bit for bit
    assert [l["loss"] for l in res[0]["logs"]] == [l["loss"] for l in res[1]["logs"]]
    assert_same_curve(res[0]["logs"], ref)
    ref_params = dict(ref_trainer.model.named_parameters())
    for n, p in res[0]["master"].items():
        torch.testing.assert_close(p, ref_params[n].detach().float(), rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{n}: {m}")


def test_older_transformers_refused_at_construction(tmp_path, monkeypatch):
    """A transformers without a Trainer method the integration overrides (below
    MIN_TRANSFORMERS_VERSION) is a clear error when a Trainer with a strata config is built, not
    a run without strata; without a config the Trainer is transformers' own and is built."""
    monkeypatch.setattr(st, "_TRAINER_HOOKS", st._TRAINER_HOOKS + ("_no_such_trainer_method",))
    args = st.TrainingArguments(deepspeed=auto_config(2), **args_kw(tmp_path))
    with pytest.raises(RuntimeError, match=r"transformers >= " + st.MIN_TRANSFORMERS_VERSION +
                       r".*_no_such_trainer_method"):
        st.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens())
    st.Trainer(model=tiny_llama(), args=st.TrainingArguments(**args_kw(tmp_path / "plain")),
               train_dataset=Tokens())
