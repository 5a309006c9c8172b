"""A script written as transformers' docs write a non-Trainer DeepSpeed ZeRO-3 run:

    dschf = HfDeepSpeedConfig(ds_config)  # keep this object alive
    model = AutoModelForCausalLM.from_pretrained(path)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)

with strata's HfDeepSpeedConfig and `import strata as deepspeed`. --whole: no HfDeepSpeedConfig
(from_pretrained loads the whole model; the reference). --resize N: resize_token_embeddings(N)
after the load (transformers gathers the embeddings through `import deepspeed`). --dschat-lora:
DeepSpeed-Chat's own LoRA layers, each taking a (partitioned) decoder weight. --peft: a LoRA
adapter with the lm_head in modules_to_save (PEFT copies the partitioned head under `import
deepspeed`'s GatheredParameters). Writes OUT (torch.save): whether every parameter was
partitioned when from_pretrained returned, the elements this rank then held, each step's loss
and the final weights (rank 0)."""
import argparse
import json

import torch

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("model_dir")
ap.add_argument("config")
ap.add_argument("--whole", action="store_true")
ap.add_argument("--resize", type=int, default=0)
ap.add_argument("--peft", action="store_true")
ap.add_argument("--dschat-lora", action="store_true",
                help="DeepSpeed-Chat's own LoRA: each decoder Linear swapped for a layer holding "
                     "its (partitioned) weight, by dotted name")
ap.add_argument("--steps", type=int, default=4)
args = ap.parse_args()

import transformers  # noqa: E402

import strata as deepspeed  # noqa: E402  (was: import deepspeed)
from strata.integrations.transformers import HfDeepSpeedConfig  # noqa: E402

torch.set_num_threads(1)
with open(args.config) as f:
    ds_config = json.load(f)
if not args.whole:
    dschf = HfDeepSpeedConfig(ds_config)  # keep this object alive

torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir)
params = list(model.parameters())
rec = {"partitioned": all(p.numel() == 0 and hasattr(p, "ds_numel") for p in params),
       "held": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
       "total": sum(getattr(p, "ds_numel", p.numel()) for p in params)}
if args.resize:
    torch.manual_seed(1)
    model.resize_token_embeddings(args.resize, mean_resizing=False)
    rec["vocab"] = model.config.vocab_size
if args.dschat_lora:  # DeepSpeed-Chat's convert_linear_layer_to_lora, abridged
    import math

    from strata.compression.helper import recursive_getattr, recursive_setattr

    class LinearLayer_LoRA(torch.nn.Module):
        def __init__(self, weight, lora_dim=4, bias=None):
            super().__init__()
            self.weight = weight
            self.bias = bias
            try:
                rows, columns = weight.ds_shape  # partitioned under zero.Init
            except Exception:  # noqa: BLE001 - as DeepSpeed-Chat writes it
                rows, columns = weight.shape
            self.lora_right_weight = torch.nn.Parameter(torch.zeros(columns, lora_dim))
            self.lora_left_weight = torch.nn.Parameter(torch.zeros(lora_dim, rows))
            torch.nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
            torch.nn.init.normal_(self.lora_left_weight, std=0.02)
            self.weight.requires_grad = False

        def forward(self, x):
            return (torch.nn.functional.linear(x, self.weight, self.bias)
                    + x @ self.lora_right_weight @ self.lora_left_weight)

    torch.manual_seed(2)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and "layers" in name:
            recursive_setattr(model, name, LinearLayer_LoRA(recursive_getattr(model, name).weight,
                                                            bias=module.bias))
if args.peft:
    import peft
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        modules_to_save=["lm_head"]))

engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
    config=ds_config)
vocab = args.resize or model.config.vocab_size
g = torch.Generator().manual_seed(3)
rec["loss"] = []
for step in range(args.steps):
    x = torch.randint(0, vocab, (2, 16), generator=g)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    rec["loss"].append(loss.item())
state = engine._zero3_consolidated_16bit_state_dict()
if engine.global_rank == 0:
    rec["state"] = state
    torch.save(rec, args.out)
