"""An engine's end as scripts reach it: close() with tensors that still alias its memory (a graph
autograd saved, a state_dict taken before), calls on a closed engine, a stage-3 model closed and
passed to initialize again, and an initialize that fails on its arguments."""
import copy

import pytest

torch = pytest.importorskip("torch")
import strata  # noqa: E402

from models import MLP, ds_config  # noqa: E402


def _churn():
    """Allocations that reuse freed memory, so a read of it shows."""
    return [torch.full((512, 512), 7.0) for _ in range(16)]


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_backward_through_a_graph_made_before_close_reads_the_weights_it_used(stage):
    """Stages 0-2: F.linear saved views of the engine's parameters in the graph; close() leaves
    them valid (their memory is freed with the last of them), so the backward after it gives
    torch's gradients, not a read of freed memory."""
    torch.manual_seed(0)
    model = MLP(64, 256, 8)
    ref = copy.deepcopy(model)
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage))
    x, y = _data()
    loss = engine(x, y)
    engine.close()
    junk = _churn()
    loss.backward()
    ref(x, y).backward()
    del junk
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_state_dict_taken_before_close_keeps_its_values():
    torch.manual_seed(0)
    model = MLP(64, 256, 8)
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(2))
    x, y = _data()
    engine.backward(engine(x, y))
    engine.step()
    state = model.state_dict()
    want = {n: t.clone() for n, t in state.items()}
    engine.close()
    junk = _churn()
    for n, t in state.items():
        assert torch.equal(t, want[n]), n
    del junk


@pytest.mark.parametrize("call", ["save", "load", "offload_states"])
def test_a_call_on_a_closed_engine_raises_and_leaves_the_model_whole(tmp_path, call):
    torch.manual_seed(0)
    model = MLP(64, 256, 8)
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(2, "cpu"))
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = {"save": lambda: engine.save_checkpoint(tmp_path / "ckpt"),
           "load": lambda: engine.load_checkpoint(tmp_path / "ckpt"),
           "offload_states": engine.offload_states}[call]
    with pytest.raises(strata.StrataError, match="the engine was closed"):
        run()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), want[n]), n


def test_a_stage3_model_closed_and_passed_to_initialize_again_names_close_keeping_weights():
    torch.manual_seed(0)
    model = MLP(64, 256, 8)
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(3))
    engine.close()
    with pytest.raises(ValueError, match=r"6 parameter\(s\) of the model are empty.*"
                                         r"close_keeping_weights"):
        strata.initialize(model=model, config=ds_config(3))


def test_initialize_with_data_that_is_not_a_dataset_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = MLP(64, 256, 8)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="Training data must be a torch Dataset"):
        strata.initialize(model=model, config=ds_config(3), training_data=42)
    assert not strata.engine.open_engines_of(model)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), want[n]), n


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_closed_model_pickles_and_an_open_one_says_how_to_save(stage):
    """torch.save(model) of a model the engine trains failed on the engine's C++ object ("cannot
    pickle 'Engine'"), and still did after close(), the parameters naming the engine: now an open
    engine's refusal says what to save instead, and the closed model (close() at stages 0-2,
    close_keeping_weights() at stage 3) pickles, reloads equal and starts a new engine."""
    import io
    torch.manual_seed(0)
    model = MLP()
    engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage))
    engine.backward(engine(torch.randn(4, 16), torch.randn(4, 8)))
    engine.step()
    if stage < 3:
        with pytest.raises(TypeError, match="cannot be pickled or deep-copied: save "
                                            r"engine.module.state_dict\(\)"):
            torch.save(model, io.BytesIO())
    (engine.close_keeping_weights if stage == 3 else engine.close)()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    for (n, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q) and p.numel() > 0, n
    engine, _, _, _ = strata.initialize(model=again, config=ds_config(stage))
    engine.close()
