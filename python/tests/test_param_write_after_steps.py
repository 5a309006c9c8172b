"""GatheredParameters(modifier_rank=...) after the engine's first step writes the working
parameters only, as DeepSpeed does once its optimizer exists (Engine::WriteParams): DeepSpeed-Chat
fuses its LoRA adapters into the frozen base weights this way before saving a stage-3 model.
The LoRA layer and the conversion below are DeepSpeed-Chat's (dschat/utils/module/lora.py, Apache
2.0), trimmed, with `deepspeed` changed to `strata`."""
import math
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import strata as deepspeed  # noqa: E402
from strata.zero import ZeroParamStatus  # noqa: E402

nn, F = torch.nn, torch.nn.functional


# --- DeepSpeed-Chat, dschat/utils/module/lora.py ---------------------------------------------------
class LinearLayer_LoRA(nn.Module):
    def __init__(self, weight, lora_dim=0, lora_scaling=1, lora_droppout=0, bias=None):
        super(LinearLayer_LoRA, self).__init__()
        self.weight = weight
        self.bias = bias
        try:
            # for zero stage 3
            rows, columns = weight.ds_shape
        except:  # noqa: E722
            rows, columns = weight.shape
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, lora_dim))
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, rows))
        self.lora_scaling = lora_scaling / lora_dim
        self.lora_dropout = nn.Identity()
        self.reset_parameters()
        self.weight.requires_grad = False
        self.fuse_lora = False

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_left_weight)

    def fuse_lora_weight(self):
        if not self.fuse_lora:
            self.weight.data += self.lora_scaling * torch.matmul(
                self.lora_left_weight.t(), self.lora_right_weight.t())
        self.fuse_lora = True

    def forward(self, input):
        if self.fuse_lora:
            return F.linear(input, self.weight, self.bias)
        else:
            return F.linear(
                input, self.weight,
                self.bias) + (self.lora_dropout(input) @ self.lora_right_weight
                              @ self.lora_left_weight) * self.lora_scaling


def convert_linear_layer_to_lora(model, part_module_name, lora_dim=0, lora_scaling=1):
    replace_name = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and part_module_name in name:
            replace_name.append(name)
    for name in replace_name:
        module = model.get_submodule(name)
        tmp = LinearLayer_LoRA(module.weight, lora_dim, lora_scaling, 0,
                               module.bias).to(module.weight.device).to(module.weight.dtype)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, tmp)
    return model


def _z3_params_to_fetch(param_list):
    return [
        p for p in param_list
        if hasattr(p, 'ds_id') and p.ds_status == deepspeed.runtime.zero.
        partition_parameters.ZeroParamStatus.NOT_AVAILABLE
    ]


def convert_lora_to_linear_layer(model):
    replace_name = []
    for name, module in model.named_modules():
        if isinstance(module, LinearLayer_LoRA):
            replace_name.append(name)
    for name in replace_name:
        module = model.get_submodule(name)
        zero_stage_3 = hasattr(module.weight, 'ds_id')
        with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([
                module.weight, module.bias, module.lora_left_weight,
                module.lora_right_weight
        ]), modifier_rank=0, enabled=zero_stage_3):
            module.fuse_lora_weight()
    return model


def only_optimize_lora_parameters(model):
    for name, param in model.named_parameters():
        param.requires_grad = "lora_right_weight" in name or "lora_left_weight" in name
    return model
# ----------------------------------------------------------------------------------------------------


def opt_model():
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                 num_attention_heads=2, max_position_embeddings=32,
                                 word_embed_proj_dim=32)
    model = transformers.OPTForCausalLM(cfg)
    convert_linear_layer_to_lora(model, "decoder.layers.", lora_dim=4)
    return only_optimize_lora_parameters(model)


def ds_config():
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "stage3_param_persistence_threshold": 0}}


def start():
    """DeepSpeed-Chat's LoRA OPT and a stage-3 engine over its trainable parameters."""
    model = opt_model()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(), device="cpu",
                                      model_parameters=[p for p in model.parameters()
                                                        if p.requires_grad])
    return model, engine


def train(engine, steps):
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()


def test_deepspeed_chats_lora_fuse_after_training_writes_the_fused_weights(tmp_path):
    model, engine = start()
    try:
        train(engine, 3)
        lora = {n: m for n, m in model.named_modules() if isinstance(m, LinearLayer_LoRA)}
        expected = {}
        for n, m in lora.items():  # the fused weight, computed as fuse_lora_weight does
            with deepspeed.zero.GatheredParameters([m.weight, m.lora_left_weight,
                                                    m.lora_right_weight]):
                assert m.lora_left_weight.abs().sum() > 0  # trained away from its zeros
                expected[n] = m.weight.data + m.lora_scaling * torch.matmul(
                    m.lora_left_weight.t(), m.lora_right_weight.t())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            convert_lora_to_linear_layer(model)
        notes = [w for w in seen if "writes the working parameters only" in str(w.message)]
        assert len(notes) == 1, [str(w.message) for w in seen]
        for n, m in lora.items():
            assert m.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
            with deepspeed.zero.GatheredParameters([m.weight]):
                assert torch.equal(m.weight.data, expected[n]), n
        engine.save_16bit_model(str(tmp_path))
        saved = torch.load(os.path.join(tmp_path, "pytorch_model.bin"), weights_only=True)
        for n in lora:
            assert torch.equal(saved[n + ".weight"], expected[n]), n
    finally:
        engine.destroy()


def test_a_trainable_parameter_written_after_a_step_is_recomputed_from_its_master():
    model, engine = start()
    try:
        train(engine, 2)
        right = model.model.decoder.layers[0].self_attn.q_proj.lora_right_weight
        name = "model.decoder.layers.0.self_attn.q_proj.lora_right_weight"
        master = engine.read_master()[name]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with deepspeed.zero.GatheredParameters([right], modifier_rank=0):
                right.data.fill_(0.5)
        with deepspeed.zero.GatheredParameters([right]):
            assert torch.all(right.data == 0.5)
        assert torch.equal(engine.read_master()[name], master)  # the master is kept
        train(engine, 1)
        with deepspeed.zero.GatheredParameters([right]):
            now = right.data.clone()
        assert torch.equal(now, engine.read_master()[name].to(torch.bfloat16))
        assert not torch.all(now == 0.5)
    finally:
        engine.destroy()


def test_a_fill_that_raises_writes_nothing():
    """Engine.write_params asks for every value before it writes: a fill that raises (here on the
    group's second parameter) leaves the parameters as they were, and training goes on."""
    model, engine = start()
    try:
        train(engine, 1)
        proj = model.model.decoder.layers[0].fc1
        gi = engine._group_of[id(proj.weight)]
        with deepspeed.zero.GatheredParameters([proj.weight, proj.bias]):
            before = [proj.weight.data.clone(), proj.bias.data.clone()]

        def fill(g, p, begin, end):
            if p == 1:
                raise ValueError("no values for the bias")
            return torch.full((end - begin,), 9.0).numpy()

        engine._release_all()
        with pytest.raises(ValueError, match="no values for the bias"):
            engine._engine.write_params([gi], fill)
        with deepspeed.zero.GatheredParameters([proj.weight, proj.bias]):
            assert torch.equal(proj.weight.data, before[0])
            assert torch.equal(proj.bias.data, before[1])
        train(engine, 1)
    finally:
        engine.destroy()


def test_a_persistent_parameter_edited_in_place_keeps_its_value_across_a_later_write(tmp_path):
    """Two ranks, stage 3 (gathers are copies there): a persistent parameter's in-place write
    stands after a GatheredParameters(modifier_rank=0) block on another group, as in DeepSpeed,
    where a persistent parameter is whole and nothing fetches it again before the next step.
    Before, that block re-gathered every group and dropped the write (DeepSpeed-Chat saved its
    small layers unfused)."""
    from launch import launch
    outs = launch(tmp_path, "persistent_edit_worker.py",
                  lambda r, nvme: [tmp_path / f"rank{r}.pt", tmp_path / "pg"], 2, 30000)
    for rc, out in outs:
        assert rc == 0, out
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        torch.testing.assert_close(got["after"], got["before"] + 1.0)

