"""One rank of test_param_write_after_steps' two-rank case: at stage 3, after a step, a
persistent (whole) parameter edited in place and then a partitioned one written under
GatheredParameters(modifier_rank=0), as DeepSpeed-Chat's LoRA fuse does; writes what the
persistent parameter holds after the block, and its value before, to OUT."""
import os
import sys

import torch
import torch.distributed as dist

import strata

out, store = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}",
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 256), torch.nn.Linear(256, 4))
cfg = {"train_micro_batch_size_per_gpu": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 200}}
engine, _, _, _ = strata.initialize(model=model, config=cfg,
                                    timeout_ms=int(os.environ.get("TEST_TIMEOUT_MS", "30000")))
engine.backward(engine(torch.ones(2, 8)).square().mean())
engine.step()
small, big = model[0].weight, model[1].weight
assert small.ds_status == strata.zero.ZeroParamStatus.AVAILABLE  # persistent: whole
assert big.ds_status == strata.zero.ZeroParamStatus.NOT_AVAILABLE
before = small.data.clone()
small.data += 1.0  # DeepSpeed-Chat's fuse of a persistent layer: in place, no gather
with strata.zero.GatheredParameters([big], modifier_rank=0):
    big.data += 1.0
torch.save({"before": before, "after": small.data.clone()}, out)
engine.close()
