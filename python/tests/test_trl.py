"""strata.integrations.trl: TRL's trainers (SFT, DPO, KTO, GRPO, RLOO, reward, distillation),
written as TRL's users write them (a tokenizer, a datasets.Dataset of text, of preference pairs
or of prompts, models given as objects or as paths, TRL's config defaults such as its gradient
checkpointing and fused LM head), trained through strata against TRL's own trainers on the same
tiny Llama, seed and data: fp32 loss curves and TRL's own metrics agree to the rounding of the
engine's Adam against torch's. Also: with_strata's classes (pickled arguments, one class per
class, errors), a LoRA adapter from SFTTrainer's peft_config saved and loaded, and resume."""
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
import strata  # noqa: E402,F401
from strata.integrations import transformers as st  # noqa: E402

if st.unsupported_reason() is not None:  # transformers older than the integration's minimum
    pytest.skip(st.unsupported_reason(), allow_module_level=True)
from strata.integrations import trl as strl  # noqa: E402


@pytest.fixture(autouse=True)
def no_stage3_arguments_left():
    """A test's stage-3 arguments may outlive it (a trainer in a reference cycle) and keep
    transformers' zero.Init hook on: the next test's models would be built partitioned."""
    yield
    import transformers.integrations.deepspeed as hf_deepspeed
    hf_deepspeed.unset_hf_deepspeed_config()

LOSS_RTOL = 1e-4  # fp32; the engine's fused AdamW against torch.optim.AdamW (rounding order)
WORDS = [f"w{i}" for i in range(56)]


def tokenizer():
    """A word-level tokenizer built here (nothing downloaded): <pad>, <eos>, <unk>, then WORDS."""
    import tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


def tiny_llama_config(**extra):
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=32,
                                    pad_token_id=0, eos_token_id=1, **extra)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config())


def tiny_reward_model(seed):
    """A LlamaForSequenceClassification scoring a sequence with one number."""
    torch.manual_seed(seed)
    return transformers.LlamaForSequenceClassification(tiny_llama_config(num_labels=1))


def words(g, lo, hi=None):
    k = lo if hi is None else int(torch.randint(lo, hi, (1,), generator=g))
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist())


def text_dataset(n=32):
    g = torch.Generator().manual_seed(1)
    return datasets.Dataset.from_dict({"text": [words(g, 6, 14) for _ in range(n)]})


def preference_dataset(n=32):
    g = torch.Generator().manual_seed(2)
    return datasets.Dataset.from_dict({"prompt": [words(g, 5) for _ in range(n)],
                                       "chosen": [words(g, 4) for _ in range(n)],
                                       "rejected": [words(g, 4) for _ in range(n)]})


def ds_config(stage, offload_optimizer="none", offload_param="none", nvme=None):
    zero = {"stage": stage}
    if stage == 3:  # the tiny models' groups would all be persistent (whole) under the default
        zero["stage3_param_persistence_threshold"] = 0
    for key, dev in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if dev != "none":
            zero[key] = {"device": dev, **({"nvme_path": str(nvme)} if dev == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "bf16": {"enabled": "auto"}}


def config_kw(out, **kw):
    """TRL's defaults kept where its users keep them (gradient checkpointing on, the chunked NLL
    through the fused LM head); fp32 so that the curves can be compared closely."""
    base = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                max_steps=6, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                report_to=[], use_cpu=True, seed=7, disable_tqdm=True, bf16=False, max_length=32)
    base.update(kw)
    return base


def train(trainer_name, out, config=None, model=None, resume=None, **kw):
    """(trainer, per-step logs): trl's trainer when config is None, else strata's."""
    model = model if model is not None else tiny_llama()
    lib = trl if config is None else strl
    config_cls = getattr(lib, trainer_name.replace("Trainer", "Config"))
    extra = {} if config is None else {"deepspeed": config}
    ctor = dict(kw.pop("trainer_kw", {}))
    args = config_cls(**extra, **config_kw(out, **kw))
    trainer = getattr(lib, trainer_name)(model=model, args=args, processing_class=tokenizer(),
                                         **ctor)
    assert isinstance(trainer, st.Trainer) == (config is not None)
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if config is not None:
        assert trainer.strata_engine is not None  # the engine ran the steps
    return trainer, logs


def assert_same_curve(logs, ref, metrics=()):
    assert len(logs) == len(ref) and logs
    assert [l["loss"] for l in logs] == pytest.approx([l["loss"] for l in ref], rel=LOSS_RTOL)
    assert [l["learning_rate"] for l in logs] == pytest.approx(
        [l["learning_rate"] for l in ref], rel=1e-6)
    assert [l["grad_norm"] for l in logs] == pytest.approx(
        [l["grad_norm"] for l in ref], rel=1e-3)
    for key in metrics:  # TRL's own metrics, computed by its compute_loss on strata's model
        assert [l[key] for l in logs] == pytest.approx([l[key] for l in ref], rel=1e-3, abs=1e-6)


def sft_kw():
    return dict(trainer_kw={"train_dataset": text_dataset()})


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory):
    return train("SFTTrainer", tmp_path_factory.mktemp("ref"), **sft_kw())[1]


@pytest.mark.parametrize("case", ["stage2-cpu", "stage3-nvme"])
def test_sft_matches_trl(tmp_path, sft_reference, case):
    """SFTTrainer on a text dataset (TRL tokenizes, adds EOS, builds the labels, computes its
    chunked NLL through the fused LM head, which reads lm_head.weight outside lm_head and again
    in its own backward): (a) stage 2 with the optimizer on cpu, (b) stage 3 with the optimizer
    on NVMe and the parameters on cpu."""
    if case == "stage2-cpu":
        cfg = ds_config(2, offload_optimizer="cpu")
    else:
        (tmp_path / "nvme").mkdir()
        cfg = ds_config(3, offload_optimizer="nvme", offload_param="cpu", nvme=tmp_path / "nvme")
    trainer, logs = train("SFTTrainer", tmp_path / "st", cfg, **sft_kw())
    assert_same_curve(logs, sft_reference,
                      metrics=("mean_token_accuracy", "entropy", "num_tokens"))
    stats = trainer.strata_engine.stats()
    assert stats["global_step"] == 6
    if case == "stage3-nvme":
        assert stats["store"]["peak_bytes"]["nvme"] > 0  # the optimizer state's home


def test_sft_from_a_model_path_loads_it_partitioned(tmp_path, sft_reference):
    """SFTTrainer(model="<path or hub id>") loads the model itself (TRL's create_model_from_path:
    from_pretrained after the arguments): at stage 3 transformers' hook builds it partitioned,
    no rank holding it whole, and the run is the one from the module built in memory."""
    tiny_llama().save_pretrained(tmp_path / "base")
    args = strl.SFTConfig(deepspeed=ds_config(3, offload_param="cpu"),
                          **config_kw(tmp_path / "out", model_init_kwargs={"dtype": torch.float32}))
    trainer = strl.SFTTrainer(model=str(tmp_path / "base"), args=args,
                              processing_class=tokenizer(), train_dataset=text_dataset())
    assert all(hasattr(p, "ds_tensor") and p.numel() == 0 for p in trainer.model.parameters())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert_same_curve(logs, sft_reference, metrics=("mean_token_accuracy",))


def lora_config():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0, task_type="CAUSAL_LM")


def test_sft_with_peft_config_at_stage_3_saves_a_loadable_adapter(tmp_path):
    """SFTTrainer(peft_config=...) wraps the model itself (frozen base, LoRA adapters): the same
    curve as TRL's at stage 3 with the parameters on cpu, and save_model writes an adapter that
    peft loads onto a fresh base with the engine's trained weights."""
    peft = pytest.importorskip("peft")
    kw = dict(trainer_kw={"train_dataset": text_dataset(), "peft_config": lora_config()})
    ref_trainer, ref = train("SFTTrainer", tmp_path / "ref", **kw)
    kw = dict(trainer_kw={"train_dataset": text_dataset(), "peft_config": lora_config()})
    trainer, logs = train("SFTTrainer", tmp_path / "st", ds_config(3, offload_param="cpu"), **kw)
    assert isinstance(trainer.model, peft.PeftModel)
    assert_same_curve(logs, ref, metrics=("mean_token_accuracy",))
    trainer.save_model(str(tmp_path / "adapter"))
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.safetensors")
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "adapter"))
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    want = {n: p for n, p in ref_trainer.model.named_parameters() if "lora_" in n}
    assert got.keys() == want.keys() and got
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.parametrize("case", ["stage2-ref-model", "stage3-ref-model", "stage3-peft",
                                  "stage3-precompute"])
def test_dpo_matches_trl(tmp_path, case):
    """DPOTrainer on prompt / chosen / rejected pairs, against TRL's own trainer: (a) stage 2 with
    a separate reference model (kept whole beside the engine, as TRL keeps it below stage 3);
    (b) stage 3 with the parameters and the optimizer on NVMe, policy and reference loaded by
    from_pretrained after the arguments (so built partitioned by transformers' hook: the
    reference runs in a forward-only engine of its own, frozen, as DeepSpeed's prepare_deepspeed
    gives it one, with its swap file beside the policy's, in a directory of its own);
    (c) stage 3 with the optimizer on cpu and a PEFT LoRA whose disabled adapters are the
    reference; (d) stage 3 with the parameters on NVMe, no reference model and
    precompute_ref_log_probs: TRL runs the policy over the dataset in its __init__, before the
    training engine exists, while the policy is still zero.Init's partitions (loaded after the
    arguments), so it gets a forward-only engine for that (as DeepSpeed's run an inference
    engine) and is zero.Init's again afterwards. Losses, grad norms and TRL's reward metrics as
    TRL has them."""
    saved = tmp_path / "base"
    tiny_llama().save_pretrained(saved)

    def models():
        if case == "stage3-precompute":
            return transformers.LlamaForCausalLM.from_pretrained(saved), {}
        if case == "stage3-ref-model":
            return (transformers.LlamaForCausalLM.from_pretrained(saved),
                    {"ref_model": transformers.LlamaForCausalLM.from_pretrained(saved)})
        if case == "stage2-ref-model":
            return tiny_llama(), {"ref_model": tiny_llama()}
        return tiny_llama(), {"peft_config": lora_config()}

    (tmp_path / "nvme").mkdir()
    cfgs = {"stage2-ref-model": ds_config(2), "stage3-peft": ds_config(3, offload_optimizer="cpu"),
            "stage3-ref-model": ds_config(3, offload_optimizer="nvme", offload_param="nvme",
                                          nvme=tmp_path / "nvme"),
            "stage3-precompute": ds_config(3, offload_param="nvme", nvme=tmp_path / "nvme")}
    precompute = {"precompute_ref_log_probs": case == "stage3-precompute"}
    model, ctor = models()
    _, ref = train("DPOTrainer", tmp_path / "ref", model=model, max_steps=4, **precompute,
                   trainer_kw={"train_dataset": preference_dataset(), **ctor})
    args = strl.DPOConfig(deepspeed=cfgs[case],
                          **config_kw(tmp_path / "st", max_steps=4, **precompute))
    model, ctor = models()  # after the stage-3 arguments: built partitioned
    if case in ("stage3-ref-model", "stage3-precompute"):
        assert all(hasattr(p, "_strata_part") for m in (model, *ctor.values())
                   for p in m.parameters())
    trainer = strl.DPOTrainer(model=model, args=args, processing_class=tokenizer(),
                              train_dataset=preference_dataset(), **ctor)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert_same_curve(logs, ref, metrics=("rewards/chosen", "rewards/rejected",
                                          "rewards/margins", "logps/chosen"))
    assert any(abs(l["rewards/margins"]) > 1e-4 for l in logs[1:])  # the policy moved
    references = trainer.__dict__.get("_strata_frozen_engines", {})
    if case == "stage3-ref-model":
        assert list(references) == ["reference"]
        engine = references["reference"]
        assert engine.module is trainer.ref_model
        assert not any(p.requires_grad for p in trainer.ref_model.parameters())
        assert all(p.numel() == 0 for p in trainer.ref_model.parameters())  # partitioned
        swaps = sorted(str(f.relative_to(tmp_path / "nvme"))
                       for f in (tmp_path / "nvme").rglob("*.swp"))
        assert swaps == ["strata-reference/strata-swap-rank0.swp", "strata-swap-rank0.swp"]
    else:
        assert references == {}
    if case == "stage3-precompute":  # the policy's forward-only engine ran and was closed
        assert "ref_chosen_logps" in trainer.train_dataset.column_names
        assert sorted(str(f.relative_to(tmp_path / "nvme"))
                      for f in (tmp_path / "nvme").rglob("*")) == [
            "strata-precompute", "strata-swap-rank0.swp"]


def test_a_notebook_cell_run_again_trains_with_the_same_nvme_path(tmp_path):
    """`trainer = DPOTrainer(...); trainer.train()` run twice in one process, both on NVMe: the
    second reference engine is built while the first trainer is still referenced, so it takes
    strata-reference-2 (the first one's directory is in use); by the second train() the first
    trainer is unreferenced, its engines are collected and the policy's nvme_path is free."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = ds_config(3, offload_optimizer="nvme", offload_param="nvme", nvme=nvme)
    for run in range(2):
        trainer = strl.DPOTrainer(model=tiny_llama(), ref_model=tiny_llama(),
                                  args=strl.DPOConfig(deepspeed=cfg, **config_kw(
                                      tmp_path / str(run), max_steps=2)),
                                  processing_class=tokenizer(),
                                  train_dataset=preference_dataset(8))
        trainer.train()
        assert trainer.state.global_step == 2
    assert sorted(str(f.relative_to(nvme)) for f in nvme.rglob("*.swp")) == [
        "strata-reference-2/strata-swap-rank0.swp", "strata-swap-rank0.swp"]


def test_kto_with_a_reference_model_at_stage_3_matches_trl(tmp_path):
    """KTOTrainer (unpaired desirable / undesirable completions) with a separate reference
    model at stage 3, the parameters on cpu: the reference gets a forward-only engine as DPO's
    does; losses and grad norms as TRL's own."""
    def kw():
        g = torch.Generator().manual_seed(4)
        ds = datasets.Dataset.from_dict({"prompt": [words(g, 5) for _ in range(32)],
                                         "completion": [words(g, 4) for _ in range(32)],
                                         "label": [bool(i % 2) for i in range(32)]})
        return dict(max_steps=4, trainer_kw={"train_dataset": ds, "ref_model": tiny_llama()})
    _, ref = train("KTOTrainer", tmp_path / "ref", **kw())
    trainer, logs = train("KTOTrainer", tmp_path / "st", ds_config(3, offload_param="cpu"), **kw())
    assert list(trainer._strata_frozen_engines) == ["reference"]
    assert_same_curve(logs, ref)


SYNC = dict(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)


def test_dpo_sync_ref_model_at_stage_3_matches_trl(tmp_path):
    """sync_ref_model: every 2 steps the reference becomes half itself, half the policy (TRL's
    SyncRefModelCallback). At stage 3 both are partitioned, each in its engine: they are gathered
    with modifier_rank 0 as DeepSpeed's run gathers them, and the reference's engine takes the
    mixed values; the DPO curve after the syncs and the reference's final weights as TRL's."""
    kw = dict(max_steps=4, **SYNC)
    ref_trainer, ref = train("DPOTrainer", tmp_path / "ref", **kw, trainer_kw={
        "train_dataset": preference_dataset(), "ref_model": tiny_llama(seed=3)})
    trainer, logs = train("DPOTrainer", tmp_path / "st", ds_config(3, offload_param="cpu"), **kw,
                          trainer_kw={"train_dataset": preference_dataset(),
                                      "ref_model": tiny_llama(seed=3)})
    assert_same_curve(logs, ref, metrics=("rewards/margins", "logps/chosen"))
    mixed = trainer._strata_frozen_engines["reference"].read_master()
    unmixed = dict(tiny_llama(seed=3).named_parameters())
    for name, p in ref_trainer.ref_model.named_parameters():
        assert not torch.equal(p.detach(), unmixed[name].detach()), name  # synced twice
        torch.testing.assert_close(mixed[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_grpo_matches_trl(tmp_path):
    """GRPOTrainer (online RL: the policy samples completions with model.generate, a reward
    function scores them, the group-relative advantages weight the loss) at stage 3 with the
    optimizer and the parameters on cpu: generation runs through strata's per-module gathers;
    the sampled completions (same seed), rewards, losses and grad norms as TRL's own."""
    g = torch.Generator().manual_seed(3)
    prompts = datasets.Dataset.from_dict({"prompt": [words(g, 4) for _ in range(16)]})

    def run(lib, **extra):
        kw = config_kw(tmp_path / lib.__name__, max_steps=3, gradient_accumulation_steps=1,
                       num_generations=4, max_completion_length=8)
        del kw["max_length"]  # GRPO has max_completion_length instead
        args = lib.GRPOConfig(**extra, **kw)
        trainer = lib.GRPOTrainer(model=tiny_llama(), args=args, train_dataset=prompts,
                                  processing_class=tokenizer(), reward_funcs=count_reward)
        trainer.train()
        return trainer, [h for h in trainer.state.log_history if "loss" in h]

    _, ref = run(trl)
    trainer, logs = run(strl, deepspeed=ds_config(3, offload_optimizer="cpu",
                                                  offload_param="cpu"))
    assert trainer.strata_engine is not None
    assert_same_curve(logs, ref, metrics=("reward", "reward_std"))


def test_grpo_with_peft_config_matches_trl(tmp_path):
    """GRPOTrainer(peft_config=...) at stage 3: TRL's generation unwraps trainer.model_wrapped
    (the engine) with the Trainer's accelerator and reads the PeftModel's
    is_gradient_checkpointing, which the engine does not list: the accelerator takes the
    engine to its module as accelerate takes a DeepSpeed engine."""
    peft = pytest.importorskip("peft")

    def run(lib, **extra):
        kw = config_kw(tmp_path / lib.__name__, max_steps=2, gradient_accumulation_steps=1,
                       num_generations=4, max_completion_length=8)
        del kw["max_length"]
        trainer = lib.GRPOTrainer(model=tiny_llama(), args=lib.GRPOConfig(**extra, **kw),
                                  train_dataset=prompt_dataset(), processing_class=tokenizer(),
                                  reward_funcs=count_reward, peft_config=lora_config())
        trainer.train()
        return trainer, [h for h in trainer.state.log_history if "loss" in h]

    _, ref = run(trl)
    trainer, logs = run(strl, deepspeed=ds_config(3, offload_optimizer="cpu"))
    assert isinstance(trainer.model, peft.PeftModel) and trainer.strata_engine is not None
    assert_same_curve(logs, ref, metrics=("reward",))


def prompt_dataset(n=16):
    g = torch.Generator().manual_seed(3)
    return datasets.Dataset.from_dict({"prompt": [words(g, 4) for _ in range(n)]})


def online_kw(out, **kw):
    """An online trainer's arguments: completions of 8 tokens, one micro-batch per step."""
    base = config_kw(out, max_steps=3, gradient_accumulation_steps=1, max_completion_length=8,
                     model_init_kwargs={"dtype": torch.float32}, **kw)
    del base["max_length"]  # online trainers have max_completion_length instead
    return base


def online_against_trl(tmp_path, name, model, config_kw=None, **ctor):
    """An online trainer `name` of `model` (a path, or a function making the model) on
    prompt_dataset() run by TRL, then by strata at stage 3 with the optimizer on cpu and the
    parameters on NVMe: (strata's trainer, its logs, TRL's logs, the nvme path)."""
    def run(lib, out, **extra):
        args = getattr(lib, name.replace("Trainer", "Config"))(
            **extra, **(config_kw or {}), **online_kw(out))
        trainer = getattr(lib, name)(model=model if isinstance(model, str) else model(),
                                     args=args, train_dataset=prompt_dataset(),
                                     processing_class=tokenizer(), **ctor)
        trainer.train()
        return trainer, [h for h in trainer.state.log_history if "loss" in h]

    _, ref = run(trl, tmp_path / "ref")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    trainer, logs = run(strl, tmp_path / "st", deepspeed=ds_config(
        3, offload_optimizer="cpu", offload_param="nvme", nvme=nvme))
    return trainer, logs, ref, nvme


def test_distillation_with_a_teacher_path_at_stage_3_matches_trl(tmp_path):
    """DistillationTrainer (on-policy: the student generates, a generalized JSD against the
    teacher's next-token distribution through TRL's chunked divergence, which reads both
    lm_head weights directly and again in its backward) with the teacher given as a path: TRL
    loads it after the stage-3 arguments, so it is built partitioned, and it gets a frozen
    forward-only engine of its own, parameters on NVMe in a strata-teacher directory. The
    student's losses, grad norms and TRL's metrics as TRL's own."""
    tiny_llama(seed=5).save_pretrained(tmp_path / "teacher")
    trainer, logs, ref, nvme = online_against_trl(
        tmp_path, "DistillationTrainer", tiny_llama, teacher_model=str(tmp_path / "teacher"))
    assert_same_curve(logs, ref, metrics=("entropy", "completions/mean_length"))
    (engine,) = trainer._strata_frozen_engines.values()
    assert list(trainer._strata_frozen_engines) == ["teacher"]
    assert engine.module is trainer.teacher_model
    assert all(p.numel() == 0 and not p.requires_grad
               for p in trainer.teacher_model.parameters())
    swaps = sorted(str(f.relative_to(nvme)) for f in nvme.rglob("*.swp"))
    assert swaps == ["strata-swap-rank0.swp", "strata-teacher/strata-swap-rank0.swp"]


def test_rloo_with_a_reward_model_and_a_reference_at_stage_3_matches_trl(tmp_path):
    """RLOOTrainer given paths, as its users give hub ids: the policy, a reward model
    (LlamaForSequenceClassification with its tokenizer) beside a reward function, and beta > 0,
    for which TRL loads a reference model from the policy's path. At stage 3 with the
    parameters on NVMe the reference and the reward model each get a frozen engine of its own
    (strata-reference, strata-reward-0); the sampled completions' rewards, the KL to the
    reference, the grad norms as TRL's own (RLOO's loss is a mean of leave-one-out advantages,
    zero up to rounding)."""
    tiny_llama().save_pretrained(tmp_path / "policy")
    tiny_reward_model(9).save_pretrained(tmp_path / "reward")
    tokenizer().save_pretrained(tmp_path / "reward")

    def length_penalty(completions, **kw):
        return [-0.1 * len(c.split()) for c in completions]

    trainer, logs, ref, nvme = online_against_trl(
        tmp_path, "RLOOTrainer", str(tmp_path / "policy"),
        config_kw={"num_generations": 4, "beta": 0.1},
        reward_funcs=[str(tmp_path / "reward"), length_penalty])
    assert len(logs) == len(ref) == 3
    for key in ("grad_norm", "reward", "reward_std", "kl", "learning_rate"):
        assert [l[key] for l in logs] == pytest.approx([l[key] for l in ref], rel=1e-3,
                                                       abs=1e-6), key
    assert any(abs(l["kl"]) > 1e-4 for l in logs)  # the policy left the reference
    engines = trainer._strata_frozen_engines
    assert sorted(engines) == ["reference", "reward-0"]
    assert engines["reference"].module is trainer.ref_model
    assert engines["reward-0"].module is trainer.reward_funcs[0]
    swaps = sorted(str(f.relative_to(nvme)) for f in nvme.rglob("*.swp"))
    assert swaps == ["strata-reference/strata-swap-rank0.swp",
                     "strata-reward-0/strata-swap-rank0.swp", "strata-swap-rank0.swp"]


def count_reward(completions, **kw):
    """GRPO's reward in these tests: w7s counted, length penalised."""
    return [float(c.count("w7")) - 0.1 * len(c.split()) for c in completions]


def count_gathers(patch) -> list:
    """The groups the engines gather (a released group made whole again), appended to the list
    returned from now on; patch: monkeypatch.setattr, or setattr in a worker process."""
    import strata.engine as strata_engine
    gathers = []
    acquire = strata_engine.StrataEngine._acquire

    def counting(self, groups):
        groups = tuple(groups)
        gathers.extend(g for g in groups
                       if self._refs[g] == 0 and not self._engine.is_gathered(g))
        return acquire(self, groups)

    patch(strata_engine.StrataEngine, "_acquire", counting)
    return gathers


def grpo_gathering(out, gather: bool):
    """strata's GRPOTrainer at stage 3 (the parameters on cpu), ds3_gather_for_generation=gather,
    trained: (trainer, logged steps)."""
    args = strl.GRPOConfig(deepspeed=ds_config(3, offload_param="cpu"),
                           **online_kw(out, num_generations=4, ds3_gather_for_generation=gather))
    trainer = strl.GRPOTrainer(model=tiny_llama(), args=args, train_dataset=prompt_dataset(),
                               processing_class=tokenizer(), reward_funcs=count_reward)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def test_grpo_gathers_the_whole_model_once_per_generation(tmp_path, monkeypatch):
    """ds3_gather_for_generation (TRL's default True): as DeepSpeed's run gathers the ZeRO-3
    policy once around model.generate, so does strata's engine; the per-module hooks then find
    their groups gathered, where with False each generated token gathers every module again.
    The same samples, losses and grad norms either way, with far fewer gathers."""
    gathers = count_gathers(monkeypatch.setattr)
    runs = {}
    for gather in (True, False):
        gathers.clear()
        _, logs = grpo_gathering(tmp_path / str(gather), gather)
        runs[gather] = (logs, len(gathers))
    (logs, once), (ref, per_token) = runs[True], runs[False]
    assert_same_curve(logs, ref, metrics=("reward", "completions/mean_length"))
    assert 0 < 2 * once < per_token, (once, per_token)


def experimental_run(module, name, cfg, config, **kw):
    """(trainer, logs) of trl.experimental's trainer `name` of `module`: TRL's own (cfg None),
    else made by strata_class, with the DeepSpeed config cfg."""
    trainer_cls = getattr(module, name + "Trainer")
    config_cls = getattr(module, name + "Config")
    extra = {}
    if cfg is not None:
        trainer_cls, config_cls = strl.strata_class(trainer_cls), strl.strata_class(config_cls)
        extra = {"deepspeed": cfg}
    trainer = trainer_cls(model=tiny_llama(), args=config_cls(**extra, **config), **kw)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h]


def test_experimental_orpo_through_strata_class(tmp_path):
    """trl.experimental's trainers, which this module's names do not reach, made by
    strata_class (one class per class): ORPO (odds-ratio preference, no reference) at stage 3
    with the optimizer and parameters on cpu; losses, grad norms and its log-odds as TRL's."""
    orpo = pytest.importorskip("trl.experimental.orpo")
    assert strl.strata_class(orpo.ORPOTrainer) is strl.strata_class(orpo.ORPOTrainer)
    assert issubclass(strl.strata_class(orpo.ORPOConfig), st.TrainingArguments)

    def kw(out):
        return dict(config=config_kw(out, max_steps=4), processing_class=tokenizer(),
                    train_dataset=preference_dataset())
    _, ref = experimental_run(orpo, "ORPO", None, **kw(tmp_path / "ref"))
    _, logs = experimental_run(orpo, "ORPO", ds_config(3, offload_optimizer="cpu",
                                                       offload_param="cpu"), **kw(tmp_path / "st"))
    assert_same_curve(logs, ref, metrics=("log_odds_ratio",))


def test_experimental_online_dpo_whose_training_step_calls_accelerator_backward(tmp_path):
    """trl.experimental's OnlineDPOTrainer replaces training_step and calls
    accelerator.backward itself, as under DeepSpeed: the Trainer's accelerator runs the
    engine's backward and, at the accumulation boundary, its step (DeepSpeedEngineWrapper's
    rule); losses and grad norms as TRL's own at stage 2."""
    od = pytest.importorskip("trl.experimental.online_dpo")

    def kw(out):
        cfg = config_kw(out, max_steps=3, gradient_accumulation_steps=1, max_new_tokens=8)
        del cfg["max_length"]
        torch.manual_seed(3)
        return dict(config=cfg, ref_model=tiny_llama(), reward_funcs=[tiny_reward_model(9)],
                    reward_processing_classes=[tokenizer()], processing_class=tokenizer(),
                    train_dataset=prompt_dataset())
    _, ref = experimental_run(od, "OnlineDPO", None, **kw(tmp_path / "ref"))
    trainer, logs = experimental_run(od, "OnlineDPO", ds_config(2), **kw(tmp_path / "st"))
    assert trainer.strata_engine.global_steps == 3
    assert_same_curve(logs, ref)


def test_experimental_gkd_with_a_teacher_path_through_strata_class(tmp_path):
    """trl.experimental's GKD (generalized knowledge distillation on chat messages, half of the
    batches generated on-policy) made by strata_class, its teacher given as a path: built
    partitioned after the stage-3 arguments and run in a frozen engine of its own. Losses and
    grad norms as TRL's own."""
    gkd = pytest.importorskip("trl.experimental.gkd")
    tiny_llama(seed=5).save_pretrained(tmp_path / "teacher")
    chat = tokenizer()
    chat.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    g = torch.Generator().manual_seed(6)
    messages = datasets.Dataset.from_dict({"messages": [
        [{"role": "user", "content": words(g, 4)}, {"role": "assistant", "content": words(g, 4)}]
        for _ in range(16)]})

    def kw(out):
        config = config_kw(out, max_steps=3, gradient_accumulation_steps=1, lmbda=0.5,
                           max_new_tokens=6)
        del config["max_length"]
        return dict(config=config, processing_class=chat, train_dataset=messages,
                    teacher_model=str(tmp_path / "teacher"))
    _, ref = experimental_run(gkd, "GKD", None, **kw(tmp_path / "ref"))
    trainer, logs = experimental_run(gkd, "GKD", ds_config(3, offload_param="cpu"),
                                     **kw(tmp_path / "st"))
    assert_same_curve(logs, ref)
    assert list(trainer._strata_frozen_engines) == ["teacher"]


def test_grpo_on_two_processes_generates_with_and_without_the_whole_policy_gathered(tmp_path):
    """trl_grpo_worker on 2 ranks: GRPO at stage 3 with the policy partitioned over the ranks,
    each generating for its share of the prompts, with ds3_gather_for_generation True and False.
    Both runs end (the per-token gathers are collectives the ranks keep in step) with the same
    logged steps and weights, both ranks' weights bit-equal; gathering the whole policy once per
    generation makes fewer than half the gathers."""
    from launch import launch
    from test_hf_trainer import free_port
    with pytest.MonkeyPatch.context() as mp:  # accelerate initialises torch.distributed
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        outs = launch(tmp_path, "trl_grpo_worker.py", lambda r, nvme: [tmp_path], world=2,
                      timeout_s=280)
    for rc, out in outs:
        assert rc == 0, out
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for gather in (True, False):
        for n, p in res[0][gather]["master"].items():
            assert torch.equal(p, res[1][gather]["master"][n]), (gather, n)
            assert torch.equal(p, res[0][not gather]["master"][n]), (gather, n)
    assert_same_curve(res[0][True]["logs"], res[0][False]["logs"], metrics=("reward",))
    assert len(res[0][True]["logs"]) == 3
    assert 0 < 2 * res[0][True]["gathers"] < res[0][False]["gathers"]


def test_reward_trainer_matches_trl(tmp_path):
    """RewardTrainer on chosen / rejected pairs: a LlamaForSequenceClassification (one score per
    sequence, read at its last non-pad token) at stage 3 with the optimizer on cpu; the
    Bradley-Terry losses, grad norms and TRL's accuracy as TRL's own. (The model is built before
    the stage-3 arguments: after them transformers builds its inner model under zero.Init and
    initialises it module by module, other random values than a plain construction's, with
    DeepSpeed as with strata.)"""
    def kw():
        return dict(max_steps=4, trainer_kw={
            "train_dataset": preference_dataset().remove_columns(["prompt"])})
    _, ref = train("RewardTrainer", tmp_path / "ref", model=tiny_reward_model(0), **kw())
    _, logs = train("RewardTrainer", tmp_path / "st", ds_config(3, offload_optimizer="cpu"),
                    model=tiny_reward_model(0), **kw())
    assert_same_curve(logs, ref, metrics=("accuracy", "margin"))


def test_sft_checkpoint_resume_continues_as_the_uninterrupted_run(tmp_path, sft_reference):
    """save_steps=3: the checkpoint holds the engine's state beside TRL's and transformers' files
    (training_args.bin: the pickled strata SFTConfig, which loads as that class with its
    config); resuming from it in a new trainer gives the uninterrupted run's last three steps."""
    cfg = ds_config(3, offload_optimizer="cpu")
    out = tmp_path / "st"
    train("SFTTrainer", out, cfg, save_strategy="steps", save_steps=3, **sft_kw())
    ckpt = out / "checkpoint-3"
    assert (ckpt / "latest").is_file()
    args = torch.load(ckpt / "training_args.bin", weights_only=False)
    # The arguments' precision (fp32) applied, as accelerate applies it.
    want = {**cfg, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    assert type(args) is strl.SFTConfig and args.strata_config == want
    _, logs = train("SFTTrainer", out, cfg, resume=str(ckpt), **sft_kw())
    assert [l["step"] for l in logs] == [1, 2, 3, 4, 5, 6]  # 1-3 from the checkpoint's state
    assert_same_curve(logs, sft_reference)


def test_with_strata_classes():
    """One class per class, between the library's class and transformers' in the MRO; strata's
    own and an already made class are returned as they are; other classes are refused, as are
    names trl lacks or that are not trainers or their arguments. Without `deepspeed` the made
    classes train as trl's (no engine)."""
    made = strl.SFTTrainer
    assert made is st.with_strata(trl.SFTTrainer, strata_trainer=strl._Trainer)
    assert st.with_strata(made) is made
    mro = made.__mro__
    assert mro.index(trl.SFTTrainer) < mro.index(st.Trainer) < mro.index(transformers.Trainer)
    plain = st.with_strata(trl.SFTTrainer)  # strata's own Trainer in between
    assert plain is st.with_strata(trl.SFTTrainer) and strl._Trainer not in plain.__mro__
    assert st.Trainer in plain.__mro__
    with pytest.raises(TypeError, match="strata_trainer"):
        st.with_strata(trl.DPOTrainer, strata_trainer=transformers.Trainer)
    cfg = strl.SFTConfig
    assert issubclass(cfg, trl.SFTConfig) and issubclass(cfg, st.TrainingArguments)
    assert st.with_strata(st.Trainer) is st.Trainer
    with pytest.raises(TypeError, match="not a subclass"):
        st.with_strata(dict)
    with pytest.raises(TypeError, match="not a class"):
        st.with_strata(trl.SFTTrainer(model=tiny_llama(), args=trl.SFTConfig(**config_kw(
            "unused")), processing_class=tokenizer(), train_dataset=text_dataset(4)).args)
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchTrainer'"):
        strl.NoSuchTrainer  # noqa: B018
    with pytest.raises(AttributeError, match="neither a Trainer nor a TrainingArguments"):
        strl.ModelConfig  # noqa: B018


def test_without_a_config_the_made_trainer_is_trls(tmp_path, sft_reference):
    args = strl.SFTConfig(**config_kw(tmp_path))
    assert args.strata_config is None
    trainer = strl.SFTTrainer(model=tiny_llama(), args=args, processing_class=tokenizer(),
                              train_dataset=text_dataset())
    trainer.train()
    assert trainer.strata_engine is None
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [l["loss"] for l in logs] == pytest.approx([l["loss"] for l in sft_reference],
                                                      rel=1e-6)


def test_dpo_on_two_processes_matches_one_with_twice_the_batch(tmp_path):
    """trl_dist_worker on 2 ranks: DPO at stage 3, policy and reference partitioned over the
    ranks (the reference's engine all-gathers each module for its forward as the policy's does);
    accelerate gives each rank every other micro-batch, the engine averages the gradients, so a
    step is TRL's own with per_device_train_batch_size doubled in one process. sync_ref_model
    mixes the policy into the reference every 2 steps (both gathered with modifier_rank 0,
    rank 0's mix broadcast). The same logged losses and DPO metrics, both ranks' weights
    bit-equal and equal to the one process's, the reference's too."""
    from launch import launch
    from test_hf_trainer import free_port
    saved = tmp_path / "base"
    tiny_llama().save_pretrained(saved)
    with pytest.MonkeyPatch.context() as mp:  # accelerate initialises torch.distributed
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        outs = launch(tmp_path, "trl_dist_worker.py", lambda r, nvme: [tmp_path, saved],
                      world=2, timeout_s=280)
    for rc, out in outs:
        assert rc == 0, out
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(r["references"] == 1 for r in res)
    ref_trainer, ref = train("DPOTrainer", tmp_path / "ref",
                             model=transformers.LlamaForCausalLM.from_pretrained(saved),
                             max_steps=4, per_device_train_batch_size=8, **SYNC,
                             trainer_kw={"train_dataset": preference_dataset(),
                                         "ref_model": transformers.LlamaForCausalLM
                                         .from_pretrained(saved)})
    assert_same_curve(res[0]["logs"], ref, metrics=("rewards/margins", "logps/chosen"))
    # Adam (lr 1e-2, eps 1e-8) turns the summation order of a near-zero gradient element into
    # up to 1.3e-4 of weight (measured over runs, a different element each time); the weights
    # move by up to 2.5e-2 in these four steps.
    for key, model in (("master", ref_trainer.model), ("reference", ref_trainer.ref_model)):
        params = dict(model.named_parameters())
        for n, p in res[0][key].items():
            assert torch.equal(p, res[1][key][n]), n
            torch.testing.assert_close(p, params[n].detach().float(), rtol=0, atol=5e-4,
                                       msg=lambda m: f"{key} {n}: {m}")


def test_trl_parser_takes_the_made_config(tmp_path):
    """TRL's example scripts parse their arguments with TrlParser((ScriptArguments, SFTConfig,
    ModelConfig)): with strata's SFTConfig there, `--deepspeed ds.json` on the command line
    becomes the strata config and the rest parses as TRL's."""
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(2, offload_optimizer="cpu")))
    parser = trl.TrlParser((trl.ScriptArguments, strl.SFTConfig, trl.ModelConfig))
    script, args, model_args = parser.parse_args_and_config([
        "--dataset_name", "unused", "--output_dir", str(tmp_path), "--deepspeed", str(path),
        "--use_cpu", "--learning_rate", "2e-5", "--max_length", "64"])
    assert type(args) is strl.SFTConfig
    # SFTConfig's bf16=True (TRL's default) applied to the config, as accelerate applies it.
    want = {**ds_config(2, offload_optimizer="cpu"), "bf16": {"enabled": True},
            "fp16": {"enabled": False}}
    assert args.bf16 and args.strata_config == want and args.deepspeed is None
    assert args.learning_rate == 2e-5 and args.max_length == 64
