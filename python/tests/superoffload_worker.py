"""DeepSpeed-SuperOffload's fine-tuning script (DeepSpeedExamples training/DeepSpeed-SuperOffload/
finetune_zero3.py) in miniature, with its imports changed to strata's: a transformers MoE model
with its MoE blocks set as ZeRO-3 leaves, non-reentrant gradient checkpointing, DeepSpeedCPUAdam,
the SuperOffload config (partial offload, super_offload), initialize(args=, optimizer=,
training_data=, collate_fn=), and the rank read through deepspeed.comm without init_distributed
(DeepSpeed's initialize starts torch.distributed). Writes what it saw as JSON (rank 0)."""
import argparse
import json
import sys

import torch
import transformers
from transformers import default_data_collator

import strata as deepspeed  # was: import deepspeed
from strata import comm as dist  # was: from deepspeed import comm as dist
from strata.ops.adam import DeepSpeedCPUAdam  # was: from deepspeed.ops.adam import ...
from strata.utils import set_z3_leaf_modules  # was: from deepspeed.utils import ...


def get_parameter_count(parameter):
    return parameter.ds_numel if hasattr(parameter, "ds_tensor") else parameter.numel()


parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
whole = sum(p.numel() for p in model.parameters())
set_z3_leaf_modules(model, ["Qwen2MoeSparseMoeBlock"])
model.config.use_cache = False
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, betas=(0.9, 0.999))
g = torch.Generator().manual_seed(5)
dataset = [{"input_ids": ids, "labels": ids.clone()}
           for ids in torch.randint(0, 64, (16, 12), generator=g)]
model_engine, optimizer, train_dataloader, _ = deepspeed.initialize(
    args=args, model=model, optimizer=optimizer, training_data=dataset,
    collate_fn=default_data_collator)
rank = dist.get_rank()  # no init_distributed in the script
model_engine.train()
model_size = sum(get_parameter_count(p) for p in model.parameters())
losses = []
for step, batch in enumerate(train_dataloader):
    if step == args.steps:
        break
    batch = {k: v.to(model_engine.device) for k, v in batch.items()}
    loss = model_engine(**batch).loss
    model_engine.backward(loss)
    model_engine.step()
    losses.append(loss.item())
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"rank": rank, "world": dist.get_world_size(), "losses": losses,
                   "model_size": model_size, "whole": whole,
                   "leaf_groups": [g.name for g in model_engine._groups if g.name.endswith("mlp")]}, f)
sys.exit(0)
