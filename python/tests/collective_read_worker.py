"""One rank of test_ds_utils' collective-read case: at stage 2, rank 0 alone reads a parameter's
fp32 master (a logging line under `if rank == 0:`); prints the error each rank meets."""
import os

import torch

import strata

rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}}
engine, _, _, _ = strata.initialize(model=model, config=cfg,
                                    timeout_ms=int(os.environ["TEST_TIMEOUT_MS"]))
engine.backward(engine(torch.ones(2, 8)).square().mean())
try:
    if rank == 0:
        strata.utils.safe_get_full_fp32_param(model[0].weight)
    engine.step()
except RuntimeError as e:
    print(f"rank {rank} raised: {e}", flush=True)
