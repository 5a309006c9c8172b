"""DeepSpeed's stage-3 parameter attributes (ds_id, ds_status, ZeroParamStatus) and the script code
that reads them: DeepSpeed-Chat's save_zero_three_model (dschat/utils/utils.py, copied into many
training repositories), with its imports changed, saves a transformers Llama trained at stage 3
whole, as save_16bit_model does. Without ds_id it saved the empty placeholders."""
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strata as deepspeed  # noqa: E402  (as a script written for DeepSpeed imports it)
from strata.zero import ZeroParamStatus  # noqa: E402  (deepspeed.runtime.zero.partition_parameters)


# --- DeepSpeed-Chat, dschat/utils/utils.py (imports changed, code as written there) ---------------
def _z3_params_to_fetch(param_list):
    return [
        p for p in param_list
        if hasattr(p, 'ds_id') and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
    ]


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = (zero_stage == 3)
    os.makedirs(save_dir, exist_ok=True)
    WEIGHTS_NAME = "pytorch_model.bin"
    output_model_file = os.path.join(save_dir, WEIGHTS_NAME)

    model_to_save = model_ema.module if hasattr(model_ema,
                                                'module') else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():

            if hasattr(v, 'ds_id'):
                with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v
                                                                            ]),
                                                       enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict
# ----------------------------------------------------------------------------------------------------


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def ds_config(stage):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def trained(stage, model=None):
    model = model if model is not None else llama()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage),
                                      model_parameters=model.parameters(), device="cpu")
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
    return engine


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_chats_save_writes_the_whole_trained_weights(tmp_path, stage):
    engine = trained(stage)
    try:
        save_zero_three_model(engine, engine.global_rank, str(tmp_path / "chat"), zero_stage=stage)
        engine.save_16bit_model(str(tmp_path / "ref"))
        saved = torch.load(tmp_path / "chat" / "pytorch_model.bin", weights_only=True)
        ref = torch.load(tmp_path / "ref" / "pytorch_model.bin", weights_only=True)
        names = [n for n, _ in engine.module.named_parameters()]
        assert names and all(n in saved for n in names)
        for n in names:
            assert saved[n].shape == ref[n].shape and saved[n].numel() > 0, n
            assert torch.equal(saved[n], ref[n]), n
        assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"],
                               llama().state_dict()["model.layers.0.mlp.up_proj.weight"])
    finally:
        engine.destroy()


def test_ds_status_follows_the_gathers_and_ds_id_is_unique():
    engine = trained(3)
    try:
        params = list(engine.module.parameters())
        ids = [p.ds_id for p in params]
        assert len(set(ids)) == len(ids)
        assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0
                   for p in params)
        head = engine.module.lm_head.weight
        with deepspeed.zero.GatheredParameters([head]):
            assert head.ds_status == ZeroParamStatus.AVAILABLE and head.numel() == head.ds_numel
            assert _z3_params_to_fetch([head]) == []  # already whole: nothing to gather
        assert head.ds_status == ZeroParamStatus.NOT_AVAILABLE
        # Inside a module's forward its own parameters are whole, the others not.
        seen = {}

        def look(module, args):
            seen["own"] = module.weight.ds_status
            seen["other"] = head.ds_status

        hook = engine.module.model.layers[0].mlp.up_proj.register_forward_pre_hook(look)
        try:
            engine.eval()
            with torch.no_grad():
                engine(input_ids=torch.zeros(1, 4, dtype=torch.long))
        finally:
            hook.remove()
        assert seen == {"own": ZeroParamStatus.AVAILABLE, "other": ZeroParamStatus.NOT_AVAILABLE}
    finally:
        engine.destroy()


def test_ds_tensor_counts_parameters_as_deepspeed_chats_throughput_does():
    """DeepSpeed-Chat (dschat/utils/perf.py) counts a stage-3 model's parameters as
    `p.ds_numel if hasattr(p, "ds_tensor") else p.numel()`: without ds_tensor it counted the empty
    placeholders, 0. ds_tensor is a meta tensor of this rank's part (here all of it), whose values
    cannot be read."""
    total = sum(p.numel() for p in llama().parameters())
    engine = trained(3)
    try:
        params = list(engine.module.parameters())
        assert sum(p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in params) == total
        assert all(p.ds_tensor.is_meta and p.ds_tensor.numel() == p.ds_numel for p in params)
        with pytest.raises((NotImplementedError, RuntimeError)):
            params[0].ds_tensor.tolist()
    finally:
        engine.destroy()
    # Two ranks: each parameter's parts (the ranges of its group that each rank owns) add up.
    from strata.zero import _owned_parts
    numels = [37, 1000, 3, 515]
    for world in (2, 4):
        parts = [_owned_parts(numels, world, r) for r in range(world)]
        for i, n in enumerate(numels):
            assert sum(e - b for b, e in (p[i] for p in parts)) == n
            assert all(0 <= b <= e <= n for b, e in (p[i] for p in parts))


def test_stages_0_to_2_have_no_ds_id_and_zero_init_keeps_its_ids():
    engine = trained(2)
    try:
        assert not any(hasattr(p, "ds_id") or hasattr(p, "ds_tensor")
                       for p in engine.module.parameters())
    finally:
        engine.destroy()
    with deepspeed.zero.Init(config_dict_or_path=ds_config(3)):
        model = llama()
    before = {n: p.ds_id for n, p in model.named_parameters()}
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    engine = trained(3, model)
    try:
        assert {n: p.ds_id for n, p in model.named_parameters()} == before
    finally:
        engine.destroy()


def test_nested_zero_init_blocks_partition_once_until_the_outermost_ends():
    """As DeepSpeed's: an inner block (transformers opens one inside strata's from_pretrained,
    or the same object entered twice) partitions nothing of its own and undoes nothing; a
    module built after the inner block ends, still inside the outer one, is partitioned, and
    one built after the outer block ends is whole."""
    outer = deepspeed.zero.Init(config_dict_or_path=ds_config(3))
    with outer:
        with deepspeed.zero.Init(config_dict_or_path=ds_config(3)):
            a = torch.nn.Linear(4, 4)
        with outer:  # the same object again
            b = torch.nn.Linear(4, 4)
        c = torch.nn.Linear(4, 4)
    d = torch.nn.Linear(4, 4)
    for m in (a, b, c):
        assert m.weight.numel() == 0 and m.weight._strata_part.shard.numel() == 16
    assert d.weight.numel() == 16 and not hasattr(d.weight, "_strata_part")


@pytest.mark.parametrize("after_step", [False, True])
def test_an_inner_gathered_block_that_writes_leaves_the_outer_blocks_parameters_whole(after_step):
    """GatheredParameters(modifier_rank=0) nested in another block over other parameters: its
    write releases and re-gathers every group, and the outer block's stay whole until the outer
    block ends (they were emptied: a state_dict() or clone() there read empty tensors); the
    written value stands, and the outer block's end releases its groups."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    if after_step:
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
    with deepspeed.zero.GatheredParameters(list(model[1].parameters())):
        outer = model[1].weight.detach().clone()
        with deepspeed.zero.GatheredParameters(model[0].weight, modifier_rank=0):
            with torch.no_grad():
                model[0].weight.fill_(0.5)
        assert model[1].weight.shape == (8, 8)
        assert torch.equal(model[1].weight.detach(), outer)
        assert model[0].weight.numel() == 0
    assert model[1].weight.numel() == 0
    with deepspeed.zero.GatheredParameters(model[0].weight):
        assert bool((model[0].weight == 0.5).all())
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_bf16_gathered_write_leaves_the_untouched_parameters_masters_unrounded(stage):
    """GatheredParameters(weight, modifier_rank=0) before the first step, bf16: the weight's
    master takes the written (bf16) values; the bias, in the same group but not written, keeps
    its fp32 master as initialize took it, where it was rounded to bf16."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    with deepspeed.zero.GatheredParameters([model.weight], modifier_rank=0):
        with torch.no_grad():
            model.weight.mul_(0.5)
    master = engine.read_master()
    assert torch.equal(master["bias"], b0)
    assert torch.equal(master["weight"], (w0.bfloat16() * 0.5).float())
    engine.close()


def test_a_write_inside_gathered_parameters_without_modifier_rank_is_warned():
    """DeepSpeed discards it (its sanity checks raise "Use modifier_rank"); strata's may stand
    in the working copy until the next step or go with the gathered copy, depending on ranks and
    offload: warned, naming the parameter. A read-only block and one with modifier_rank are not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            model[0].weight.sum().item()  # a read
        with deepspeed.zero.GatheredParameters(model[1].weight, modifier_rank=0):
            with torch.no_grad():
                model[1].weight.mul_(2)
    with pytest.warns(UserWarning, match=r"parameter 1\.bias was written inside "
                                         "GatheredParameters without modifier_rank"):
        with deepspeed.zero.GatheredParameters(list(model[1].parameters())):
            with torch.no_grad():
                model[1].bias.zero_()
    engine.close()
