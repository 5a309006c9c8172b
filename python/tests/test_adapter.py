"""strata.initialize in one process against plain torch (fp32 AdamW; bf16 with fp32 masters),
the per-module hooks, checkpoints, 16-bit export, zero.Init / GatheredParameters, stats and the
failure paths. Two processes: test_distributed.py."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from models import batch, ds_config, make_model, reference, reference_bf16  # noqa: E402

STEPS = 4
LR, WD = 1e-2, 0.01
# fp32 everywhere, one process: torch computes the same gradients from the same fp32 views; the
# only difference is the engine's fused Adam against torch.optim.AdamW's (rounding order).
LOSS_RTOL, PARAM_ATOL, PARAM_RTOL = 1e-5, 2e-5, 1e-4


def train(kind, cfg, steps=STEPS, gas=1, model=None, engine_out=None, **kw):
    model = model or make_model(kind)
    names = [n for n, _ in model.named_parameters()]
    engine, opt, _, _ = strata.initialize(model=model, config=cfg, **kw)
    losses, reports = [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            loss = engine(*batch(kind, step, m))
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses.append(total)
        reports.append(engine.last_step_report)
    master = engine.read_master()
    stats = engine.stats()
    if engine_out is not None:
        engine_out.append((engine, reports))
    else:
        engine.close()
    return losses, {n: master[n] for n in names if n in master}, stats


def run_steps(engine, kind, steps=3, after_forward=None, after_step=None):
    """The losses of `steps` training steps of an engine made (and adjusted) by the test, on
    `kind`'s batches; after_forward() and after_step(step) are called in each."""
    losses = []
    for step in range(steps):
        loss = engine(*batch(kind, step, 0))
        if after_forward is not None:
            after_forward()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def check_against_torch(kind, losses, params, steps=STEPS, gas=1):
    ref_losses, ref_params = reference(kind, steps, LR, WD, gas=gas)
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL)
    assert set(params) == {n for n in ref_params if n in params}
    if kind.startswith("gpt"):
        assert "head.weight" not in params  # tied: one parameter, owned by the embedding
    for n, p in params.items():
        torch.testing.assert_close(p, ref_params[n], atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=n)


# Pairwise cover of model x stage x offload in one process (each pair of values appears at least
# once); test_distributed.py covers 2 processes. Optimizer NVMe offload is a stage-3 setting.
ONE_PROCESS_CASES = [
    ("mlp", 0, "none"), ("mlp", 1, "cpu"), ("mlp", 2, "none"), ("mlp", 3, "nvme"),
    ("gpt", 0, "cpu"), ("gpt", 1, "none"), ("gpt", 2, "cpu"), ("gpt", 3, "none"),
    ("gpt", 3, "cpu"), ("gpt", 3, "nvme"),
]


@pytest.mark.parametrize("kind,stage,offload", ONE_PROCESS_CASES,
                         ids=[f"{k}-stage{s}-offload_{o}-1proc" for k, s, o in ONE_PROCESS_CASES])
def test_matches_torch_adamw(kind, stage, offload, tmp_path):
    cfg = ds_config(stage, offload, lr=LR, wd=WD, nvme_path=str(tmp_path))
    losses, params, _ = train(kind, cfg)
    check_against_torch(kind, losses, params)


def test_gradient_accumulation_matches_torch():
    cfg = ds_config(3, "cpu", gas=2, lr=LR, wd=WD)
    losses, params, _ = train("mlp", cfg, steps=3, gas=2)
    check_against_torch("mlp", losses, params, steps=3, gas=2)


def test_bf16_matches_bf16_reference_and_bits_independent_of_stage_and_placement(tmp_path):
    """bf16 working params with fp32 masters against the same written in torch; and the engine's
    placement property through the adapter: every stage and offload gives the same bits."""
    runs = {}
    for stage, off in [(0, "none"), (2, "cpu"), (3, "none"), (3, "nvme")]:
        cfg = ds_config(stage, off, dtype="bf16", lr=LR, wd=WD, nvme_path=str(tmp_path))
        losses, params, _ = train("gpt", cfg, steps=3)
        runs[(stage, off)] = (losses, params)
    base_losses, base = runs[(0, "none")]
    for key, (losses, params) in runs.items():
        assert losses == base_losses, key
        for n in base:
            assert torch.equal(params[n], base[n]), (key, n)
    ref_losses, ref_params = reference_bf16("gpt", 3, LR, WD)
    assert base_losses == pytest.approx(ref_losses, rel=1e-3)
    for n, p in base.items():  # a bf16 rounding apart at most (Adam's order of operations)
        torch.testing.assert_close(p, ref_params[n], atol=1e-2, rtol=1e-2, msg=n)


def test_layout_says_the_offloaded_gradient_is_kept_in_bf16_on_one_rank():
    """The layout names the dtype the optimizer's gradient is kept in: bf16 where one rank's only
    micro-step makes it final as reduced and the optimizer is offloaded (the same bits as fp32:
    the test above trains (2, cpu) and (3, nvme) so), fp32 with gradient accumulation or on the
    device."""
    for off, gas, want in [("cpu", 1, "bfloat16"), ("cpu", 2, "float32"), ("none", 1, "float32")]:
        engine, _, _, _ = strata.initialize(model=make_model("gpt"),
                                            config=ds_config(3, off, dtype="bf16", gas=gas))
        try:
            assert engine.layout()["grad_dtype"] == want, (off, gas)
        finally:
            engine.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_overlap_step_gives_the_same_bits(offload, tmp_path):
    """strata.initialize(overlap_step=True): the optimizer step runs behind the next forward;
    the losses and master weights are the same bits as without."""
    cfg = ds_config(3, offload, dtype="bf16", lr=LR, wd=WD, nvme_path=str(tmp_path))
    base_losses, base, _ = train("gpt", cfg, steps=3)
    losses, params, _ = train("gpt", cfg, steps=3, overlap_step=True)
    assert losses == base_losses
    for n in base:
        assert torch.equal(params[n], base[n]), n


class _LoggedEvent:
    """A CUDA event's stand-in for _HeldBack: logs when it is made and waited for."""

    def __init__(self, log):
        self.log, self.n = log, sum(1 for e in log if e[0] == "event")
        log.append(("event", self.n))

    def synchronize(self):
        self.log.append(("wait", self.n))


@pytest.mark.parametrize("stage,offload", [(3, "none"), (3, "cpu"), (2, "none")])
def test_held_back_reductions_give_the_same_bits_and_wait_for_their_own_event(stage, offload):
    """On a GPU with overlap_comm the adapter reduces each group one group late, after waiting
    for an event behind its gradient copies (never the whole stream). Injected here on the host
    engine with logged events: the same bits as reducing at once, every reduction after its own
    event's wait and, inside the backward, only once the next group's event exists."""
    from strata.engine import _HeldBack
    cfg = ds_config(stage, offload, dtype="bf16", lr=LR, wd=WD)
    cfg["zero_optimization"]["overlap_comm"] = True
    base_losses, base, _ = train("gpt", cfg, steps=3)
    log = []
    model = make_model("gpt")
    engine, _, _, _ = strata.initialize(model=model, config=cfg)

    def reduce(gi):
        log.append(("reduce", gi))
        engine._engine.reduce_gradients(gi)

    engine._held = _HeldBack(reduce, engine._wait_torch, 1, lambda: _LoggedEvent(log),
                             engine._device_waits)
    losses = run_steps(engine, "gpt", after_step=lambda step: log.append(("step", step)))
    master = engine.read_master()
    waits = engine.stats()["adapter"]
    engine.close()
    # stats() counts each event wait (the host engine's own stream waits are none).
    assert waits["device_waits"] == sum(1 for e in log if e[0] == "wait") > 0
    assert waits["device_wait_ns"] > 0
    assert losses == base_losses
    for n in base:
        assert torch.equal(master[n], base[n]), n
    # Per backward: event k is made when group k's copies are queued, reduce k follows wait k;
    # all but the last reduce come before the next event's wait, i.e. one group late.
    groups = sum(g.trainable for g in engine._groups)
    per_step = [list(g) for g in _split(log, "step")]
    assert len(per_step) == 3
    for entries in per_step:
        events = [n for kind, n in entries if kind == "event"]
        assert len(events) == groups
        order = [(kind, n) for kind, n in entries if kind in ("event", "wait")]
        for k, n in enumerate(events):
            i_wait = order.index(("wait", n))
            if k + 1 < len(events):  # waited for only once the next group's event was made
                assert order.index(("event", events[k + 1])) < i_wait
            at = entries.index(("wait", n))
            assert entries[at + 1][0] == "reduce"  # each reduce right after its own wait


class _EngineSpy:
    """The binding's engine with the calls that take a stream logged: (call, group, stream)."""

    def __init__(self, inner, log):
        self._inner, self._log = inner, log

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def release(self, gi, stream=None):
        self._log.append(("release", gi, stream))
        self._inner.release(gi, stream)

    def grad_buffer(self, gi, stream=None):
        self._log.append(("grad_buffer", gi, stream))
        return self._inner.grad_buffer(gi, stream)

    def reduce_gradients(self, gi, stream=None):
        self._log.append(("reduce", gi, stream))
        self._inner.reduce_gradients(gi, stream)


class _FakeStream:
    """A torch.cuda.Stream's stand-in: its handle, and wait_stream logged."""

    def __init__(self, handle, log):
        self.cuda_stream, self._log = handle, log

    def wait_stream(self, other):
        self._log.append(("wait_stream", self.cuda_stream, other.cuda_stream))


def _stream_ordered(engine, current):
    """engine on its stream-ordered path as at one rank on a GPU (orders_caller_streams),
    injected on the host engine, which ignores the streams; current() is torch's stream."""
    from strata.engine import _HeldBack, _no_wait
    assert not engine._engine.orders_caller_streams and not engine._stream_ordered
    engine._stream_ordered = True
    engine._release_waits = not engine._engine.gathers_alias_home  # as on a GPU
    engine._current_stream = current
    engine._held = _HeldBack(engine._reduce_ordered, _no_wait, 0, None, engine._device_waits)


@pytest.mark.parametrize("offload,param", [("none", "none"), ("cpu", "none"), ("none", "cpu")])
def test_stream_ordered_buffers_reductions_and_releases_give_the_same_bits(offload, param):
    """One rank on a GPU (orders_caller_streams) the adapter passes torch's stream to
    grad_buffer and reduce_gradients, and to release where it frees or reuses memory (params
    offloaded: not gathers_alias_home), which order it on the device; it holds nothing back.
    Injected here on the host engine, which orders no caller streams (its caller is the host)
    and so ignores the stream: the same bits as the default path, the stream passed to every
    buffer, reduction and such release, no wait."""
    cfg = ds_config(3, offload, dtype="bf16", lr=LR, wd=WD)
    cfg["zero_optimization"]["overlap_comm"] = True
    if param != "none":
        cfg["zero_optimization"]["offload_param"] = {"device": param}
    base_losses, base, _ = train("gpt", cfg, steps=3)
    engine, _, _, _ = strata.initialize(model=make_model("gpt"), config=cfg)
    # Offloaded params, or the optimizer on cpu (a small model's speculative step writes params
    # during the backward), are rewritten after a release.
    alias = engine._engine.gathers_alias_home
    assert alias is (offload == param == "none")
    log = []
    stream = _FakeStream(0, log)  # torch's default stream is 0
    _stream_ordered(engine, lambda: stream)
    engine._engine = _EngineSpy(engine._engine, log)
    losses = run_steps(engine, "gpt")
    master = engine.read_master()
    waits = engine.stats()["adapter"]["device_waits"]
    groups = sum(g.trainable for g in engine._groups)
    engine.close()
    assert losses == base_losses
    for n in base:
        assert torch.equal(master[n], base[n]), n
    calls = {c: [s for c2, _, s in log if c2 == c] for c in ("grad_buffer", "reduce", "release")}
    # A buffer and a reduction per group and step, each on the stream.
    assert calls["grad_buffer"] == calls["reduce"] == [0] * (groups * 3)
    ordered = [s for s in calls["release"] if s is not None]
    if alias:
        assert ordered == []  # the views are the params' home: nothing to order
    else:
        # Every group once in forward and once in backward, each step.
        assert ordered == [0] * (2 * len(engine._groups) * 3)
    assert not any(e[0] == "wait_stream" for e in log)  # one stream: nothing to order
    assert waits == 0


def test_gradients_copied_from_another_stream_are_ordered_with_the_buffers():
    """Autograd runs each backward node on its forward op's stream, so a group's gradients may
    be copied into its buffer from several streams. Where stream-ordered, a copy from a stream
    other than the one the buffer was taken on waits for that stream first (the zeroing is
    ordered before it only) and that stream then waits for the copy, and the reduction names the
    buffer's stream. Injected on the host engine with two logged streams that alternate per
    gradient: the same bits, and exactly that order."""
    cfg = ds_config(3, "none", dtype="bf16", lr=LR, wd=WD)
    base_losses, base, _ = train("gpt", cfg, steps=2)
    engine, _, _, _ = strata.initialize(model=make_model("gpt"), config=cfg)
    log = []
    streams = [_FakeStream(11, log), _FakeStream(22, log)]
    turn = [0]

    def current():
        return streams[turn[0] % 2]

    _stream_ordered(engine, current)
    engine._engine = _EngineSpy(engine._engine, log)
    real_buffer = engine._grad_buffer

    class LoggedView:  # a buffer view whose copies are logged with the stream they ran on
        def __init__(self, view, gi):
            self.view, self.gi, self.shape = view, gi, view.shape

        def copy_(self, src):
            log.append(("copy", self.gi, current().cuda_stream))
            self.view.copy_(src)

    engine._grad_buffer = lambda gi: [LoggedView(v, gi) for v in real_buffer(gi)]
    hooks = [p.register_post_accumulate_grad_hook(lambda p: turn.__setitem__(0, turn[0] + 1))
             for p in engine.module.parameters() if p.requires_grad]
    losses = run_steps(engine, "gpt", steps=2)
    for h in hooks:
        h.remove()
    master = engine.read_master()
    engine.close()
    assert losses == base_losses
    for n in base:
        assert torch.equal(master[n], base[n]), n
    own, crossed, same = {}, 0, 0
    for i, (call, a, b) in enumerate(log):
        if call == "grad_buffer":
            own[a] = b
        elif call == "reduce":
            assert b == own.pop(a), "the reduction named another stream than the buffer's"
        elif call == "copy" and b != own[a]:
            # From another stream: it waits for the buffer's stream (the zeroing) first, and the
            # buffer's stream (the reduction) for it after.
            assert log[i - 1] == ("wait_stream", b, own[a]), log[i - 1:i + 2]
            assert log[i + 1] == ("wait_stream", own[a], b), log[i - 1:i + 2]
            crossed += 1
        elif call == "copy":
            same += 1
    assert crossed > 0 and same > 0 and not own
    # And no waits besides: a copy on the buffer's own stream needs none.
    assert sum(e[0] == "wait_stream" for e in log) == 2 * crossed


@pytest.mark.parametrize("stage,offload,param,spec,expected", [
    (3, "none", "none", None, True), (3, "cpu", "none", False, True),
    (3, "none", "cpu", None, False), (2, "none", "none", None, False),
    (3, "cpu", "none", None, False), (3, "nvme", "none", False, True)])
def test_gathers_alias_home_only_where_release_frees_nothing(stage, offload, param, spec,
                                                            expected, tmp_path):
    """One rank, stage 3, parameters on the device and no speculative step: the views are the
    parameters' home, so on a GPU the adapter releases them without waiting for torch's stream.
    Params offloaded (the store's device copy may be evicted and reused), stages 0-2 (the
    replica is updated by the step) and a speculative step (which writes params during the
    backward) keep the wait."""
    cfg = ds_config(stage, offload, lr=LR, wd=WD, nvme_path=str(tmp_path))
    if param != "none":
        cfg["zero_optimization"]["offload_param"] = {"device": param}
    if spec is not None:
        cfg["zero_optimization"]["offload_optimizer"]["speculative_step"] = spec
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    assert engine._engine.gathers_alias_home is expected
    assert not engine._release_waits  # the host adapter never waits: no GPU
    engine.close()


@pytest.mark.parametrize("kind,param", [("gpt", "none"), ("gpt", "cpu"), ("tiedmm", "cpu")])
def test_held_back_releases_give_the_same_bits_and_wait_for_their_own_event(kind, param):
    """On a GPU a release that frees or reuses memory is held back by one group and waits for
    an event behind the group's kernels (never the whole stream). Injected here on the host
    engine with logged events: the same bits as releasing at once (a re-gather of a held group,
    as the tied weights do, releases it first), each release right after its own event's wait,
    and at most one held."""
    from strata.engine import _HeldBack
    cfg = ds_config(3, "none", dtype="bf16", lr=LR, wd=WD)
    if param != "none":
        cfg["zero_optimization"]["offload_param"] = {"device": param}
    base_losses, base, _ = train(kind, cfg, steps=3)
    log = []
    engine, _, _, _ = strata.initialize(model=make_model(kind), config=cfg)
    release = engine._engine.release

    def logged(gi):
        log.append(("release", gi))
        release(gi)

    taken = []

    class Held(_HeldBack):  # counts the re-gathers of a group still held
        __slots__ = ()

        def take(self, gi):
            taken.extend(g for g, _ in self.held if g == gi)
            super().take(gi)

    engine._release_waits = True
    held = Held(logged, engine._wait_torch, 1, lambda: _LoggedEvent(log), engine._device_waits)
    engine._held_releases = held
    most = []
    losses = run_steps(engine, kind, after_forward=lambda: most.append(len(held.held)))
    master = engine.read_master()
    waits = engine.stats()["adapter"]["device_waits"]
    engine.close()
    assert losses == base_losses
    for n in base:
        assert torch.equal(master[n], base[n]), n
    assert waits == sum(1 for e in log if e[0] == "wait")
    releases = [i for i, e in enumerate(log) if e[0] == "release"]
    assert releases, "nothing was released through the held path"
    for i in releases:
        assert log[i - 1][0] == "wait", log[i - 1]
    assert max(most) <= 1
    assert taken, "no group was gathered again while its release was held"  # the tied weight


def _split(log, marker):
    part = []
    for e in log:
        if e[0] == marker:
            yield part
            part = []
        else:
            part.append(e)


def test_hooks_gather_one_module_at_a_time_and_tied_weights():
    """Inside forward only the running module's parameters are whole; outside, all are empty;
    the tied head gathers the embedding's group."""
    model = make_model("gpt")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3))
    seen = []

    def probe(module, args):
        whole = [n for n, p in model.named_parameters() if p.numel() > 0]
        seen.append((module, whole))
    for name in ("wte", "blocks.0.qkv", "head"):
        model.get_submodule(name).register_forward_pre_hook(probe)
    loss = engine(*batch("gpt", 0))
    assert [(m, w) for m, w in seen] == [
        (model.wte, ["wte.weight"]), (model.blocks[0].qkv, ["blocks.0.qkv.weight"]),
        (model.head, ["wte.weight"])]  # named_parameters lists the tied weight once
    assert all(p.numel() == 0 for p in model.parameters())
    engine.backward(loss)
    assert all(p.numel() == 0 and p.grad is None for p in model.parameters())
    engine.step()
    with torch.no_grad():  # no autograd: gathered and released around each module only
        engine(*batch("gpt", 1))
    assert all(p.numel() == 0 for p in model.parameters())
    engine.close()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_regathers_in_recomputation(reentrant):
    """torch.utils.checkpoint recomputes each block's forward inside backward: the hooks gather
    again there, and training still matches torch (both of checkpoint's implementations: the
    saved-tensor hooks one, which strata's own hooks pass every tensor to, and the reentrant)."""
    from torch.utils.checkpoint import checkpoint

    def ckpt_forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=reentrant)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 targets.view(-1))
    model = make_model("gpt")
    model.forward = ckpt_forward.__get__(model)
    losses, params, _ = train("gpt", ds_config(3, "cpu", lr=LR, wd=WD), steps=2, model=model)
    check_against_torch("gpt", losses, params, steps=2)


def test_saved_tensor_hooks_of_the_user_see_every_tensor():
    """save_on_cpu (a saved-tensor hooks context) around forward: strata's hooks hand it every
    saved tensor, and training matches torch."""
    model = make_model("gpt")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, lr=LR, wd=WD))
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    losses = []
    for step in range(2):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = engine(*batch("gpt", step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert (32, 96) in packed  # qkv's weight (its transposed view, saved by F.linear)
    master = engine.read_master()
    engine.close()
    check_against_torch("gpt", losses, {n: master[n] for n, _ in model.named_parameters()},
                        steps=2)


class _Boxed:
    """An output type strata's hooks do not look into."""

    def __init__(self, t):
        self.t = t


class _BoxedInner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return _Boxed(x @ self.w.T)


class _BoxedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _BoxedInner()

    def forward(self, x):
        return self.inner(x).t.square().mean()


def test_backward_that_would_read_a_released_parameter_fails_naming_it():
    """Stage 3: a module's backward that would read its weights while they are not gathered (its
    output reached the loss inside an object the hooks do not see, so nothing gathered them
    again) fails with the module and the parameter named, never reads released memory. (Stages
    0-2 keep every parameter whole: there the same model trains, test_external_parameters.py.)"""
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=_BoxedModel(), config=ds_config(3))
    loss = engine(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"backward of module 'inner' reads parameter "
                                           r"'inner\.w' .*not gathered"):
        engine.backward(loss)
    engine.close()


def test_backward_after_gathered_parameters_ends_fails_naming_the_block():
    """A graph built inside engine.gathered_parameters() on a view of a weight, differentiated
    after the block released it: refused, never computed from the released buffer; inside the
    block it is the gathered weight's gradient."""
    model = make_model("mlp")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3))
    x = torch.randn(5, 40, requires_grad=True)
    with engine.gathered_parameters():
        w = model.fc2.weight.detach().clone()
        inside = (x @ model.fc2.weight.T).sum()
        inside.backward(inputs=[x])
        torch.testing.assert_close(x.grad, w.sum(0).expand(5, 40))
        x.grad = None
        after = (x @ model.fc2.weight.T).sum()
    with pytest.raises(RuntimeError, match=r"backward of an engine\.gathered_parameters\(\) "
                                           r"block reads parameter 'fc2\.weight'"):
        after.backward(inputs=[x])
    engine.close()


def test_saved_weight_views_hold_no_released_memory():
    """After forward every group is released; what autograd saved of a Linear's weight (the
    transposed view F.linear saves) is not a pointer into the released buffer: reading it
    before backward gathers again is refused, naming the module."""
    model = make_model("gpt")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3))
    loss = engine(*batch("gpt", 0))
    node, seen = loss.grad_fn, set()
    todo = [node]
    saved = None
    while todo and saved is None:  # find the head's addmm/mm node, which saved weight.t()
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if "_saved_mat2" in dir(n):  # hasattr would read it
            saved = n
        todo.extend(f for f, _ in n.next_functions)
    assert saved is not None
    with pytest.raises(RuntimeError, match="not gathered"):
        saved._saved_mat2
    engine.backward(loss)
    engine.step()
    engine.close()


def test_stats_are_the_engine_counters(tmp_path):
    cfg = ds_config(3, "nvme", lr=LR, wd=WD, nvme_path=str(tmp_path))
    out = []
    train("gpt", cfg, steps=2, engine_out=out)
    engine, reports = out[0]
    s = engine.stats()
    groups = len(engine._groups)
    assert s["global_step"] == 2
    # One rank: the reduction is the identity, so no reduce-scatter reaches the communicator
    # (the engine accumulates straight from the trainer's gradient buffer); the step reports'
    # timings add up to the totals.
    assert groups > 0
    assert s["comm"]["reduce_scatter"]["calls"] == 0
    assert s["comm"]["all_gather"]["calls"] == 0
    keys = ("gather_wait_ns", "gather_fetch_wait_ns", "reduce_wait_ns", "grad_lease_wait_ns",
            "optimizer_ns", "optimizer_io_wait_ns", "step_ns")
    for key in keys:
        assert s[key] == sum(r["timings"][key] for r in reports), key
    # The store waits are parts of the Gather and reduction waits; the first step fetches every
    # group (later ones may use kept copies) and every step leases its accumulators.
    assert reports[0]["timings"]["gather_fetch_wait_ns"] > 0
    for r in reports:
        t = r["timings"]
        assert t["gather_fetch_wait_ns"] <= t["gather_wait_ns"]
        assert 0 < t["grad_lease_wait_ns"] <= t["reduce_wait_ns"]
    # This model's NVMe-homed state fits its host budget: it stays cached there and is never
    # written home (docs/design.md), so no NVMe IO is counted.
    assert s["layout"]["cache_bytes"]["host"] > 0
    assert s["store"]["io_bytes"] == 0 and "host->nvme" not in s["store"]["bytes_moved"]
    assert set(s["store"]["room_wait_ns"]) == {"hbm", "host", "nvme"}
    assert s["layout"]["stage"] == 3 and s["layout"]["offload_optimizer"] == "nvme"
    # On the host the adapter never waits for a GPU.
    assert s["adapter"] == {"device_waits": 0, "device_wait_ns": 0}
    engine.close()


def test_engine_api():
    cfg = ds_config(3, "cpu", lr=LR, wd=WD)
    model = make_model("mlp")
    engine, opt, loader, sched = strata.initialize(model=model, config=json.dumps(cfg))
    assert engine.module is model
    assert engine.get_lr() == [pytest.approx(LR)]
    assert opt.param_groups[0]["lr"] == pytest.approx(LR)
    assert engine.is_gradient_accumulation_boundary()
    assert model.fc1.weight.numel() == 0 and model.fc1.weight.ds_shape == (40, 16)
    with engine.gathered_parameters():
        assert model.fc1.weight.shape == (40, 16)
    loss = engine(*batch("mlp", 0))
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1
    assert engine.last_step_report["grad_norm"] > 0
    engine.close()


def test_checkpoint_resume_is_bit_exact_and_16bit_export_loads(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    ckpt = tmp_path / "ckpt"

    def run(steps, first, nvme, save=False, load=False):
        model = make_model("gpt")
        cfg = ds_config(3, "nvme", dtype="bf16", lr=LR, wd=WD, nvme_path=str(nvme))
        engine, _, _, _ = strata.initialize(model=model, config=cfg)
        client = None
        if load:
            path, client = engine.load_checkpoint(ckpt)
            assert path == os.path.join(str(ckpt), "global_step2")
            assert engine.global_steps == 2
        losses = []
        for step in range(first, first + steps):
            loss = engine(*batch("gpt", step))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if save and step == 1:
                assert engine.save_checkpoint(ckpt, client_state={"data_pos": step + 1})
        return engine, losses, client

    nv = [tmp_path / f"nvme{i}" for i in range(2)]
    for d in nv:
        d.mkdir()
    full, full_losses, _ = run(4, 0, nv[0], save=True)
    resumed, tail_losses, client = run(2, 2, nv[1], load=True)
    assert client == {"data_pos": 2}
    assert tail_losses == full_losses[2:]
    a, b = full.read_master(), resumed.read_master()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    # The 16-bit export: state_dict names (the tied head too), the working bf16 values.
    assert full.save_16bit_model(tmp_path / "out", "model.safetensors")
    sd = safetensors.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(sd) == set(full.module.state_dict())
    assert torch.equal(sd["head.weight"], sd["wte.weight"])
    for n, m in a.items():
        assert sd[n].dtype == torch.bfloat16
        assert torch.equal(sd[n], m.to(torch.bfloat16)), n
    # Nothing there: (None, None) as DeepSpeed.
    with pytest.warns(UserWarning, match="no checkpoint"):
        assert resumed.load_checkpoint(tmp_path / "empty") == (None, None)
    full.close()
    resumed.close()


def test_save_checkpoint_keep_last_prunes_and_the_newest_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = ds_config(2, "cpu", lr=LR, wd=WD)
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    with pytest.raises(ValueError, match="keep_last"):
        engine.save_checkpoint(ckpt, keep_last=-1)
    inodes = {}
    for step in range(4):
        loss = engine(*batch("mlp", step))
        engine.backward(loss)
        engine.step()
        assert engine.save_checkpoint(ckpt, keep_last=2)
        tag = f"global_step{step + 1}"
        inodes[tag] = os.stat(ckpt / tag / "rank0.safetensors").st_ino
    tags = sorted(d.name for d in ckpt.iterdir() if d.is_dir())
    assert tags == ["global_step3", "global_step4"]  # the older two were removed
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    # From the third save on, each new save reused the rank file of the checkpoint it replaced.
    assert inodes["global_step3"] == inodes["global_step1"]
    assert inodes["global_step4"] == inodes["global_step2"]
    master = engine.read_master()
    resumed, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    path, _ = resumed.load_checkpoint(ckpt)
    assert path == os.path.join(str(ckpt), "global_step4")
    for n, m in resumed.read_master().items():
        assert torch.equal(m, master[n]), n
    engine.close()
    resumed.close()


def test_save_checkpoint_retention_comes_from_the_config_unless_named(tmp_path):
    cfg = ds_config(2, "cpu", lr=LR, wd=WD)
    cfg["checkpoint"] = {"keep_last": 1}
    engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
    ckpt = tmp_path / "from_config"
    for step in range(3):
        loss = engine(*batch("mlp", step))
        engine.backward(loss)
        engine.step()
        assert engine.save_checkpoint(ckpt)  # keep_last from the config: only the newest stays
    assert sorted(d.name for d in ckpt.iterdir() if d.is_dir()) == ["global_step3"]
    named = tmp_path / "named"
    for tag in ("a", "b"):
        assert engine.save_checkpoint(named, tag=tag, keep_last=0)  # an explicit 0 keeps all
    assert sorted(d.name for d in named.iterdir() if d.is_dir()) == ["a", "b"]
    engine.close()


def test_zero_init_partitions_at_construction_and_trains_as_torch():
    cfg = ds_config(3, "cpu", lr=LR, wd=WD)
    with strata.zero.Init(config=cfg):
        model = make_model("gpt")
    assert all(p.numel() == 0 for p in model.parameters())
    assert model.head.weight is model.wte.weight  # tied after construction
    assert model.wte.weight.ds_shape == (37, 32)
    with strata.zero.GatheredParameters(model.wte.weight):  # whole before initialize too
        ref = make_model("gpt")
        assert torch.equal(model.wte.weight, ref.wte.weight)
    assert model.wte.weight.numel() == 0
    assert torch.nn.Linear(2, 2).weight.numel() == 4  # outside the block: ordinary modules
    losses, params, _ = train("gpt", cfg, model=model)
    check_against_torch("gpt", losses, params)
    with pytest.raises(ValueError, match="stage 3"):
        strata.zero.Init(config=ds_config(2))


def test_zero_init_keeps_a_decorator_that_wrapped_a_class_created_in_the_block():
    """A class created inside zero.Init (a lazy transformers import) whose decorator wraps
    __init__ after the class exists (transformers' use_kernelized_func sets attributes its
    forward reads): after the block, an instance built outside still runs the decorator's
    __init__ and is not partitioned; one built inside was."""
    def sets_kernels(cls):
        inner = cls.__init__

        def __init__(self, *args, **kwargs):
            inner(self, *args, **kwargs)
            self._kernel_funcs = {"ok": True}
        cls.__init__ = __init__
        return cls

    with strata.zero.Init(config=ds_config(3)):
        @sets_kernels
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

        inside = Block()
    assert inside._kernel_funcs == {"ok": True} and inside.lin.weight.numel() == 0
    outside = Block()
    assert outside._kernel_funcs == {"ok": True}
    assert outside.lin.weight.shape == (8, 8)  # whole: the block is over
    with strata.zero.Init(config=ds_config(3)):
        again = Block()
    assert again._kernel_funcs == {"ok": True} and again.lin.weight.numel() == 0


def test_zero_init_without_a_config_partitions_as_deepspeeds_does():
    """`with deepspeed.zero.Init():` (DeepSpeed's docstring example): stage 3 assumed; the
    engine trains the model as torch."""
    with strata.zero.Init():
        model = make_model("gpt")
    assert all(p.numel() == 0 for p in model.parameters())
    losses, params, _ = train("gpt", ds_config(3, "cpu", lr=LR, wd=WD), model=model)
    check_against_torch("gpt", losses, params)


def test_zero_init_module_partitions_an_existing_model_and_trains_as_torch():
    """deepspeed.zero.Init(module=model): a model built whole (its head tied to the embedding)
    is partitioned at once, as if built in the block; disabled, it is left alone."""
    cfg = ds_config(3, "cpu", lr=LR, wd=WD)
    kept = make_model("gpt")
    strata.zero.Init(module=kept, config=cfg, enabled=False)
    assert all(p.numel() > 0 for p in kept.parameters())
    model = make_model("gpt")
    strata.zero.Init(module=model, config_dict_or_path=cfg)
    assert all(p.numel() == 0 and p.ds_status == strata.zero.ZeroParamStatus.NOT_AVAILABLE
               for p in model.parameters())
    assert model.head.weight is model.wte.weight and model.wte.weight.ds_shape == (37, 32)
    with strata.zero.GatheredParameters(model.wte.weight):
        assert torch.equal(model.wte.weight, make_model("gpt").wte.weight)
    losses, params, _ = train("gpt", cfg, model=model)
    check_against_torch("gpt", losses, params)
    half = make_model("mlp")
    strata.zero.Init(module=half, config=cfg, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with pytest.raises(TypeError, match="nn.Module"):
        strata.zero.Init(module="model", config=cfg)


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_persistent_groups_stay_whole_between_steps_and_train_as_torch(offload):
    """stage3_param_persistence_threshold (DeepSpeed's ds_persist): a module whose parameters
    are no larger than it keeps them whole outside forward, after initialize and after every
    step with the step's new values; larger ones stay empty. Training is torch's; GatheredParameters
    writes and tensor-fragment writes on them work; close empties them."""
    cfg = ds_config(3, offload, lr=LR, wd=WD)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 64  # the LayerNorms
    model = make_model("gpt")
    held = []
    losses, params, _ = train("gpt", cfg, model=model, engine_out=held)
    check_against_torch("gpt", losses, params)
    engine, _ = held[0]
    whole = {n for n, p in model.named_parameters() if p.numel()}
    assert whole == {n for n, _ in model.named_parameters() if ".ln" in n or "ln_f" in n}
    for n, p in model.named_parameters():
        assert getattr(p, "ds_persist", False) == (n in whole), n
        assert p.ds_status == (strata.zero.ZeroParamStatus.AVAILABLE if n in whole
                               else strata.zero.ZeroParamStatus.NOT_AVAILABLE), n
        if n in whole:
            assert torch.equal(p.detach(), params[n]), n  # fp32: the step's new values
    with strata.zero.GatheredParameters([model.ln_f.weight], modifier_rank=0):
        with torch.no_grad():
            model.ln_f.weight.fill_(0.25)
    assert torch.equal(model.ln_f.weight.detach(), torch.full((32,), 0.25))  # whole, written
    strata.utils.safe_set_full_fp32_param(model.ln_f.bias, torch.ones(32))
    assert torch.equal(model.ln_f.bias.detach(), torch.ones(32))
    engine.close()
    assert all(p.numel() == 0 for p in model.parameters())


def test_model_persistence_threshold_caps_the_persistent_elements():
    """stage3_model_persistence_threshold (DeepSpeed's mark_persistent_parameters): modules under
    the param threshold persist, in model order, while their running total stays within it."""
    cfg = ds_config(3, "cpu", lr=LR, wd=WD)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 64  # the LayerNorms: 64 each
    cfg["zero_optimization"]["stage3_model_persistence_threshold"] = 150  # two of them
    model = make_model("gpt")
    held = []
    losses, params, _ = train("gpt", cfg, model=model, engine_out=held)
    check_against_torch("gpt", losses, params)
    lns = [n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(lns) > 2
    persistent = [n for n, p in model.named_parameters() if getattr(p, "ds_persist", False)]
    assert persistent == [f"{m}.{w}" for m in lns[:2] for w in ("weight", "bias")]
    assert all(p.numel() for n, p in model.named_parameters() if n in persistent)
    assert all(not p.numel() for n, p in model.named_parameters() if n not in persistent)
    held[0][0].close()


def test_gathered_parameters_modifier_rank_writes_back():
    model = make_model("gpt")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, lr=LR, wd=WD))
    assert model.wte.weight.numel() == 0
    with strata.zero.GatheredParameters(model.parameters()):
        assert model.wte.weight.shape == (37, 32)
        assert model.head.weight is model.wte.weight
    assert model.wte.weight.numel() == 0
    with strata.zero.GatheredParameters([model.ln_f.weight, model.ln_f.bias], modifier_rank=0):
        with torch.no_grad():
            model.ln_f.weight.fill_(0.5)
    master = engine.read_master()
    assert torch.equal(master["ln_f.weight"], torch.full((32,), 0.5))
    assert torch.equal(master["wte.weight"], make_model("gpt").wte.weight.detach())  # kept
    with strata.zero.GatheredParameters(model.ln_f.weight):
        assert torch.equal(model.ln_f.weight, torch.full((32,), 0.5))
    # DeepSpeed's object: params, src_rank, enabled (False where nothing is partitioned); the
    # values written are kept when the block raises, as DeepSpeed's exit broadcasts them.
    gathered = strata.zero.GatheredParameters([model.ln_f.bias, None], modifier_rank=0)
    assert gathered.params == [model.ln_f.bias] and gathered.src_rank == 0 and gathered.enabled
    assert not strata.zero.GatheredParameters([torch.nn.Parameter(torch.ones(2))]).enabled
    with pytest.raises(KeyError, match="after the write"):
        with gathered:
            with torch.no_grad():
                model.ln_f.bias.fill_(-1.5)
            raise KeyError("after the write")
    assert torch.equal(engine.read_master()["ln_f.bias"], torch.full((32,), -1.5))
    assert model.ln_f.bias.numel() == 0  # released
    loss = engine(*batch("gpt", 0))
    engine.backward(loss)
    engine.step()
    # After a step: the working params only, as DeepSpeed (its fp32 master is kept).
    master = engine.read_master()["ln_f.weight"]
    with pytest.warns(UserWarning, match="writes the working parameters only"):
        with strata.zero.GatheredParameters(model.ln_f.weight, modifier_rank=0):
            with torch.no_grad():
                model.ln_f.weight.fill_(0.25)
    with strata.zero.GatheredParameters(model.ln_f.weight):
        assert torch.equal(model.ln_f.weight, torch.full((32,), 0.25))
    assert torch.equal(engine.read_master()["ln_f.weight"], master)
    engine.close()


def test_config_error_is_an_exception_with_the_message():
    cfg = ds_config(0)
    cfg["zero_optimization"]["stage"] = 5
    with pytest.raises(strata.ConfigError, match=r"zero_optimization\.stage"):
        strata.initialize(model=make_model("mlp"), config=cfg)
    cfg = ds_config(0)
    cfg["optimizer"]["type"] = "SGD"
    with pytest.raises(strata.StrataError, match="optimizer.type"):
        strata.initialize(model=make_model("mlp"), config=cfg)


def test_unsupported_features_are_named():
    model = make_model("mlp")
    with pytest.raises(TypeError, match="SGD is not supported"):
        strata.initialize(model=model, config=ds_config(0),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    # Sections of features strata does not run: refused by the config check, named, where
    # DeepSpeed would turn them on (offloadctl config check says the same).
    for key, section, path in [
            ("amp", {"enabled": True}, "amp.enabled"),
            ("sparse_attention", {"mode": "fixed"}, "sparse_attention"),
            ("compression_training", {"head_pruning": {"shared_parameters": {"enabled": True}}},
             "compression_training.head_pruning.shared_parameters.enabled")]:
        cfg = ds_config(0)
        cfg[key] = section
        with pytest.raises(strata.ConfigError, match=path.replace(".", r"\.")):
            strata.initialize(model=model, config=cfg)
    # A pipeline section is DeepSpeed's for a PipelineModule only; a plain model ignores it.
    cfg = ds_config(0)
    cfg["pipeline"] = {"pipe_partitioned": True}
    engine, *_ = strata.initialize(model=model, config=cfg)
    assert engine.train_micro_batch_size_per_gpu() > 0


def test_nvme_path_not_writable_is_an_exception(tmp_path):
    cfg = ds_config(3, "nvme", nvme_path=str(tmp_path / "does" / "not" / "exist"))
    with pytest.raises(strata.StrataError, match="does/not/exist"):
        strata.initialize(model=make_model("mlp"), config=cfg)
    # A path under a regular file: not writable even for root.
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = ds_config(3, "nvme", nvme_path=str(blocker / "swap"))
    with pytest.raises(strata.StrataError, match="a_file"):
        strata.initialize(model=make_model("mlp"), config=cfg)


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "nvme")])
def test_an_engine_dropped_without_close_is_collected_and_frees_its_swap_file(stage, offload,
                                                                               tmp_path):
    """A script (a notebook cell run again, a trainer replaced) that drops a trained engine
    without close(): once nothing references it the collector frees it (its gradient hooks
    hold it weakly; the parameters' accumulators keep them where the collector does not look).
    With NVMe, an engine still referenced keeps its swap file (a new one of the same rank and
    nvme_path is refused, naming it), and once collected the new one starts there."""
    import gc
    import weakref
    cfg = ds_config(stage, offload, nvme_path=str(tmp_path))

    def trained():
        engine, _, _, _ = strata.initialize(model=make_model("mlp"), config=cfg)
        engine.backward(engine(*batch("mlp", 0)))
        engine.step()
        return engine

    kept = trained()
    if offload == "nvme":
        assert list(tmp_path.glob("strata-swap-rank0.swp"))
        with pytest.raises(strata.StrataError, match="in use by another strata engine"):
            strata.initialize(model=make_model("mlp"), config=cfg)
    gone = weakref.ref(kept)
    del kept
    gc.collect()
    assert gone() is None
    engine = trained()  # the same rank and nvme_path
    assert engine.global_steps == 1
    engine.close()


@pytest.mark.parametrize("stage,offload", [(1, "cpu"), (3, "nvme")])
def test_a_model_passed_to_initialize_again_continues_from_its_open_engines_weights(
        stage, offload, tmp_path):
    """initialize on a model whose parameters an engine still open holds (a notebook cell run
    again with the model built once, a second Trainer on it): that engine is closed first with
    a warning, its trained weights kept in the parameters (in their dtype), so the new engine
    starts from them, in the same nvme_path; and parameters are not written while gathered."""
    cfg = ds_config(stage, offload, lr=LR, wd=WD, nvme_path=str(tmp_path))
    model = make_model("mlp")
    first, _, _, _ = strata.initialize(model=model, config=cfg)
    first.backward(first(*batch("mlp", 0)))
    first.step()
    trained = first.read_master()
    with pytest.warns(UserWarning, match="in an engine that is still open; it is closed first"):
        second, _, _, _ = strata.initialize(model=model, config=cfg)
    assert first._closed
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        n: torch.float32 for n, _ in model.named_parameters()}
    again = second.read_master()
    for name, value in trained.items():
        assert torch.equal(again[name], value), name
    if stage == 3:
        with second.gathered_parameters():
            with pytest.raises(RuntimeError, match="parameters are gathered"):
                strata.utils.safe_set_full_fp32_param(next(model.parameters()),
                                                      torch.zeros(next(iter(trained.values()))
                                                                  .shape))
    second.close()


@pytest.mark.parametrize("stage,offload", [(0, "none"), (3, "cpu")])
def test_initialize_converts_each_range_to_fp32_only_when_the_engine_asks(
        stage, offload, monkeypatch):
    """initialize hands the engine rank 0's module weights range by range as it sends them
    (init_from_rank0_fill), each converted to fp32 when asked for and dropped once copied, never
    the whole model in fp32 at once (4 bytes per parameter of host memory beside the engine's
    own state). The master weights are the module's, exactly. (Several ranks: test_distributed.)"""
    import weakref
    from strata import _strata
    calls, alive = [], []
    real = _strata.Engine

    class Spy(_EngineSpy):
        def init_from_rank0(self, tensors):
            calls.append("rank0")
            self._inner.init_from_rank0(tensors)

        def init_from_rank0_fill(self, fill):
            def counted(gi, pi, begin, end):
                alive.append(sum(r() is not None for r in refs))
                out = fill(gi, pi, begin, end)
                refs.append(weakref.ref(out))
                calls.append((gi, pi, begin, end))
                return out
            refs = []
            self._inner.init_from_rank0_fill(counted)

    monkeypatch.setattr(_strata, "Engine", lambda *a, **k: Spy(real(*a, **k), []))
    model = make_model("gpt").to(torch.bfloat16)  # each range is a new fp32 tensor
    want = {n: p.detach().to(torch.float32).clone() for n, p in model.named_parameters()}
    engine, _, _, _ = strata.initialize(model=model,
                                        config=ds_config(stage, offload, dtype="bf16"))
    master = engine.read_master()
    engine.close()
    assert "rank0" not in calls
    ranges = [c for c in calls if c != "rank0"]
    assert len(ranges) >= len(want)
    assert max(alive) == 0  # each converted range dropped before the next is asked for
    assert set(master) == set(want)
    for n, w in want.items():
        assert torch.equal(master[n], w), n


def test_a_config_with_no_batch_size_is_refused_as_deepspeed_refuses_it():
    """Neither train_batch_size nor train_micro_batch_size_per_gpu: DeepSpeed's
    _set_batch_related_parameters refuses the config; so does initialize, through the checker's
    rule (the one offloadctl config check warns with), naming the key; the model is untouched."""
    cfg = ds_config(3)
    del cfg["train_micro_batch_size_per_gpu"]
    model = make_model("gpt")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(strata.ConfigError, match=r"train_batch_size: neither train_batch_size "
                                                 r"nor train_micro_batch_size_per_gpu is given"):
        strata.initialize(model=model, config=cfg)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    cfg["train_batch_size"] = 4  # one of them is enough: gas 1, micro 4 at one rank
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    assert engine.train_micro_batch_size_per_gpu() == 4
    engine.close()


def test_a_scripts_own_initialize_drops_the_zero_autos_as_deepspeed():
    """OpenRLHF's get_train_ds_config leaves reduce_bucket_size, stage3_prefetch_bucket_size and
    stage3_param_persistence_threshold "auto" and calls deepspeed.initialize itself: DeepSpeed
    drops them (their defaults apply), so the run is the one without them. A key DeepSpeed would
    use as the string itself stays refused, naming it."""
    cfg = ds_config(3, "cpu")
    del cfg["zero_optimization"]["stage3_param_persistence_threshold"]
    auto = json.loads(json.dumps(cfg))
    auto["zero_optimization"].update(reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                                     stage3_param_persistence_threshold="auto")
    want_losses, want, _ = train("gpt", cfg)
    losses, got, _ = train("gpt", auto)
    assert losses == want_losses
    for n in want:
        assert torch.equal(got[n], want[n]), n
    auto["train_micro_batch_size_per_gpu"] = "auto"
    with pytest.raises(strata.ConfigError, match="train_micro_batch_size_per_gpu"):
        strata.initialize(model=make_model("gpt"), config=auto)
