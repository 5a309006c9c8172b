"""One rank of test_distributed's zero.Init class test: a module class defined inside the
strata.zero.Init block, with a parameter of its own, built with each rank seeded apart; writes
the weights the engine starts from (every rank's must be rank 0's construction). With
"replaced", its Linear is replaced by a whole one after the block, each rank seeded apart."""
import os
import sys

import torch

import strata
from models import ds_config

rank = int(os.environ["RANK"])
torch.distributed.init_process_group(
    "gloo", init_method=f"file://{os.environ['STRATA_RDZV_DIR']}/torch-store", rank=rank,
    world_size=int(os.environ["WORLD_SIZE"]))
cfg = ds_config(3, world=2)
with strata.zero.Init(config=cfg):
    class Scaled(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(n))
            self.lin = torch.nn.Linear(n, n)

        def forward(self, x):
            return self.lin(x * self.w).pow(2).mean()

    torch.manual_seed(rank)
    model = Scaled(64)
partitioned = all(p.numel() == 0 for p in model.parameters())
if sys.argv[2:] == ["replaced"]:
    # A module replaced after zero.Init (a new head; resize_token_embeddings' new embedding;
    # a PEFT adapter): whole, each rank's own construction.
    torch.manual_seed(100 + rank)
    model.lin = torch.nn.Linear(64, 64)
engine, _, _, _ = strata.initialize(model=model, config=cfg)
torch.save({"partitioned": partitioned, "master": engine.read_master()},
           os.path.join(sys.argv[1], f"rank{rank}.pt"))
engine.close()
torch.distributed.destroy_process_group()
