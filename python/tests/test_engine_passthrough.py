"""DeepSpeedEngine's attribute pass-through on strata's engine: a name the engine does not define
is the module's (engine.generate, engine.config, engine.gradient_checkpointing_enable(), ...),
the engine's own names come first, and DeepSpeed's config accessors and destroy() exist. Scripts
written for a DeepSpeed engine use all of these; the model is transformers' GPT-2."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strata  # noqa: E402
import strata.engine  # noqa: E402

VOCAB = 64


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def ds_config(stage, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    cfg.update(extra)
    return cfg


def start(model, cfg):
    engine, *_ = strata.initialize(model=model, config=cfg, model_parameters=model.parameters(),
                                   device="cpu")
    return engine


def train_step(engine, ids):
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    return out.loss.item()


def checkpointing(model):
    """transformers' flag, under its name before and after 5.x renamed it."""
    flag = getattr(type(model), "is_activation_checkpointing", None)
    return model.is_activation_checkpointing if flag is not None else model.is_gradient_checkpointing


def greedy(model, ids):
    return model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_modules_names_reach_through_the_engine(stage):
    model = gpt2()
    twin = copy.deepcopy(model)
    engine = start(model, ds_config(stage))
    try:
        assert engine.config is model.config
        assert engine.get_input_embeddings() is model.get_input_embeddings()
        prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
        engine.eval()
        twin.eval()
        # generate() runs the module's forward outside engine.forward: at stage 3 the hooks
        # gather each layer for it, and it sees the weights torch's copy has.
        assert torch.equal(greedy(engine, prompt), greedy(twin, prompt))

        engine.train()
        ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
        for _ in range(3):
            train_step(engine, ids)
        with engine.gathered_parameters():
            trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        twin.load_state_dict(trained)
        assert not torch.equal(trained["transformer.h.0.attn.c_attn.weight"],
                               gpt2().state_dict()["transformer.h.0.attn.c_attn.weight"])
        engine.eval()
        assert torch.equal(greedy(engine, prompt), greedy(twin, prompt))
    finally:
        engine.destroy()


class Custom(torch.nn.Module):
    """A module with a name the engine also defines (step), one it does not (describe), and a
    property that fails with an AttributeError, which must surface as the module's."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.tag = "custom"

    def forward(self, x):
        return self.lin(x)

    def step(self):
        return "module step"

    def describe(self, suffix):
        return f"{self.tag}-{suffix}"

    @property
    def broken(self):
        return self.missing_inside_the_property


def test_the_engines_own_names_come_first_and_a_missing_name_is_named():
    model = Custom()
    engine = start(model, ds_config(3))
    try:
        assert engine.step.__func__ is type(engine).step  # the engine's, not the module's
        assert engine.forward.__func__ is type(engine).forward
        assert engine.describe("x") == "custom-x"
        model.tag = "changed"  # read through, not copied at initialize
        assert engine.tag == "changed" and engine.describe("y") == "changed-y"
        assert engine.lin is model.lin
        with pytest.raises(AttributeError, match="'StrataEngine' object has no attribute 'nope'"):
            engine.nope
        with pytest.raises(AttributeError) as direct:
            model.broken
        with pytest.raises(AttributeError) as through:
            engine.broken  # the module's own error, not the engine's "no attribute"
        assert str(through.value) == str(direct.value)
        assert not hasattr(engine, "nope")
        with pytest.raises(AttributeError):
            engine.__no_such_dunder__
    finally:
        engine.destroy()


def test_gradient_checkpointing_enabled_through_the_engine_trains_as_on_the_model():
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    runs = []
    for through_engine in (False, True):
        model = gpt2()
        if not through_engine:
            model.gradient_checkpointing_enable()
        engine = start(model, ds_config(3))
        if through_engine:
            engine.gradient_checkpointing_enable()
        assert checkpointing(model)
        losses = [train_step(engine, ids) for _ in range(3)]
        with engine.gathered_parameters():
            runs.append((losses, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        engine.destroy()
    (la, pa), (lb, pb) = runs
    assert la == lb
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_deepspeeds_config_accessors(tmp_path):
    engine = start(Custom(), ds_config(
        2, gradient_clipping=0.5, steps_per_print=7, dataloader_drop_last=True,
        wall_clock_breakdown=True,
        zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}))
    try:
        assert engine.gradient_clipping() == 0.5 and engine.steps_per_print() == 7
        assert engine.dataloader_drop_last() and engine.wall_clock_breakdown()
        assert engine.zero_optimization() and engine.zero_optimization_partition_gradients()
        assert not engine.zero_optimization_partition_weights()
        assert engine.zero_cpu_offload() and engine.zero_offload_optimizer()["device"] == "cpu"
        assert engine.zero_offload_param() is None
        assert not engine.zero_gather_16bit_weights_on_model_save()
        assert engine.zero_reduce_bucket_size() == engine.zero_allgather_bucket_size() == 5e8
        assert not engine.zero_overlap_comm() and engine.zero_contiguous_gradients()
        assert engine.zero_reduce_scatter() and engine.gradient_predivide_factor() == 1.0
        assert not (engine.memory_breakdown() or engine.flops_profiler_enabled()
                    or engine.sparse_gradients_enabled() or engine.amp_enabled()
                    or engine.has_moe_layers)
        assert engine.communication_data_type == torch.float32  # the working dtype
        assert engine.get_batch_info() == (2, 2, 1)
    finally:
        engine.destroy()

    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    engine = start(Custom(), ds_config(3, zero_optimization={
        "stage": 3, "offload_optimizer": nvme, "offload_param": {"device": "cpu"},
        "stage3_gather_16bit_weights_on_model_save": True, "overlap_comm": True,
        "reduce_bucket_size": 1000}, communication_data_type="bf16",
        flops_profiler={"enabled": True}))
    try:
        assert engine.zero_optimization_partition_weights() and not engine.zero_cpu_offload()
        assert engine.zero_offload_optimizer()["device"] == "nvme"
        assert engine.zero_offload_param()["device"] == "cpu"
        assert engine.zero_gather_16bit_weights_on_model_save()
        assert engine.gradient_clipping() == 0.0 and engine.steps_per_print() is None
        assert not engine.dataloader_drop_last() and not engine.wall_clock_breakdown()
        # DeepSpeed 0.19.8's defaults where the config is silent.
        assert (engine.zero_sub_group_size(), engine.zero_param_persistence_threshold(),
                engine.zero_max_live_parameters(), engine.zero_prefetch_bucket_size()) == (
                    1_000_000_000, 100_000, 1_000_000_000, 50_000_000)
        # Lowercased, as DeepSpeed does to the names of its own optimizers.
        assert engine.optimizer_name() == "adamw" and engine.optimizer_params()["lr"] == 1e-2
        assert engine.scheduler_name() is None and engine.scheduler_params() is None
        assert engine.zero_overlap_comm() and engine.zero_reduce_bucket_size() == 1000
        assert engine.communication_data_type == torch.bfloat16
        assert engine.flops_profiler_enabled()
        assert (engine.get_data_parallel_rank(), engine.get_model_parallel_rank(),
                engine.get_tensor_parallel_rank()) == (0, 0, 0)
        sd = engine.module_state_dict(prefix="m.")
        assert set(sd) == {"m." + k for k in engine.module.state_dict()}
    finally:
        engine.destroy()

    engine = start(Custom(), ds_config(0))
    try:
        assert not engine.zero_optimization() and engine.zero_offload_optimizer() is None
    finally:
        engine.destroy()


def test_destroy_removes_the_hooks_and_stage_0_keeps_the_trained_weights():
    model = gpt2()
    engine = start(model, ds_config(0))
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    train_step(engine, ids)
    engine.eval()
    with torch.no_grad():
        before = engine(input_ids=ids).logits
    engine.destroy()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_the_throughput_timer_counts_as_deepspeeds():
    """engine.tput_timer: started by each training forward, stopped by each step() (a global
    step at each accumulation boundary), timed from its start_step-th global step on."""
    model = Custom()
    cfg = ds_config(3, gradient_accumulation_steps=2)
    engine = start(model, cfg)
    try:
        timer = engine.tput_timer
        assert timer.batch_size == engine.train_batch_size() == 4
        assert timer.avg_samples_per_sec() == float("-inf")
        for _ in range(6):
            loss = engine(torch.ones(2, 4)).sum()
            engine.backward(loss)
            engine.step()
        assert (timer.micro_step_count, timer.global_step_count) == (6, 3)
        assert timer.total_elapsed_time > 0 and timer.avg_samples_per_sec() > 0
        timer.update_epoch_count()
        assert (timer.epoch_count, timer.micro_step_count) == (1, 0)
        engine.eval()  # an evaluation forward does not start it
        engine(torch.ones(2, 4))
        assert not timer.started
    finally:
        engine.destroy()

    ticks = iter([10.0, 10.5, 20.0, 21.5])
    timer = strata.utils.timer.ThroughputTimer(batch_size=8, start_step=1, clock=lambda: next(ticks))
    for _ in range(3):  # global step 1 untimed, then 0.5 s and 1.5 s
        timer.start()
        timer.stop(global_step=True)
    assert timer.total_elapsed_time == 2.0
    assert timer.avg_samples_per_sec() == 8 / (2.0 / 2)


def test_wall_clock_breakdown_times_and_logs_the_phases_as_deepspeed(capsys):
    """"wall_clock_breakdown": engine.timers times the forward, the backward (its autograd
    pass and its reduction) and the step under DeepSpeed's names, logged on rank 0 after each
    step() (the micro-step timers) and at each boundary (the global ones); a forward that raises
    leaves no timer running. Without the key nothing is timed, and a script's own timers work
    either way (strata.utils.timer, DeepSpeed's module path)."""
    from strata.utils.timer import STEP_GLOBAL_TIMER, SynchronizedWallClockTimer

    class Failing(Custom):
        def forward(self, x, fail=False):
            if fail:
                raise ValueError("bad input")
            return self.lin(x)

    cfg = ds_config(3, gradient_accumulation_steps=2)
    cfg["wall_clock_breakdown"] = True
    engine = start(Failing(), cfg)
    try:
        assert isinstance(engine.timers, SynchronizedWallClockTimer)
        with pytest.raises(ValueError, match="bad input"):
            engine(torch.ones(2, 4), fail=True)
        capsys.readouterr()
        for _ in range(4):
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
        lines = capsys.readouterr().out.splitlines()
        micro = [ln for ln in lines if "fwd_microstep" in ln]
        glob = [ln for ln in lines if "| fwd:" in ln]
        assert len(micro) == 4 and len(glob) == 2, lines
        for name in ("bwd_microstep", "bwd_inner_microstep", "bwd_allreduce_microstep",
                     "step_microstep"):
            assert all(name in ln for ln in micro), (name, micro)
        # DeepSpeed's log_dist prefix: the rank, -1 where torch.distributed is not started.
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
        assert all(ln.startswith(f"[Rank {rank}] time (ms) | ") for ln in micro + glob)
        timers = engine.get_wall_clock_timers()
        assert set(timers) == set(engine.engine_timers.active_timers())
        assert timers["bwd_microstep"] >= timers["bwd_inner_microstep"] > 0
        assert timers[STEP_GLOBAL_TIMER] > 0
        # A script's own timer on the engine's group.
        engine.timers("data").start()
        engine.timers("data").stop()
        assert engine.timers("data").elapsed() >= 0
        with pytest.raises(RuntimeError, match="data timer is not started"):
            engine.timers("data").stop()
    finally:
        engine.destroy()
    engine = start(Custom(), ds_config(3))
    try:
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        assert engine.get_wall_clock_timers() == {}
        assert "time (ms)" not in capsys.readouterr().out
        assert engine.timers.get_timers() == {}
    finally:
        engine.destroy()


def test_deepspeeds_module_paths_under_strata():
    """A script's `deepspeed` imports with that word changed: strata.ops.adam,
    strata.runtime.zero.partition_parameters (also read as attributes, as DeepSpeed-Chat's LoRA
    code does), strata.runtime.dataloader, strata.utils.logging and get_accelerator at the top
    level."""
    import strata as deepspeed
    from strata import get_accelerator
    from strata.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from strata.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    assert deepspeed.runtime.zero.partition_parameters.ZeroParamStatus is ZeroParamStatus
    assert ZeroParamStatus is strata.zero.ZeroParamStatus
    assert GatheredParameters is strata.zero.GatheredParameters
    assert get_accelerator() is strata.accelerator.get_accelerator()
    from strata.runtime.dataloader import RepeatingLoader
    from strata.utils.logging import log_dist, logger, set_log_level_from_string
    assert RepeatingLoader is strata.utils.RepeatingLoader and logger is strata.utils.logger
    assert log_dist is strata.utils.log_dist
    assert set_log_level_from_string is strata.utils.set_log_level_from_string
    for cls in (DeepSpeedCPUAdam, FusedAdam):
        model = Custom()
        opt = cls(model.parameters(), lr=0.25, betas=(0.8, 0.9), weight_decay=0.0)
        cfg = ds_config(3)
        del cfg["optimizer"]
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg,
                                                       device="cpu")
        try:
            assert optimizer.param_groups[0]["lr"] == 0.25
            assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)
        finally:
            engine.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_resizing_the_embeddings_after_initialize_is_refused_naming_the_parameter(stage):
    """model.resize_token_embeddings after initialize: at stage 3 (transformers in its ZeRO-3
    mode) it sets a new, whole parameter the engine does not hold, which would never train and
    differ per rank; at stages 0-2 it resizes the parameter in place, which failed later with a
    bare size mismatch. The next forward names the parameter; resizing before initialize
    trains."""
    from strata.integrations.transformers import HfDeepSpeedConfig
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    cfg = ds_config(stage)
    hf = HfDeepSpeedConfig(cfg) if stage == 3 else None  # noqa: F841 (kept alive: ZeRO-3 mode)
    engine = start(gpt2(), cfg)
    train_step(engine, ids)
    engine.module.resize_token_embeddings(VOCAB + 5)
    what = "was set on the model" if stage == 3 else r"changed shape from \(64, 32\) to \(69, 32\)"
    with pytest.raises(RuntimeError, match=r"'transformer\.wte\.weight' " + what +
                       r" after strata\.initialize, as model\.resize_token_embeddings"):
        engine(input_ids=ids, labels=ids)
    engine.close()
    model = gpt2()
    model.resize_token_embeddings(VOCAB + 5)
    engine = start(model, cfg)
    before = strata.utils.safe_get_full_fp32_param(model.transformer.wte.weight).clone()
    train_step(engine, ids)
    after = strata.utils.safe_get_full_fp32_param(model.transformer.wte.weight)
    assert after.shape == (VOCAB + 5, 32) and not torch.equal(before, after)
    engine.close()
