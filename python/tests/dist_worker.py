"""One rank of test_two_processes: trains, then writes its losses and master weights."""
import os
import sys

import torch

import strata
from models import batch, ds_config, make_model

kind, stage, offload, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
nvme = sys.argv[6] if len(sys.argv) > 6 else None
model = make_model(kind)
engine, _, _, _ = strata.initialize(model=model, config=ds_config(stage, offload, nvme_path=nvme),
                                    timeout_ms=int(os.environ.get("TEST_TIMEOUT_MS", "60000")))
rank = engine.global_rank
if steps < 0:  # a rank that dies right after setup (test_dead_rank_...)
    os._exit(0)
losses = []
for step in range(steps):
    loss = engine(*batch(kind, step, 0, rank))
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
master = engine.read_master()
torch.save({"losses": losses, "master": master, "stats": engine.stats()}, out)
engine.close()
