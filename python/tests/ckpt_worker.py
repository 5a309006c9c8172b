"""One rank of test_checkpoint_state's resharding run (2 ranks, stage 3, the BatchNorm model):
loads IN (saved by one rank) and writes what it got to OUT.loaded.rank<r>.pt, then trains STEPS
steps on its own batches (the ranks' running statistics differ) and saves to SAVE, writing its
state to OUT.saved.rank<r>.pt. Usage: ckpt_worker.py IN SAVE OUT STEPS"""
import os
import sys

import torch

import strata
from models import batch, ds_config, make_model

load_dir, save_dir, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rank = int(os.environ["RANK"])
model = make_model("bn")
engine, _, _, _ = strata.initialize(model=model, config=ds_config(3, world=2),
                                    timeout_ms=int(os.environ.get("TEST_TIMEOUT_MS", "60000")))


def dump(what, client):
    torch.save({"buffers": {n: b.clone() for n, b in model.named_buffers()},
                "master": engine.read_master(), "client": client}, f"{out}.{what}.rank{rank}.pt")


_, client = engine.load_checkpoint(load_dir)
dump("loaded", client)
for step in range(steps):
    loss = engine(*batch("bn", step, 0, rank))
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(save_dir, client_state={"pos": steps, "t": torch.arange(3)})
dump("saved", None)
engine.close()
