"""strata.checkpointing (deepspeed.checkpointing): a model written as DeepSpeed's examples write
activation checkpointing (each block through `deepspeed.checkpointing.checkpoint`, dropout
inside) gives the gradients of the plain forward bit for bit, with every option the config can
set, and trains under strata (stage 0, and stage 3 whose recompute gathers again) as torch does
without checkpointing; keyword tensors take part in autograd; the reentrant limit and
non_reentrant_checkpoint; the config section read as DeepSpeed reads it and bad input named."""
import logging

import pytest

torch = pytest.importorskip("torch")
import strata as deepspeed  # noqa: E402  (as a script written for DeepSpeed imports it)
import strata.checkpointing as ck  # noqa: E402

from models import ds_config  # noqa: E402

STEPS, LR, WD = 3, 1e-2, 0.01


@pytest.fixture(autouse=True)
def unconfigured(monkeypatch):
    """Each test starts unconfigured, as a new process would."""
    monkeypatch.setattr(ck, "_options", dict(ck._DEFAULTS))
    monkeypatch.setattr(ck, "_configured", False)


class Block(torch.nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, h, scale=None):
        out = self.down(self.drop(torch.nn.functional.gelu(self.up(h))))
        return h + (out if scale is None else out * scale)


class Net(torch.nn.Module):
    def __init__(self, checkpointed, blocks=3, form="checkpoint"):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(32, 1)
        self.checkpointed = checkpointed
        self.form = form

    def forward(self, x, y):
        h = self.embed(x)
        run = getattr(deepspeed.checkpointing, self.form)
        for block in self.blocks:
            h = run(block, h) if self.checkpointed else block(h)
        return ((self.head(h) - y) ** 2).mean()


class KeptOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu, counting the tensors it keeps: on the host stand-in they are
    already in host memory, so the count is what shows that cpu_checkpointing routed them."""
    kept = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pack = self.pack_hook

        def counted(t):
            KeptOnCpu.kept.append(tuple(t.shape))
            return pack(t)
        self.pack_hook = counted


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)


def grads(model, step=0):
    model.zero_grad()
    torch.manual_seed(7)  # the dropout masks
    model(*data(step)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


SECTIONS = [{}, {"cpu_checkpointing": True}, {"partition_activations": True,
                                              "synchronize_checkpoint_boundary": True,
                                              "profile": True}]


@pytest.mark.parametrize("form", ["checkpoint", "non_reentrant_checkpoint"])
@pytest.mark.parametrize("section", SECTIONS, ids=["defaults", "cpu", "partition-sync-profile"])
def test_gradients_equal_the_plain_forwards(section, form, caplog, monkeypatch):
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", KeptOnCpu)
    KeptOnCpu.kept = []
    deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": section})
    assert deepspeed.checkpointing.is_configured()
    with caplog.at_level(logging.INFO, logger="strata.checkpointing"):
        got = grads(Net(checkpointed=True, form=form))
    # cpu_checkpointing: each block's input, and only that, kept through save_on_cpu
    assert KeptOnCpu.kept == ([(8, 32)] * 3 if section.get("cpu_checkpointing") else [])
    want = grads(Net(checkpointed=False))
    for n, g in want.items():
        assert torch.equal(got[n], g), n  # the recompute draws the same dropout masks
    timed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint ")]
    if section.get("profile"):  # three blocks: a forward and a recompute each
        assert sum(m.startswith("checkpoint forward") for m in timed) == 3
        assert sum(m.startswith("checkpoint recompute") for m in timed) == 3
    else:
        assert not timed


@pytest.mark.parametrize("stage,offload", [(0, "none"), (3, "cpu")])
def test_trains_under_strata_as_torch_without_checkpointing(stage, offload):
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    ref = Net(checkpointed=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WD)
    ref_losses = []
    for step in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(step)
        loss = ref(*data(step))
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    engine = deepspeed.initialize(model=Net(checkpointed=True),
                                  config=ds_config(stage, offload, lr=LR, wd=WD))[0]
    losses = []
    for step in range(STEPS):
        torch.manual_seed(step)
        loss = engine(*data(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    master = engine.read_master()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), atol=1e-5, rtol=1e-4, msg=n)
    engine.close()


def test_keyword_tensors_take_part_in_autograd():
    block, x = Block(), torch.randn(4, 32, requires_grad=True)
    scale = torch.tensor(0.5, requires_grad=True)
    torch.manual_seed(1)
    deepspeed.checkpointing.checkpoint(block, x, scale=scale).sum().backward()
    got = scale.grad.clone(), x.grad.clone()
    scale.grad = x.grad = None
    torch.manual_seed(1)
    block(x, scale=scale).sum().backward()
    assert torch.equal(got[0], scale.grad) and torch.equal(got[1], x.grad)


def test_inputs_without_grad_leave_parameters_without_unless_non_reentrant():
    """DeepSpeed's checkpoint is reentrant: a block none of whose inputs requires a gradient
    gives its parameters none (torch warns); non_reentrant_checkpoint is DeepSpeed's answer."""
    block, x = Block().eval(), torch.randn(4, 32)
    with pytest.warns(UserWarning, match="requires_grad"):
        out = deepspeed.checkpointing.checkpoint(block, x)
    assert not out.requires_grad and block.up.weight.grad is None
    deepspeed.checkpointing.non_reentrant_checkpoint(block, x).sum().backward()
    got = block.up.weight.grad.clone()
    block.zero_grad()
    block(x).sum().backward()
    assert torch.equal(got, block.up.weight.grad)


def test_configure_reads_the_section_as_deepspeed_and_names_bad_input(tmp_path):
    assert not deepspeed.checkpointing.is_configured()
    path = tmp_path / "ds.json"
    path.write_text('{"activation_checkpointing": {"cpu_checkpointing": true, '
                    '"number_checkpoints": 4}}')
    deepspeed.checkpointing.configure(None, deepspeed_config=str(path), synchronize=True)
    opts = ck.options()
    assert opts["cpu_checkpointing"] and opts["number_checkpoints"] == 4
    assert opts["synchronize_checkpoint_boundary"]  # the argument over the file
    deepspeed.checkpointing.configure(None, deepspeed_config=str(path), checkpoint_in_cpu=False)
    assert not ck.options()["cpu_checkpointing"]
    with pytest.raises(ValueError, match=r"activation_checkpointing\.cpu_checkpoint: unknown key"):
        ck.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})
    with pytest.raises(ValueError, match=r"activation_checkpointing\.profile: expected true or "):
        ck.configure(None, deepspeed_config={"activation_checkpointing": {"profile": "yes"}})
    with pytest.raises(ValueError, match=r"configure\(checkpoint_in_cpu=\.\.\.\): expected true"):
        ck.configure(None, checkpoint_in_cpu="maybe")
    ck.configure(None, deepspeed_config={"activation_checkpointing": {"profile": 1}},
                 checkpoint_in_cpu="false")  # as DeepSpeed's config takes them
    assert ck.options()["profile"] is True and ck.options()["cpu_checkpointing"] is False
    with pytest.raises(ValueError, match=r"number_checkpoints: expected a positive integer"):
        ck.configure(None, deepspeed_config={"activation_checkpointing": {"number_checkpoints": 0}})
    with pytest.raises(AssertionError, match="only available with partitioned activations"):
        ck.configure(None, contiguous_checkpointing=True)
    with pytest.raises(AssertionError, match="Must specify the number of layers"):
        ck.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(NotImplementedError, match="model parallelism"):
        ck.configure(object())


def test_deepspeeds_module_paths():
    from strata.runtime.activation_checkpointing import checkpointing as ds_path
    assert deepspeed.checkpointing is ck
    assert ds_path.checkpoint is ck.checkpoint and ds_path.configure is ck.configure
