"""The config's "torch_autocast" section (strata/autocast.py): the engine's forward runs under
torch.autocast as DeepSpeed's does, fp32 parameters and master weights, against torch with the
same autocast around the same model; an autocast opened outside the engine without the section
is switched off inside (DeepSpeed's rule); bad sections are refused naming the key."""
import warnings

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402
from strata.config import ConfigError  # noqa: E402

from models import batch, ds_config, make_model  # noqa: E402
from test_adapter import run_steps  # noqa: E402

STEPS, LR, WD = 4, 1e-2, 0.01
AUTOCAST = {"enabled": True, "dtype": "bfloat16"}


def torch_autocast_reference(kind):
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WD)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(*batch(kind, step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("stage,offload", [(0, "none"), (3, "cpu")])
def test_forward_under_the_configs_autocast_trains_as_torch(stage, offload):
    ref_losses, ref = torch_autocast_reference("gpt")
    cfg = dict(ds_config(stage, offload, lr=LR, wd=WD), torch_autocast=AUTOCAST)
    engine = strata.initialize(model=make_model("gpt"), config=cfg)[0]
    assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16
    losses = run_steps(engine, "gpt", STEPS)
    # The same autocast ops on the same fp32 weights: step 0 to the bit, then Adam's rounding.
    assert losses[0] == ref_losses[0]
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    master = engine.read_master()
    assert all(v.dtype == torch.float32 for v in master.values())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), atol=1e-4, rtol=1e-3, msg=n)
    # Without the section the same run is fp32 and differs.
    plain = strata.initialize(model=make_model("gpt"),
                              config=ds_config(stage, offload, lr=LR, wd=WD))[0]
    assert not plain.torch_autocast_enabled()
    assert plain(*batch("gpt", 0)).item() != losses[0]
    engine.close()
    plain.close()


def test_an_outer_autocast_is_switched_off_inside_without_the_section():
    engine = strata.initialize(model=make_model("mlp"), config=ds_config(1))[0]
    x = batch("mlp", 0)
    with torch.no_grad():
        fp32 = engine(*x)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                inside = engine(*x)
                outside = engine.module(*x)  # the module itself, outside the engine
    assert torch.equal(inside, fp32) and inside.dtype == torch.float32
    assert not torch.equal(outside, fp32)
    assert any("disabled inside, as DeepSpeed does" in str(w.message) for w in seen)
    engine.close()


@pytest.mark.parametrize("section,error,match", [
    ({"enabled": True, "dtype": "int3"}, ConfigError, r"torch_autocast\.dtype.*int3"),
    ({"enabled": True, "dtype": "float16"}, NotImplementedError, "GradScaler"),
    ({"enabled": "yes"}, ConfigError, r"torch_autocast\.enabled"),
    ({"enabled": True, "lower_precision_safe_modules": ["torch.nn.Lineaar"]}, ConfigError,
     "failed to import lower precision safe module torch.nn.Lineaar"),
    ({"enabled": True, "lower_precision_safe_modules": "torch.nn.Linear"}, ConfigError,
     "Expected list of strings"),
])
def test_bad_sections_are_refused_naming_the_key(section, error, match):
    with pytest.raises(error, match=match):
        strata.initialize(model=make_model("mlp"),
                          config=dict(ds_config(1), torch_autocast=section))


def test_section_off_and_module_names_kept():
    names = ["torch.nn.Linear", "torch.nn.Conv1d"]
    engine = strata.initialize(model=make_model("mlp"), config=dict(
        ds_config(1), torch_autocast={"enabled": False, "lower_precision_safe_modules": names}))[0]
    assert not engine.torch_autocast_enabled() and engine.torch_autocast_dtype() is None
    assert engine.torch_autocast_lower_precision_safe_modules() == names
    engine.close()


class _BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.bn(self.lin(x))).float().square().mean()


def test_data_types_buffer_dtype_casts_the_buffers_as_deepspeed():
    """bf16 casts the parameters, not the buffers (DeepSpeed >= 0.19.2): BatchNorm's fp32
    running statistics beside bf16 weights fail in F.batch_norm, as under DeepSpeed.
    data_types.buffer_dtype "bf16" casts them, as DeepSpeed's engine does, and the model
    trains; the checker refuses a param_dtype other than the enabled precision."""
    cfg = ds_config(3, dtype="bf16")
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).bfloat16()
    torch.manual_seed(0)
    plain, _, _, _ = strata.initialize(model=_BatchNormNet(), config=cfg)
    assert plain.module.bn.running_mean.dtype == torch.float32
    with pytest.raises(RuntimeError, match="expected scalar type|same dtype|BFloat16"):
        plain(x)
    plain.close()
    cfg["data_types"] = {"buffer_dtype": "torch.bfloat16"}  # a DeepSpeed spelling
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=_BatchNormNet(), config=cfg)
    assert engine.module.bn.running_mean.dtype == torch.bfloat16
    losses = []
    for _ in range(3):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert engine.module.bn.num_batches_tracked.dtype == torch.int64  # integers stay
    engine.close()
    cfg["data_types"] = {"param_dtype": "fp16"}
    with pytest.raises(ConfigError, match="data_types.param_dtype.*conflicts"):
        strata.initialize(model=_BatchNormNet(), config=cfg)
