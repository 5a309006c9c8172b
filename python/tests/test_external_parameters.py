"""Parameters read outside the module that owns them: a tied output head written as
`x @ self.wte.weight.t()` in the parent's forward. Stages 0-2 keep every parameter whole; stage 3
gathers a parameter read while released inside the engine's forward (registering it as an
external parameter of the running module, with a one-time notice), or ahead of time through
strata.zero.register_external_parameter. Two processes: test_distributed.py (tiedmm cases)."""
import functools
import warnings

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from models import batch, ds_config, make_model  # noqa: E402
from test_adapter import LR, WD, check_against_torch, train  # noqa: E402

NOTICE = "registered as an external parameter"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tied_matmul_head_matches_torch(stage):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses, params, _ = train("tiedmm", ds_config(stage, lr=LR, wd=WD), steps=3)
    check_against_torch("tiedmm", losses, params, steps=3)
    notices = [str(w.message) for w in seen if NOTICE in str(w.message)]
    if stage < 3:
        assert notices == []  # whole everywhere: nothing to gather
    else:  # once, on the first forward: named parameter and module
        assert len(notices) == 1, notices
        assert "'wte.weight'" in notices[0] and "module '<root>'" in notices[0]


def test_registered_external_parameter_is_gathered_without_notice():
    model = make_model("tiedmm")
    strata.zero.register_external_parameter(model, model.wte.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice
        losses, params, _ = train("tiedmm", ds_config(3, lr=LR, wd=WD), steps=2, model=model)
    check_against_torch("tiedmm", losses, params, steps=2)


def test_unregister_external_parameter_and_read_outside_forward_at_stage3():
    model = make_model("tiedmm")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, lr=LR, wd=WD))
    strata.zero.register_external_parameter(model, model.wte.weight)  # after initialize too
    seen = []
    model.blocks[0].register_forward_pre_hook(
        lambda m, a: seen.append(model.wte.weight.numel()))
    engine(*batch("tiedmm", 0))
    assert seen == [37 * 32]  # the root's call holds it for the whole forward
    strata.zero.unregister_external_parameter(model, model.wte.weight)
    with pytest.warns(UserWarning, match=NOTICE):  # read again: gathered, registered again
        loss = engine(*batch("tiedmm", 0))
    engine.backward(loss)
    engine.step()
    assert model.wte.weight.numel() == 0  # outside forward: empty at stage 3, as DeepSpeed
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        strata.zero.register_external_parameter(model, torch.zeros(2))
    engine.close()


def _penalized_mlp_run(stage, gathered, steps=3):
    """The mlp trained with an L2 penalty over every parameter added to the loss after the
    forward (stage 3: inside a GatheredParameters block when `gathered`); the losses and
    parameters."""
    model = make_model("mlp")
    cfg = ds_config(stage, lr=LR, wd=WD)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    losses = []
    for step in range(steps):
        loss = engine(*batch("mlp", step))
        with strata.zero.GatheredParameters(list(engine.parameters()), enabled=gathered):
            total = loss + 0.1 * sum(p.square().sum() for p in engine.parameters())
            engine.backward(total)
        engine.step()
        losses.append(total.item())
    with strata.zero.GatheredParameters(list(engine.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return losses, params


def test_a_penalty_over_the_parameters_outside_forward():
    """At stage 3 a parameter is empty after the forward, as DeepSpeed's: a penalty summed over
    engine.parameters() there fails in backward with autograd's shape message, to which strata
    adds the cause and the way out, and the engine trains on; computed with its backward in a
    GatheredParameters block it trains as torch, as at stage 2 without one."""
    model = make_model("mlp")
    cfg = ds_config(3, lr=LR, wd=WD)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    loss = engine(*batch("mlp", 0))
    penalty = sum(p.square().sum() for p in engine.parameters())
    assert penalty.item() == 0.0  # empty parameters, as DeepSpeed's
    with pytest.raises(RuntimeError, match="invalid gradient") as failed:
        engine.backward(loss + penalty)
    assert "GatheredParameters" in "\n".join(getattr(failed.value, "__notes__", []))
    engine.backward(engine(*batch("mlp", 0)))  # the failed backward left nothing behind
    engine.step()
    engine.close()

    ref = make_model("mlp")  # torch on the same model, data and AdamW
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    ref_losses = []
    for step in range(3):
        total = ref(*batch("mlp", step)) + 0.1 * sum(p.square().sum() for p in ref.parameters())
        opt.zero_grad()
        total.backward()
        opt.step()
        ref_losses.append(total.item())
    for stage, gathered in [(2, False), (3, True)]:
        losses, params = _penalized_mlp_run(stage, gathered)
        assert losses == pytest.approx(ref_losses, rel=1e-5), stage
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), atol=2e-5, rtol=1e-4, msg=n)


class _Returns(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self):
        return self.w


class _UsesReturned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.src = _Returns()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) @ self.src()).square().mean()


def test_parameter_returned_by_a_submodule_stays_gathered_for_the_caller():
    """As DeepSpeed: a parameter a module's forward returns belongs to the calling module."""
    def run(stage):
        torch.manual_seed(0)
        model = _UsesReturned()
        engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD))
        losses = []
        for step in range(2):
            loss = engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        master = engine.read_master()
        engine.close()
        return losses, master
    with pytest.warns(UserWarning, match="returned by a submodule"):
        losses3, master3 = run(3)
    losses0, master0 = run(0)
    assert losses3 == pytest.approx(losses0, rel=1e-6)
    for n in master0:
        torch.testing.assert_close(master3[n], master0[n], atol=1e-6, rtol=1e-5)


class _Positions(torch.nn.Module):
    """Returns a view of its parameter: a slice of a learned positional table, or its
    transpose."""

    def __init__(self, transpose):
        super().__init__()
        self.transpose = transpose
        self.pe = torch.nn.Parameter(torch.randn(10, 8))

    def forward(self, n):
        return self.pe.t()[:, :n] if self.transpose else self.pe[:n]


class _UsesView(torch.nn.Module):
    def __init__(self, transpose):
        super().__init__()
        self.pos = _Positions(transpose)
        self.l1 = torch.nn.Linear(8, 8)
        self.l2 = torch.nn.Linear(8, 8)

    def forward(self, x):
        pe = self.pos(x.shape[1])
        if self.pos.transpose:
            pe = pe.t()
        h = self.l2(self.l1(x))  # gathers of other groups after pos released its own
        return (h * pe).sum(-1).square().mean()


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("offload_param", ["none", "cpu"])
def test_a_view_of_a_parameter_returned_by_a_submodule_stays_gathered(offload_param, transpose):
    """A module's forward that returns a view of its parameter (self.pe[:T], w.t()) hands the
    caller a tensor over the gathered memory: the group stays gathered for the caller, as a
    returned parameter does, so the next gathers do not reuse that memory under it. Parameters
    on the CPU, where the gather is a device buffer of its own, made the loss and the weights
    wrong without a word."""
    def run(stage):
        torch.manual_seed(0)
        model = _UsesView(transpose)
        cfg = ds_config(stage, lr=LR, wd=WD)
        if stage == 3 and offload_param != "none":
            cfg["zero_optimization"]["offload_param"] = {"device": offload_param}
        engine, _, _, _ = strata.initialize(model=model, config=cfg)
        losses = []
        for step in range(3):
            x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(step))
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with torch.no_grad():
            losses.append(engine(x).item())  # and without autograd
        master = engine.read_master()
        engine.close()
        return losses, master
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice for the adopted group
        losses3, master3 = run(3)
    losses0, master0 = run(0)
    assert losses3 == pytest.approx(losses0, rel=1e-6)
    for n in master0:
        torch.testing.assert_close(master3[n], master0[n], atol=1e-6, rtol=1e-5)


def _logged(forward):
    """A decorator as transformers puts on forwards (functools.wraps)."""
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapper


class _Layer(torch.nn.Module):
    """No parameters of its own; reads its child's bias outside the child's forward, as
    nn.TransformerEncoderLayer's eval fast path reads self_attn.in_proj_bias."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)

    @_logged
    def forward(self, x):
        return torch.tanh(self.inner(x)) + self.inner.bias


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_parameter_read_by_a_layer_without_parameters_is_registered_on_that_layer():
    """The read is the layer's, though strata hooks only modules with parameters: the group is
    registered on the layer (hooked from then on) and gathered for the layer's calls, not on the
    root, which would hold every layer's group through the whole forward."""
    def run(stage):
        torch.manual_seed(0)
        model = _Stack()
        engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD))
        held = []  # what the last layer's call sees of the first layer's bias (read so as not
        # to gather it: parameters() does not)
        model.layers[3].register_forward_pre_hook(
            lambda m, a: held.append(dict(model.layers[0].inner.named_parameters())["bias"].numel()))
        losses = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(3):
                loss = engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        master = engine.read_master()
        registered = {n: len(m.__dict__.get("_strata_external", {}))
                      for n, m in model.named_modules()}
        engine.close()
        notices = [str(w.message) for w in seen if NOTICE in str(w.message)]
        return losses, master, held, notices, registered
    losses3, master3, held3, notices, registered = run(3)
    # One notice for the four layers of one class, each registered all the same.
    assert len(notices) == 1 and "'layers.0.inner.bias'" in notices[0]
    assert "module 'layers.0'" in notices[0] and "of class _Layer" in notices[0]
    assert {n: k for n, k in registered.items() if k} == {f"layers.{i}": 1 for i in range(4)}
    # The first forward found the read inside the root's call, which holds it to its end; from
    # then on the layer's own call gathers and releases it.
    assert held3 == [8, 0, 0]
    losses0, master0, _, _, _ = run(0)
    assert losses3 == pytest.approx(losses0, rel=1e-6)
    for n in master0:
        torch.testing.assert_close(master3[n], master0[n], atol=1e-6, rtol=1e-5)


class _Orthogonality(torch.nn.Module):
    """Owns no parameter: its forward adds a penalty on its child's weights, each computed in a
    GatheredParameters(p, fwd_module=self) block where the weight is released, as PEFT's
    AdaLoraModel.forward adds its orthogonal regulariser."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))

    def forward(self, x):
        out = self.inner(x).square().mean()
        for name, p in self.inner.named_parameters():
            if name.endswith("weight"):
                with strata.zero.GatheredParameters(p, fwd_module=self, enabled=p.numel() == 0):
                    out = out + 0.1 * (p @ p.T - torch.eye(8)).norm()
        return out


@pytest.mark.parametrize("offload_param", ["none", "cpu"])
def test_gathered_parameters_with_fwd_module_inside_the_forward(offload_param):
    """The block registers the weights on the module mid-call (its hooks, added then, did not
    run at its start): the call in progress holds them and its backward gathers them, so the
    first step's backward of what the block computed finds them, and later calls gather them
    with the module's own. Trains as torch."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(_Orthogonality())  # below the root, as PeftModel's base_model

    def data(step):
        return torch.randn(2, 8, generator=torch.Generator().manual_seed(step))

    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    ref_losses = []
    for step in range(3):
        loss = ref(data(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    cfg = ds_config(3, lr=LR, wd=WD)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if offload_param != "none":
        cfg["zero_optimization"]["offload_param"] = {"device": offload_param}
    engine, _, _, _ = strata.initialize(model=model(), config=cfg)
    losses = []
    for step in range(3):
        loss = engine(data(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    master = engine.read_master()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), atol=2e-5, rtol=1e-4, msg=n)
    engine.close()


class _AsksHeadDtype(torch.nn.Module):
    """Asks its head's weight only for metadata before the body runs (transformers' Mamba2 reads
    self.lm_head.weight.dtype at the root, ViT the patch projection's), then calls the head."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        dtype, shape = self.head.weight.dtype, getattr(self.head, "weight").ds_shape
        assert tuple(shape) == (4, 8)
        h = torch.tanh(self.body(x.to(dtype)))
        if self.head.weight.device != h.device:
            raise AssertionError("the released parameter keeps its device")
        return self.head(h).square().mean()


def test_a_read_of_a_parameters_dtype_alone_gathers_nothing():
    """Asking a released parameter for its dtype, device or ds_* attributes needs none of its
    values: nothing is gathered, registered or noticed, so the head is not held through the
    body's forward and backward as a registered external parameter of the root would be."""
    torch.manual_seed(0)
    model = _AsksHeadDtype()
    cfg = ds_config(3, lr=LR, wd=WD)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    seen_by_body = []  # read so as not to gather it: named_parameters() does not
    head_numel = lambda *a: seen_by_body.append(dict(model.head.named_parameters())["weight"].numel())  # noqa: E731,E501
    model.body.register_forward_hook(head_numel)
    model.body.register_full_backward_hook(head_numel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            engine.backward(engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))))
            engine.step()
    assert not [w for w in caught if NOTICE in str(w.message)]
    assert seen_by_body == [0, 0, 0, 0]  # forward and backward, both steps
    assert "_strata_external" not in model.__dict__
    engine.close()


def test_vit_asking_its_patch_projection_for_its_dtype_gathers_nothing():
    """transformers' ViTModel.forward reads embeddings.patch_embeddings.projection.weight.dtype:
    with that read gathering nothing, the projection is released while the encoder runs."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=3))
    cfg = ds_config(3, lr=LR, wd=WD)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    projection = model.vit.embeddings.patch_embeddings.projection.weight
    modules = dict(model.named_modules())  # its layout differs between transformers versions
    layer = modules.get("vit.layers.1") or modules["vit.encoder.layer.1"]
    seen = []
    layer.register_forward_hook(lambda *a: seen.append(projection.numel()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            out = engine(pixel_values=torch.randn(2, 3, 16, 16, generator=g),
                         labels=torch.tensor([0, 2]))
            engine.backward(out.loss)
            engine.step()
    assert seen == [0, 0]
    assert not [w for w in caught if NOTICE in str(w.message)]
    engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_stages_0_to_2_keep_parameters_whole(stage, tmp_path):
    """Outside forward, after step, save and load the parameters are whole and hold the
    engine's current weights; after close they keep their last values."""
    model = make_model("tiedmm")
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, lr=LR, wd=WD))

    def check():
        master = engine.read_master()
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), master[n]), n
    check()
    loss = engine(*batch("tiedmm", 0))
    engine.backward(loss)
    engine.step()
    check()
    with engine.gathered_parameters():
        check()
    check()
    engine.save_checkpoint(tmp_path)
    check()
    engine.load_checkpoint(tmp_path)
    check()
    # A write after the first step sets the working params only (as DeepSpeed): the whole
    # parameters hold it, the master keeps its value.
    master = engine.read_master()["ln_f.weight"]
    with pytest.warns(UserWarning, match="writes the working parameters only"):
        with strata.zero.GatheredParameters(model.ln_f.weight, modifier_rank=0):
            with torch.no_grad():
                model.ln_f.weight.fill_(0.25)
    assert model.ln_f.weight.numel() > 0 and torch.all(model.ln_f.weight == 0.25)
    assert torch.equal(engine.read_master()["ln_f.weight"], master)
    with torch.no_grad():  # back to the master's values for the checks below
        with strata.zero.GatheredParameters(model.ln_f.weight, modifier_rank=0):
            model.ln_f.weight.copy_(master)
    check()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


class _ProjectWithSaved(torch.autograd.Function):
    """h @ w.t() with w saved for backward, as a fused loss's Function saves an lm_head weight;
    with gather=True it gathers w for its own product and saves it once released again, as
    TRL's chunked losses do (through maybe_gather_lm_head_ctx)."""

    @staticmethod
    def forward(ctx, h, w, gather):
        with strata.zero.GatheredParameters([w], enabled=gather):
            out = h @ w.t()
        ctx.save_for_backward(w)
        return out

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g @ w, None, None


class _Distilled(torch.nn.Module):
    """A student whose forward projects its hidden state through a frozen teacher's weight,
    gathered for that one product only: around the Function's call (`where="block"`) or inside
    it (`"function"`), so the weight is released again by the time backward reads it."""

    def __init__(self, teacher_head, where="block"):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh())
        self.teacher_head = [teacher_head]  # not a submodule: another engine's
        self.where = where

    def forward(self, x):
        w = self.teacher_head[0].weight
        with strata.zero.GatheredParameters([w], enabled=self.where == "block"):
            out = _ProjectWithSaved.apply(self.body(x), w, self.where == "function")
        return (out ** 2).mean()


def saved_foreign_parameter_against_torch(where, teacher_gathered_in_backward, device="cpu"):
    """The student's gradients when a Function in its forward saves a frozen teacher's weight
    (another stage-3 engine's) inside or after its gather, against the same on whole tensors."""
    torch.manual_seed(0)
    teacher_head = torch.nn.Linear(8, 5)
    student = _Distilled(teacher_head, where)
    torch_head = torch.nn.Linear(8, 5)
    torch_head.load_state_dict(teacher_head.state_dict())
    torch_student = _Distilled(torch_head, where)
    torch_student.load_state_dict(student.state_dict())
    torch_head.to(device)
    torch_student.to(device)
    x = torch.randn(4, 6).to(device)
    torch_student(x).backward()

    teacher = torch.nn.Sequential(teacher_head).requires_grad_(False).to(device)
    cfg = ds_config(3)
    del cfg["optimizer"]  # frozen: no optimizer
    teacher_engine, optimizer, _, _ = strata.initialize(model=teacher, config=cfg)
    assert optimizer is None and teacher_head.weight.numel() == 0
    engine, _, _, _ = strata.initialize(model=student.to(device), config=ds_config(3, lr=LR,
                                                                                    wd=WD))
    assert engine.device.type == teacher_engine.device.type == device
    loss = engine(x)
    assert teacher_head.weight.numel() == 0  # released after the forward's product
    with strata.zero.GatheredParameters([teacher_head.weight],
                                        enabled=teacher_gathered_in_backward):
        engine.backward(loss)
    assert teacher_head.weight.numel() == 0
    torch.testing.assert_close(loss, torch_student(x))
    for n, p in student.named_parameters():
        torch.testing.assert_close(strata.utils.safe_get_full_grad(p),
                                   dict(torch_student.named_parameters())[n].grad.cpu(), msg=n)
    engine.step()
    engine.close()
    teacher_engine.close()


@pytest.mark.parametrize("where", ["block", "function"])
@pytest.mark.parametrize("teacher_gathered_in_backward", [False, True])
def test_a_saved_parameter_of_another_engine_is_given_back_gathered(
        where, teacher_gathered_in_backward):
    """A stage-3 parameter of another engine (a frozen teacher's) saved by a custom autograd
    Function in the student's forward, inside its gather (a view of the teacher's memory) or
    after it (the Parameter itself, empty then): backward unpacks its values, gathered for the
    purpose (a copy) or a view while gathered anyway, and the student's gradients are torch's
    (the Function without strata, on whole tensors)."""
    saved_foreign_parameter_against_torch(where, teacher_gathered_in_backward)
