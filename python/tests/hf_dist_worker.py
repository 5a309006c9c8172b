"""One rank of test_hf_trainer's two-process case: strata's Trainer (stage 3, the optimizer on
cpu, a config all "auto", the tiny Llama in fp32) on this rank's shard of the data, as
accelerate shards it (torch.distributed is accelerate's: gloo through MASTER_ADDR/MASTER_PORT;
the engine rendezvouses through STRATA_RDZV_DIR). For each sampling strategy named on the command
line (its own engine, STRATA_RUN_ID suffixed), writes <outdir>/<strategy>.rank<r>.pt: the
Trainer's logged steps and the engine's master weights."""
import os
import sys

import torch

from test_hf_trainer import Losses, Tokens, args_kw, auto_config, tiny_llama
from strata.integrations import transformers as st

outdir, strategies = sys.argv[1], sys.argv[2:]
rank = int(os.environ["RANK"])
run_id = os.environ["STRATA_RUN_ID"]
torch.set_num_threads(1)
for i, strategy in enumerate(strategies):
    os.environ["STRATA_RUN_ID"] = f"{run_id}-{i}"
    args = st.TrainingArguments(deepspeed=auto_config(3, offload_optimizer="cpu"),
                                **args_kw(os.path.join(outdir, f"out-{strategy}"),
                                          train_sampling_strategy=strategy))
    assert args.world_size == 2 and args.process_index == rank, (args.world_size, rank)
    cb = Losses()
    trainer = st.Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(), callbacks=[cb])
    trainer.train()
    master = trainer.strata_engine.read_master()
    torch.save({"logs": cb.logs, "master": master,
                "steps": trainer.strata_engine.global_steps},
               os.path.join(outdir, f"{strategy}.rank{rank}.pt"))
    trainer.strata_engine.close()
