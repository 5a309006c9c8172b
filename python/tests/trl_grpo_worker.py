"""One rank of test_trl's two-process GRPO case: strata's GRPOTrainer at stage 3 (the parameters
on cpu, fp32), the policy partitioned over the 2 ranks, each rank generating for its share of
the prompts; run twice, with ds3_gather_for_generation True (the whole policy gathered once
around generate) and False (every module gathered per generated token, the ranks' forwards kept
in step by transformers' synced_gpus). Writes <outdir>/rank<r>.pt: each run's logged steps, its
policy master weights and the number of group gathers it made."""
import os
import sys

import torch

from test_trl import count_gathers, grpo_gathering

outdir = sys.argv[1]
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
gathers = count_gathers(setattr)
runs = {}
for gather in (True, False):
    gathers.clear()
    trainer, logs = grpo_gathering(os.path.join(outdir, f"out-{gather}"), gather)
    assert trainer.args.world_size == 2 and trainer.args.process_index == rank
    runs[gather] = {"logs": logs, "master": trainer.strata_engine.read_master(),
                    "gathers": len(gathers)}
    trainer.strata_engine.close()
torch.save(runs, os.path.join(outdir, f"rank{rank}.pt"))
