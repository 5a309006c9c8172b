"""One rank of test_trl's two-process case: strata's DPOTrainer at stage 3 (the parameters on
cpu, "auto" config, fp32), policy and reference loaded by from_pretrained after the arguments
(each built partitioned over the 2 ranks; the reference in a forward-only engine of its own), on
this rank's shard of the preference pairs as accelerate shards them; sync_ref_model mixes the
policy into the reference every 2 steps (both gathered with modifier_rank 0). Writes
<outdir>/rank<r>.pt: the logged steps and both engines' master weights."""
import os
import sys

import torch
import transformers

from test_trl import SYNC, config_kw, ds_config, preference_dataset, tokenizer
from strata.integrations import trl as strl

outdir, saved = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
args = strl.DPOConfig(deepspeed=ds_config(3, offload_param="cpu"),
                      **config_kw(os.path.join(outdir, "out"), max_steps=4, **SYNC))
assert args.world_size == 2 and args.process_index == rank, (args.world_size, rank)
model = transformers.LlamaForCausalLM.from_pretrained(saved)
ref = transformers.LlamaForCausalLM.from_pretrained(saved)
trainer = strl.DPOTrainer(model=model, ref_model=ref, args=args, processing_class=tokenizer(),
                          train_dataset=preference_dataset())
trainer.train()
logs = [h for h in trainer.state.log_history if "loss" in h]
torch.save({"logs": logs, "master": trainer.strata_engine.read_master(),
            "references": len(trainer._strata_frozen_engines),
            "reference": trainer._strata_frozen_engines["reference"].read_master()},
           os.path.join(outdir, f"rank{rank}.pt"))
trainer.strata_engine.close()
