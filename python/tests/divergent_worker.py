"""One rank of test_divergent_branches: trains each case named on the command line in turn (its
own engine and rendezvous) on a model whose ranks run different modules in the same step, and
writes its losses and master weights, or the error it stopped at.

A case is KIND:STAGE[:OFFLOAD]. "branch": two same-sized layers and one of another size, which
rank r uses or skips by (rank, step), the first step included; "bart": a tiny BART from
transformers with LayerDrop (encoder_layerdrop, decoder_layerdrop 0.5): each rank draws which
layers it drops from its own seed, as a script whose ranks seed apart does."""
import os
import sys

import torch

import strata
from divergent_models import STEPS, config, forward, make_model, seed_step

outdir, cases = sys.argv[1], sys.argv[2:]
rank = int(os.environ["RANK"])
run_id = os.environ["STRATA_RUN_ID"]
for i, case in enumerate(cases):
    kind, stage, *offload = case.split(":")
    os.environ["STRATA_RUN_ID"] = f"{run_id}-{i}"
    model = make_model(kind)
    engine, *_ = strata.initialize(model=model, config=config(int(stage), *offload),
                                   timeout_ms=int(os.environ.get("TEST_TIMEOUT_MS", "60000")))
    losses = []
    try:
        for step in range(STEPS):
            seed_step(step, rank)
            loss = forward(engine, kind, step, rank)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        torch.save({"losses": losses, "master": engine.read_master()},
                   os.path.join(outdir, f"{case}.rank{rank}.pt"))
    except RuntimeError as e:
        with open(os.path.join(outdir, f"{case}.rank{rank}.err"), "w") as f:
            f.write(str(e))
    engine.close()
