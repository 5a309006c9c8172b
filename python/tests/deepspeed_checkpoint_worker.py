"""One rank of test_deepspeed_checkpoint's two-rank resume: loads the DeepSpeed checkpoint IN at
strata's STAGE, checks every state against DeepSpeed's read-out, trains DeepSpeed's steps 5 and 6
on this rank's batches and writes the masters to OUT.rank<r>.pt.
Usage: deepspeed_checkpoint_worker.py IN STAGE OUT"""
import os
import sys

import torch

import strata
from strata.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed"))
import make_deepspeed_checkpoints as fixture  # noqa: E402

ck, stage, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
ref = torch.load(os.path.join(ck, "reference.pt"), weights_only=True)
cfg = fixture.make_config(stage, ref["dtype"])
cfg["optimizer"]["params"].pop("torch_adam", None)
model = fixture.build_model(ref["frozen_param"] is not None, ref["model"])
engine, _, _, _ = strata.initialize(model=model, model_parameters=fixture.param_groups(model),
                                    config=cfg,
                                    timeout_ms=int(os.environ.get("TEST_TIMEOUT_MS", "60000")))
engine.load_checkpoint(ck)
equal = all(torch.equal(safe_get_full_fp32_param(p), ref["fp32"][n]) and
            torch.equal(safe_get_full_optimizer_state(p, "exp_avg_sq"), ref["exp_avg_sq"][n])
            for n, p in model.named_parameters() if p.requires_grad)
for step in (5, 6):
    loss = fixture.compute_loss(engine, fixture.get_batch(rank, step))
    engine.backward(loss)
    engine.step()
after = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters() if p.requires_grad}
torch.save({"after": after, "loaded_equal": equal, "global_steps": engine.global_steps},
           f"{out}.rank{rank}.pt")
engine.close()
