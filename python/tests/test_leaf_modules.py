"""ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules and zero_optimization.leaf_module):
a leaf's subtree is one group, gathered by the leaf's hooks alone; DeepSpeed 0.19's default makes
the transformers MoE blocks leaves. The bits do not depend on it."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strata  # noqa: E402
from strata.utils import (get_z3_leaf_modules, set_z3_leaf_modules,  # noqa: E402
                          set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                          unset_z3_leaf_modules, z3_leaf_module)


def qwen2_moe():
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32))


def run(model, stage=3, leaf=None, steps=3):
    z = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if leaf is not None:
        z["leaf_module"] = leaf
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": z}
    engine, *_ = strata.initialize(model=model, config=cfg, device="cpu")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    names = [g.name for g in engine._groups]
    master = engine.read_master()
    hooked = {n for n, m in model.named_modules() if m._forward_pre_hooks}
    engine.destroy()
    return losses, master, names, hooked


def test_moe_blocks_are_leaves_by_default_and_train_bit_for_bit_as_without():
    model = qwen2_moe()
    losses, master, names, hooked = run(model)
    block = model.model.layers[0].mlp
    assert z3_leaf_module(block) and get_z3_leaf_modules(model) == [
        model.model.layers[0].mlp, model.model.layers[1].mlp]
    # One group per block, its gate, experts and shared expert inside; only the block hooked.
    assert "model.layers.0.mlp" in names
    assert not any(n.startswith("model.layers.0.mlp.") for n in names), names
    assert "model.layers.0.mlp" in hooked
    assert not any(n.startswith("model.layers.0.mlp.") for n in hooked), hooked

    plain = qwen2_moe()
    plain_losses, plain_master, plain_names, _ = run(plain, leaf={"classes": []})
    assert not get_z3_leaf_modules(plain)
    assert "model.layers.0.mlp.experts" in plain_names
    assert losses == plain_losses
    assert master.keys() == plain_master.keys()
    assert all(torch.equal(master[k], plain_master[k]) for k in master)


def test_the_config_names_and_suffixes_and_stage_2():
    model = qwen2_moe()
    _, _, names, _ = run(model, leaf={"classes": [], "names": ["model.layers.1.self_attn"],
                                      "name_suffixes": ["0.mlp.shared_expert"]}, steps=1)
    assert "model.layers.1.self_attn" in names and "model.layers.1.self_attn.q_proj" not in names
    assert "model.layers.0.mlp.shared_expert" in names
    assert "model.layers.0.mlp.experts" in names  # classes: [] keeps the blocks' insides
    _, _, names, hooked = run(qwen2_moe(), stage=2, steps=1)  # leaves are a stage-3 notion
    assert "model.layers.0.mlp.experts" in names and not hooked


def test_set_z3_leaf_modules_as_deepspeeds():
    model = qwen2_moe()
    attn = type(model.model.layers[0].self_attn)
    found = set_z3_leaf_modules(model, [attn])
    assert found == [layer.self_attn for layer in model.model.layers]
    assert all(z3_leaf_module(m) for m in found)
    assert unset_z3_leaf_modules(model, [attn.__name__]) == found
    assert not any(z3_leaf_module(m) for m in found)
    qualified = f"{attn.__module__}.{attn.__qualname__}"
    assert set_z3_leaf_modules(model, [qualified]) == found
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(model, ["NoSuchBlock"])
    assert set_z3_leaf_modules(model, ["NoSuchBlock"], raise_if_not_found=False) == []
    with pytest.raises(TypeError):
        set_z3_leaf_modules(model, [3])
    mods, missing = set_z3_leaf_modules_by_name(model, ["model.norm", "model.nope"],
                                                raise_if_not_found=False)
    assert mods == [model.model.norm] and missing == ["model.nope"]
    with pytest.raises(ValueError, match="No modules named"):
        set_z3_leaf_modules_by_name(model, ["model.nope"])
    mods, missing = set_z3_leaf_modules_by_suffix(model, ["mlp.gate"])
    assert mods == [layer.mlp.gate for layer in model.model.layers] and not missing
    # Set before initialize (DeepSpeed-SuperOffload's --leaf_module): the engine follows it.
    model = qwen2_moe()
    set_z3_leaf_modules(model, [attn])
    _, _, names, _ = run(model, leaf={"classes": []}, steps=1)
    assert "model.layers.0.self_attn" in names and "model.layers.0.self_attn.q_proj" not in names
