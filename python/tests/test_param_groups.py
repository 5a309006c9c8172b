"""Parameter groups, client optimizers and schedulers (strata/optim.py) in one process against the
same script in plain torch; two processes: test_distributed.py's "groups" cases."""
import math

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from models import batch, decay_groups, ds_config, make_model, reference, warmup  # noqa: E402

STEPS = 4
LR = 1e-2


def run(engine, kind="gpt", steps=STEPS):
    losses = []
    for step in range(steps):
        loss = engine(*batch(kind, step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def master_of(engine, model):
    master = engine.read_master()
    return {n: master[n] for n, _ in model.named_parameters() if n in master}


def assert_matches(losses, params, ref_losses, ref_params):
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, p in params.items():
        torch.testing.assert_close(p, ref_params[n], atol=2e-5, rtol=1e-4, msg=n)


def torch_losses(model, opt, kind, sched=None):
    """Plain torch over the same batches: each step's loss (the scheduler stepped after)."""
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*batch(kind, step))
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def client_config(stage, offload, tmp_path):
    cfg = ds_config(stage, offload, nvme_path=str(tmp_path))
    del cfg["optimizer"]  # the client brings it
    return cfg


CASES = [(0, "none"), (1, "cpu"), (2, "cpu"), (3, "none"), (3, "nvme")]


@pytest.mark.parametrize("stage,offload", CASES, ids=[f"stage{s}-{o}" for s, o in CASES])
def test_client_adamw_with_two_groups_and_lambdalr_matches_torch(stage, offload, tmp_path):
    model = make_model("gpt")
    opt = torch.optim.AdamW(decay_groups(model), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    engine, eng_opt, _, eng_sched = strata.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=client_config(stage, offload,
                                                                             tmp_path))
    assert eng_sched is sched and eng_opt.param_groups is opt.param_groups
    # A module whose weight and bias sit in two groups is two engine groups.
    names = [g.name for g in engine._groups]
    assert "blocks.0.proj" in names and "blocks.0.proj#1" in names
    losses = run(engine)
    ref_losses, ref_params = reference("gpt", STEPS, LR, 0.0, groups=True)
    assert_matches(losses, master_of(engine, model), ref_losses, ref_params)
    # The engine stepped the scheduler once per step, as DeepSpeed does.
    assert sched.last_epoch == STEPS and engine.get_lr() == [LR, 3e-3]
    engine.close()


def test_model_parameters_as_group_dicts_take_the_config_for_missing_keys(tmp_path):
    model = make_model("mlp")
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    engine, opt, _, _ = strata.initialize(model=model, model_parameters=groups,
                                          config=ds_config(2, "cpu", lr=LR, wd=0.05))
    losses = run(engine, "mlp")
    ref = make_model("mlp")
    ref_opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.dim() >= 2]},
                                 {"params": [p for p in ref.parameters() if p.dim() < 2],
                                  "weight_decay": 0.0}], lr=LR, weight_decay=0.05)
    ref_losses = torch_losses(ref, ref_opt, "mlp")
    assert_matches(losses, master_of(engine, model), ref_losses, dict(ref.named_parameters()))
    assert [g["lr"] for g in opt.param_groups] == [LR, LR]
    engine.close()


def _cosine_ratio(t, warmup_steps=3, total=6):
    """DeepSpeed 0.19's WarmupCosineLR ratio at last_batch_iteration t, linear warmup from 0 and
    cos_min_ratio 0 (written out here, apart from the engine's rule)."""
    if t < 0:
        return 0.0
    if t < warmup_steps:
        return t / warmup_steps
    progress = min(1.0, (t - warmup_steps + 1) / max(1, total - warmup_steps))
    return (1 + math.cos(math.pi * progress)) / 2


SCHEDULES = {  # the config's section, and its factor on each group's own lr at t
    "WarmupCosineLR": ({"total_num_steps": 6, "warmup_num_steps": 3, "warmup_type": "linear",
                        "cos_min_ratio": 0.0}, _cosine_ratio),
    "WarmupLR": ({"warmup_num_steps": 3, "warmup_type": "linear"},  # no warmup_max_lr
                 lambda t: 0.0 if t < 0 else min(1.0, t / 3)),
}
GROUP_CASES = [("WarmupCosineLR", 0, False), ("WarmupCosineLR", 3, True), ("WarmupLR", 2, False),
               ("WarmupLR", 3, True)]


@pytest.mark.parametrize("schedule,stage,client", GROUP_CASES,
                         ids=[f"{n}-stage{s}-{'client' if c else 'groups'}"
                              for n, s, c in GROUP_CASES])
def test_config_schedule_scales_each_groups_own_lr(schedule, stage, client, tmp_path):
    """As DeepSpeed's schedulers: WarmupCosineLR scales each param group's own lr, and WarmupLR
    without warmup_max_lr warms each group up to its own; with groups at lr 1e-2 and 3e-3 from
    model_parameters (the config's optimizer) or a client optimizer, against torch AdamW with a
    LambdaLR of the same factor (step k uses the factor at t = k - 1)."""
    params, factor = SCHEDULES[schedule]
    model = make_model("gpt")
    cfg = ds_config(stage, nvme_path=str(tmp_path))
    cfg["scheduler"] = {"type": schedule, "params": params}
    if client:
        del cfg["optimizer"]
        engine, opt, _, _ = strata.initialize(
            model=model, optimizer=torch.optim.AdamW(decay_groups(model), lr=LR), config=cfg)
    else:
        engine, opt, _, _ = strata.initialize(model=model, model_parameters=decay_groups(model),
                                              config=cfg)
    losses = run(engine, steps=5)
    seen = [float(g["lr"]) for g in opt.param_groups]
    ref = make_model("gpt")
    ref_opt = torch.optim.AdamW(decay_groups(ref), lr=LR, weight_decay=0.0)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda k: factor(k - 1))
    ref_losses = []
    for step in range(5):
        ref_opt.zero_grad()
        loss = ref(*batch("gpt", step))
        loss.backward()
        ref_opt.step()
        ref_sched.step()
        ref_losses.append(loss.item())
    assert_matches(losses, master_of(engine, model), ref_losses, dict(ref.named_parameters()))
    assert seen[0] > 0 and seen[0] / seen[1] == pytest.approx(LR / 3e-3, rel=1e-12)
    engine.close()


def test_client_torch_adam_is_l2_weight_decay():
    model = make_model("mlp")
    opt = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=0.1)
    cfg = ds_config(1, "cpu")
    del cfg["optimizer"]
    engine, _, _, _ = strata.initialize(model=model, optimizer=opt, config=cfg)
    losses = run(engine, "mlp")
    ref = make_model("mlp")
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR, weight_decay=0.1)
    ref_losses = torch_losses(ref, ref_opt, "mlp")
    assert_matches(losses, master_of(engine, model), ref_losses, dict(ref.named_parameters()))
    engine.close()


def test_lr_written_by_the_script_or_a_scheduler_on_the_returned_optimizer_is_used():
    # The common DeepSpeed pattern: a torch scheduler built on the optimizer initialize returns,
    # stepped by the script; and a manual lr loop. Both write param_groups[i]["lr"].
    model = make_model("mlp")
    engine, opt, _, sched = strata.initialize(model=model, config=ds_config(0, lr=LR))
    assert sched is None and isinstance(opt, torch.optim.Optimizer)
    own = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    for step in range(STEPS):
        assert engine.get_lr() == [LR * warmup(step)]
        loss = engine(*batch("mlp", step))
        engine.backward(loss)
        engine.step()
        own.step()
        assert engine.last_step_report["lr"] == pytest.approx(LR * warmup(step), rel=1e-12)
    with pytest.raises(RuntimeError, match="call engine.step"):
        opt.step()
    with pytest.raises(RuntimeError, match="save_checkpoint"):
        opt.state_dict()
    engine.close()


def test_config_scheduler_writes_its_lr_into_param_groups():
    cfg = ds_config(1, lr=LR)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR,
                                                       "warmup_num_steps": 4,
                                                       "warmup_type": "linear"}}
    model = make_model("mlp")
    engine, opt, _, sched = strata.initialize(model=model, config=cfg)
    seen = []
    for step in range(3):
        seen.append(opt.param_groups[0]["lr"])
        loss = engine(*batch("mlp", step))
        engine.backward(loss)
        engine.step()
        assert engine.last_step_report["lr"] == seen[-1]
    assert seen == [0.0, 0.0, LR / 4] and sched.get_last_lr() == [LR / 2]
    engine.close()


def test_config_scheduler_object_moves_as_deepspeeds(tmp_path):
    """The scheduler initialize returns for the config's WarmupLR is positioned as DeepSpeed's
    object (last_batch_iteration, step(), step(k), state_dict, load_state_dict), and the lr the
    engine steps with follows it (DeepSpeed 0.19's WarmupLR: lr = 0.01 * t / 10 at t)."""
    cfg = ds_config(2, lr=0.01)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                       "warmup_num_steps": 10,
                                                       "warmup_type": "linear"}}
    engine, opt, _, sched = strata.initialize(model=make_model("mlp"), config=cfg)
    assert sched.last_batch_iteration == -1 and sched.state_dict() == {"last_batch_iteration": -1}
    run(engine, "mlp", steps=4)
    assert sched.last_batch_iteration == 3 and sched.get_last_lr() == pytest.approx([0.003])
    sched.step()  # a script stepping it too moves it once more, as DeepSpeed's
    assert sched.last_batch_iteration == 4 and engine.get_lr() == pytest.approx([0.004])
    run(engine, "mlp", steps=1)
    assert engine.last_step_report["lr"] == pytest.approx(0.004)
    sched.load_state_dict({"last_batch_iteration": 8})
    run(engine, "mlp", steps=1)
    assert engine.last_step_report["lr"] == pytest.approx(0.008)
    assert sched.state_dict() == {"last_batch_iteration": 9}
    assert opt.param_groups[0]["lr"] == pytest.approx(0.009)
    sched.step(2)
    assert engine.get_lr() == pytest.approx([0.002])
    engine.save_checkpoint(tmp_path)  # the position is the checkpoint's
    with pytest.raises(ValueError, match="starts at -1"):
        sched.step(-2)
    engine.close()
    again, _, _, sched2 = strata.initialize(model=make_model("mlp"), config=cfg)
    again.load_checkpoint(tmp_path)
    assert sched2.last_batch_iteration == 2 and again.get_lr() == pytest.approx([0.002])
    again.close()


def test_zero_init_with_groups_that_split_modules_trains_as_torch():
    cfg = ds_config(3, "cpu")
    del cfg["optimizer"]
    with strata.zero.Init(config=cfg):
        model = make_model("gpt")
    opt = torch.optim.AdamW(decay_groups(model), lr=LR)
    engine, _, _, _ = strata.initialize(model=model, optimizer=opt, config=cfg,
                                        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    losses = run(engine)
    ref_losses, ref_params = reference("gpt", STEPS, LR, 0.0, groups=True)
    assert_matches(losses, master_of(engine, model), ref_losses, ref_params)
    engine.close()


def test_what_is_refused_is_named():
    model = make_model("mlp")
    no_opt = ds_config(0)
    del no_opt["optimizer"]
    with pytest.raises(TypeError, match="torch.optim.sgd.SGD is not supported.*AdamW"):
        strata.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          config=no_opt)
    with pytest.raises(ValueError, match="amsgrad=True"):
        strata.initialize(model=model, config=no_opt, optimizer=torch.optim.AdamW(
            model.parameters(), amsgrad=True))
    with pytest.raises(ValueError, match="\"optimizer\" section and optimizer= was passed"):
        strata.initialize(model=model, config=ds_config(0),
                          optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="no \"optimizer\" section and no optimizer="):
        strata.initialize(model=model, config=no_opt, model_parameters=model.parameters())
    with pytest.raises(ValueError, match="requires_grad=True are in no optimizer group"):
        strata.initialize(model=model, config=ds_config(0),
                          model_parameters=list(model.parameters())[:1])
    with pytest.raises(ValueError, match="unknown param-group key"):
        strata.initialize(model=model, config=ds_config(0),
                          model_parameters=[{"params": list(model.parameters()), "momentum": 1}])
    opt = torch.optim.AdamW(model.parameters())
    cfg = ds_config(0)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {}}
    with pytest.raises(ValueError, match="\"scheduler\" section and lr_scheduler="):
        strata.initialize(model=model, config=cfg,
                          lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, warmup))


def test_an_adam_subclass_that_overrides_step_is_refused_one_that_does_not_runs():
    """A subclass of torch's Adam / AdamW whose step() changes the update (a gradient clamp
    before super().step()) would have its step replaced by the engine's Adam, silently; it is
    refused, naming it. A subclass that only adds methods (or wraps __init__) trains as AdamW."""
    class ClampedAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.clamp_(-1e-3, 1e-3)
            return super().step(closure)

    class NamedAdamW(torch.optim.AdamW):
        def describe(self):
            return "named"

    no_opt = ds_config(0)
    del no_opt["optimizer"]
    model = make_model("mlp")
    with pytest.raises(TypeError, match="ClampedAdamW overrides step\\(\\); strata runs its own"):
        strata.initialize(model=model, config=no_opt,
                          optimizer=ClampedAdamW(model.parameters(), lr=LR))
    torch.manual_seed(0)
    plain = make_model("mlp")
    torch.manual_seed(0)
    named = make_model("mlp")
    got = []
    for m, cls in ((plain, torch.optim.AdamW), (named, NamedAdamW)):
        engine, _, _, _ = strata.initialize(model=m, config=no_opt,
                                            optimizer=cls(m.parameters(), lr=LR))
        engine.backward(engine(*batch("mlp", 0)))
        engine.step()
        got.append(engine.read_master())
        engine.close()
    for n in got[0]:
        assert torch.equal(got[0][n], got[1][n]), n


def test_a_group_added_after_initialize_is_refused_naming_add_param_group():
    """The engine holds the groups it was initialized with: add_param_group on the returned
    optimizer raises at once; one added to the client optimizer (whose param_groups the engine
    reads) is named at the next step, where the lrs no longer paired with the engine's groups."""
    model = make_model("mlp")
    extra = torch.nn.Parameter(torch.zeros(3))
    engine, opt, _, _ = strata.initialize(model=model, config=ds_config(0))
    with pytest.raises(RuntimeError, match="add_param_group after strata.initialize"):
        opt.add_param_group({"params": [extra]})
    engine.close()
    cfg = ds_config(0)
    del cfg["optimizer"]
    model = make_model("mlp")
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = strata.initialize(model=model, optimizer=client, config=cfg)
    client.add_param_group({"params": [extra]})
    engine.backward(engine(*batch("mlp", 0)))
    with pytest.raises(RuntimeError, match="2 param_groups and the engine was initialized with "
                                           "1: a group added .*add_param_group"):
        engine.step()
    engine.close()


def test_deepspeed_cpu_adam_signature():
    model = make_model("mlp")
    opt = strata.optim.DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.01)
    with pytest.raises(RuntimeError, match="runs inside the strata engine"):
        opt.step()
    cfg = ds_config(2, "cpu")
    del cfg["optimizer"]
    engine, _, _, _ = strata.initialize(model=model, optimizer=opt, config=cfg)
    losses = run(engine, "mlp")
    ref_losses, ref_params = reference("mlp", STEPS, LR, 0.01)
    assert_matches(losses, master_of(engine, model), ref_losses, ref_params)
    engine.close()


def test_client_scheduler_and_lrs_resume_from_a_checkpoint(tmp_path):
    cfg = client_config(2, "cpu", tmp_path)

    def start(seed=0):
        model = make_model("gpt", seed)
        opt = torch.optim.AdamW(decay_groups(model), lr=LR)
        engine, _, _, sched = strata.initialize(
            model=model, optimizer=opt, config=cfg,
            lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, warmup))
        return engine, sched

    engine, _ = start()
    run(engine, steps=2)
    engine.save_checkpoint(tmp_path / "ckpt")
    for step in range(2, 4):
        engine.backward(engine(*batch("gpt", step)))
        engine.step()
    straight, lrs = engine.read_master(), engine.get_lr()
    engine.close()
    resumed, sched = start(seed=3)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert sched.last_epoch == 2  # the warmup continues where it was
    for step in range(2, 4):
        resumed.backward(resumed(*batch("gpt", step)))
        resumed.step()
    assert resumed.get_lr() == lrs
    for n, v in resumed.read_master().items():
        assert torch.equal(v, straight[n]), n
    resumed.close()


def test_transformers_linear_warmup_schedule_on_the_client_optimizer():
    transformers = pytest.importorskip("transformers")

    def build(model):
        opt = torch.optim.AdamW(decay_groups(model), lr=LR)
        return opt, transformers.get_linear_schedule_with_warmup(opt, 2, 6)

    ref = make_model("gpt")
    ref_opt, ref_sched = build(ref)
    ref_losses = torch_losses(ref, ref_opt, "gpt", ref_sched)
    model = make_model("gpt")
    opt, sched = build(model)
    cfg = ds_config(3, "cpu")
    del cfg["optimizer"]
    engine, _, _, _ = strata.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    losses = run(engine)
    assert engine.get_lr() == ref_sched.get_last_lr()
    assert_matches(losses, master_of(engine, model), ref_losses, dict(ref.named_parameters()))
    engine.close()


def test_lazy_submodules_are_the_modules_named():
    """strata.optim / strata.zero / strata.utils load on first use (the package's __getattr__),
    each its own module."""
    for name in ("optim", "zero", "utils"):
        assert strata.__getattr__(name).__name__ == f"strata.{name}"
    with pytest.raises(AttributeError):
        strata.__getattr__("nothing")


BETA_CASES = [(0, "none"), (3, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("stage,offload", BETA_CASES, ids=[f"stage{s}-{o}" for s, o in BETA_CASES])
def test_torch_one_cycle_lr_cycles_betas_as_in_torch(stage, offload, tmp_path):
    # torch's OneCycleLR (cycle_momentum=True by default) writes betas[0] with each lr: an engine
    # that took only the lr would train on the constructor's betas without a word.
    def build(model):
        opt = torch.optim.AdamW(decay_groups(model), lr=LR)
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS + 3,
                                                        base_momentum=0.5, max_momentum=0.95)

    ref = make_model("gpt")
    ref_opt, ref_sched = build(ref)
    ref_losses = torch_losses(ref, ref_opt, "gpt", ref_sched)
    model = make_model("gpt")
    opt, sched = build(model)
    engine, _, _, _ = strata.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                        config=client_config(stage, offload, tmp_path))
    losses = run(engine)
    assert engine.get_mom() == [g["betas"] for g in ref_opt.param_groups]
    assert engine.get_mom()[0][0] not in (0.5, 0.95)  # mid-cycle: betas[0] really moved
    assert_matches(losses, master_of(engine, model), ref_losses, dict(ref.named_parameters()))
    engine.close()


def one_cycle_config(stage, offload="none", tmp_path=None):
    cfg = ds_config(stage, offload, lr=LR, nvme_path=str(tmp_path) if tmp_path else None)
    cfg["scheduler"] = {"type": "OneCycle", "params": {
        "cycle_min_lr": LR / 10, "cycle_max_lr": LR, "cycle_first_step_size": 2,
        "cycle_min_mom": 0.6, "cycle_max_mom": 0.9}}
    return cfg


# DeepSpeed's OneCycle over 2 + 2 steps, worked out by hand: the lr and betas the applied steps
# 1..STEPS use (last_batch_iteration -1, 0, 1, 2: scale 0 then 1/2, 1, 1/2; the constructor
# writes cycle_min_mom, the cycle starts from cycle_max_mom; beta2 is 0.99).
ONE_CYCLE_LRS = [LR / 10, LR / 10 + (LR - LR / 10) / 2, LR, LR / 10 + (LR - LR / 10) / 2]
ONE_CYCLE_BETAS = [(0.6, 0.99), (0.75, 0.99), (0.6, 0.99), (0.75, 0.99)]


def torch_with_lrs_and_betas(lrs, betas):
    """Plain torch AdamW given each step's lr and betas: the model and the losses."""
    ref = make_model("gpt")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_losses = []
    for step in range(STEPS):
        ref_opt.param_groups[0]["lr"] = lrs[step]
        ref_opt.param_groups[0]["betas"] = betas[step]
        ref_opt.zero_grad()
        loss = ref(*batch("gpt", step))
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    return ref, ref_losses


@pytest.mark.parametrize("stage,offload", BETA_CASES, ids=[f"stage{s}-{o}" for s, o in BETA_CASES])
def test_config_one_cycle_trains_as_torch_adamw_given_its_lrs_and_betas(stage, offload,
                                                                          tmp_path):
    model = make_model("gpt")
    engine, opt, _, sched = strata.initialize(model=model,
                                              config=one_cycle_config(stage, offload, tmp_path))
    losses = []
    for step in range(STEPS):
        assert opt.param_groups[0]["lr"] == pytest.approx(ONE_CYCLE_LRS[step], rel=1e-12)
        assert engine.get_mom()[0] == pytest.approx(ONE_CYCLE_BETAS[step], rel=1e-12)
        loss = engine(*batch("gpt", step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ref, ref_losses = torch_with_lrs_and_betas(ONE_CYCLE_LRS, ONE_CYCLE_BETAS)
    assert_matches(losses, master_of(engine, model), ref_losses, dict(ref.named_parameters()))
    engine.close()


def test_betas_written_under_the_config_one_cycle_last_one_step():
    """As DeepSpeed's OneCycle, which writes the betas into param_groups after every step: betas
    a script writes there are used by the next step only, then the cycle's again (they were
    kept for the rest of the run); against torch AdamW given the same betas."""
    model = make_model("gpt")
    engine, opt, _, _ = strata.initialize(model=model, config=one_cycle_config(2))
    written = (0.5, 0.95)
    betas = list(ONE_CYCLE_BETAS)
    betas[1] = written
    losses = []
    for step in range(STEPS):
        if step == 1:
            opt.param_groups[0]["betas"] = written
        assert engine.get_mom()[0] == pytest.approx(betas[step], rel=1e-12)
        loss = engine(*batch("gpt", step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ref, ref_losses = torch_with_lrs_and_betas(ONE_CYCLE_LRS, betas)
    assert_matches(losses, master_of(engine, model), ref_losses, dict(ref.named_parameters()))
    engine.close()


def test_one_cycle_momentum_resumes_from_a_checkpoint(tmp_path):
    # The config's OneCycle: its position is the engine's step count. A client OneCycleLR: the
    # betas it wrote travel in the checkpoint with its state.
    for client in (False, True):
        def start(seed=0):
            model = make_model("gpt", seed)
            if not client:
                return strata.initialize(model=model, config=one_cycle_config(2, "cpu"))[0]
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=8)
            return strata.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                     config=client_config(2, "cpu", tmp_path))[0]

        engine = start()
        run(engine, steps=2)
        engine.save_checkpoint(tmp_path / f"ckpt{client}")
        run(engine, steps=2)
        straight, mom = engine.read_master(), engine.get_mom()
        engine.close()
        resumed = start(seed=3)
        resumed.load_checkpoint(tmp_path / f"ckpt{client}")
        run(resumed, steps=2)
        assert resumed.get_mom() == mom, client
        for n, v in resumed.read_master().items():
            assert torch.equal(v, straight[n]), (client, n)
        resumed.close()


@pytest.mark.parametrize("name,params", [
    ("StepLR", {"step_size": 2, "gamma": 0.5}),
    ("OneCycleLR", {"max_lr": LR, "total_steps": STEPS + 3, "base_momentum": 0.5}),
], ids=["StepLR", "OneCycleLR"])
def test_config_scheduler_of_torch_is_built_and_stepped_as_deepspeed_does(name, params):
    # DeepSpeed builds a "scheduler.type" it does not define from torch.optim.lr_scheduler.
    cfg = ds_config(3, "cpu", lr=LR)
    cfg["scheduler"] = {"type": name, "params": params}
    model = make_model("gpt")
    engine, _, _, sched = strata.initialize(model=model, config=cfg)
    assert isinstance(sched, getattr(torch.optim.lr_scheduler, name))
    assert (engine.scheduler_name(), engine.scheduler_params()) == (name, params)
    losses = run(engine)
    ref = make_model("gpt")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_sched = getattr(torch.optim.lr_scheduler, name)(ref_opt, **params)
    ref_losses = torch_losses(ref, ref_opt, "gpt", ref_sched)
    assert engine.get_lr() == ref_sched.get_last_lr()
    assert engine.get_mom() == [g["betas"] for g in ref_opt.param_groups]
    assert_matches(losses, master_of(engine, model), ref_losses, dict(ref.named_parameters()))
    engine.close()


def test_config_scheduler_that_is_neither_deepspeeds_nor_torchs_is_named():
    model = make_model("mlp")
    cfg = ds_config(0)
    cfg["scheduler"] = {"type": "NoSuchLR", "params": {}}
    with pytest.raises(ValueError, match="scheduler.type.*'NoSuchLR'.*OneCycle"):
        strata.initialize(model=model, config=cfg)
    cfg["scheduler"] = {"type": "StepLR", "params": {"step_sise": 2}}
    with pytest.raises(ValueError, match="scheduler.params.*StepLR.*step_sise"):
        strata.initialize(model=model, config=cfg)


@pytest.mark.parametrize("name,params", [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 3,
                  "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 6, "warmup_max_lr": 0.01, "warmup_num_steps": 2}),
    ("WarmupCosineLR", {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_min_ratio": 0.1}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 2,
                  "decay_lr_rate": 0.5, "decay_step_size": 1}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2,
                     "lr_range_test_staircase": True}),
])
def test_deepspeed_scheduler_class_built_by_the_script_trains_as_the_config_one(name, params):
    """`from deepspeed.runtime.lr_schedules import WarmupLR` (each of DeepSpeed's five) built on
    the script's optimizer and passed as lr_scheduler=: the same lrs, betas and bits as the
    config's "scheduler" section of that type and params."""
    strata.register_as_deepspeed()
    from deepspeed.runtime import lr_schedules
    cfg = ds_config(2, lr=0.01)
    with_section = dict(cfg, scheduler={"type": name, "params": params})
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=with_section)
    want = run(engine, "mlp", steps=6)
    want_lrs = [engine.get_lr(), engine.get_mom()]
    want_master = engine.read_master()
    engine.close()
    model = make_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    sched = getattr(lr_schedules, name)(opt, **params)
    client = {k: v for k, v in cfg.items() if k != "optimizer"}
    engine, _, _, returned = strata.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                               config=client)
    assert returned is sched
    got = run(engine, "mlp", steps=6)
    assert got == want and [engine.get_lr(), engine.get_mom()] == want_lrs
    assert sched.state_dict() == {"last_batch_iteration": 5}
    for n, m in engine.read_master().items():
        assert torch.equal(m, want_master[n]), n
    engine.close()


def test_deepspeed_scheduler_class_per_group_values_and_state():
    """Per-group bounds (a list, as DeepSpeed's _format_param), get_last_lr, state_dict round
    trip, and a list of the wrong length named."""
    from strata.runtime.lr_schedules import WarmupLR
    model = make_model("gpt")
    opt = torch.optim.AdamW(decay_groups(model), lr=0.01)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.001], warmup_max_lr=[0.01, 0.02],
                     warmup_num_steps=4, warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.001]  # the constructor's (t = -1)
    for _ in range(3):
        sched.step()
    assert sched.get_last_lr() == pytest.approx([0.01 * 2 / 4, 0.001 + 0.019 * 2 / 4])
    state = sched.state_dict()
    other = WarmupLR(opt, warmup_min_lr=[0.0, 0.001], warmup_max_lr=[0.01, 0.02],
                     warmup_num_steps=4, warmup_type="linear")
    other.load_state_dict(state)
    other.step()
    assert other.get_last_lr() == pytest.approx([0.01 * 3 / 4, 0.001 + 0.019 * 3 / 4])
    with pytest.raises(ValueError, match="expected 2 values for warmup_max_lr"):
        WarmupLR(opt, warmup_max_lr=[0.01])
    with pytest.raises(strata.StrataError, match="warmup_num_steps"):
        WarmupLR(opt, warmup_num_steps=0)


def test_lr_written_for_one_step_under_the_config_scheduler_holds_for_that_step_only():
    """As DeepSpeed, whose scheduler object writes its lr into param_groups after every step: a
    script's one-off write under the config's WarmupLR drives the next step only, and the
    schedule, which kept counting, applies again after it (it used to stop for good). The
    reference is DeepSpeed's WarmupLR class on a client optimizer, stepped after each step, with
    the same write."""
    strata.register_as_deepspeed()
    from deepspeed.runtime import lr_schedules
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 4}

    def train(engine, opt):
        lrs = []
        for step in range(6):
            if step == 2:
                opt.param_groups[0]["lr"] = 0.5
            engine.backward(engine(*batch("mlp", step)))
            engine.step()
            lrs.append(engine.get_lr()[0])
        return lrs, engine.read_master()

    cfg = ds_config(2, lr=0.01)
    engine, opt, _, _ = strata.initialize(model=make_model("mlp"),
                                          config=dict(cfg, scheduler={"type": "WarmupLR",
                                                                      "params": params}))
    got_lrs, got = train(engine, opt)
    engine.close()
    model = make_model("mlp")
    client = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8,
                               weight_decay=0.01)
    sched = lr_schedules.WarmupLR(client, **params)
    engine, opt, _, _ = strata.initialize(
        model=model, optimizer=client, lr_scheduler=sched,
        config={k: v for k, v in cfg.items() if k != "optimizer"})
    want_lrs, want = train(engine, opt)
    engine.close()
    assert got_lrs == want_lrs and got_lrs[2] != 0.5  # the schedule's again after step 2
    for n, m in got.items():
        assert torch.equal(m, want[n]), n


def test_warmup_decay_lr_with_warmup_max_lr_none_warms_each_group_to_its_own_lr():
    """DeepSpeed's WarmupLR (and WarmupDecayLR) turn warmup_max_lr=None into each group's lr;
    the class's 0.001 default applies only when the argument is left out."""
    from strata.runtime import lr_schedules
    model = make_model("mlp")
    opt = torch.optim.AdamW([{"params": model.fc1.parameters(), "lr": 2e-5},
                             {"params": model.fc2.parameters(), "lr": 1e-2}])
    sched = lr_schedules.WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=10,
                                       warmup_max_lr=None, warmup_type="linear")
    for _ in range(10):
        sched.step()
    assert sched.get_lr() == pytest.approx([0.9 * 2e-5, 0.9 * 1e-2], rel=1e-12)  # t = 9 of 10
    default = lr_schedules.WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=10,
                                         warmup_type="linear")
    for _ in range(10):
        default.step()
    assert default.get_lr() == pytest.approx([0.9e-3, 0.9e-3], rel=1e-12)
