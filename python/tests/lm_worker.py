"""One rank of test_lm_zero3: runs every case of a JSON file in turn, each with its own engine
and rendezvous (STRATA_RUN_ID suffixed by the case's index), and writes each case's losses and
fp32 master weights after the first step and after the last.

A case: {"name", "kind" (models.make_lm), "steps", "global" (global batch: rank r trains on its
share of models.lm_batch), "overlap_step", and models.lm_config's keyword arguments}."""
import json
import os
import sys

import torch

import strata
from models import lm_batch, lm_config, lm_loss, make_lm

outdir, nvme, spec = sys.argv[1], sys.argv[2], sys.argv[3]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
run_id = os.environ["STRATA_RUN_ID"]
with open(spec) as f:
    cases = json.load(f)
for i, case in enumerate(cases):
    case = dict(case)
    name, kind, steps, size = case.pop("name"), case.pop("kind"), case.pop("steps"), case.pop("global")
    overlap_step = case.pop("overlap_step", False)
    os.environ["STRATA_RUN_ID"] = f"{run_id}-{i}"
    swap = os.path.join(nvme, name)
    os.makedirs(swap, exist_ok=True)
    cfg = lm_config(micro=size // world, nvme_path=swap, **case)
    model = make_lm(kind)
    engine, _, _, _ = strata.initialize(model=model, config=cfg, overlap_step=overlap_step,
                                        timeout_ms=int(os.environ.get("TEST_TIMEOUT_MS", "60000")))
    share = size // world
    losses, first = [], None
    for step in range(steps):
        idx, targets = lm_batch(kind, step, size)
        mine = slice(rank * share, (rank + 1) * share)
        loss = lm_loss(kind, engine, idx[mine], targets[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 0:
            first = engine.read_master()
    torch.save({"losses": losses, "first": first, "last": engine.read_master()},
               os.path.join(outdir, f"{name}.rank{rank}.pt"))
    engine.close()
