"""One rank of test_distributed: runs every case named on the command line in turn (one process
start for all: torch's import dominates a short run), each with its own engine and rendezvous
(STRATA_RUN_ID suffixed by the case), and writes each case's losses and master weights.

A case is KIND:STAGE:OFFLOAD[:FLAG]; FLAG "init" builds the model inside strata.zero.Init (rank 1
from another seed: zero.Init takes rank 0's values), "initmodule" builds it whole and partitions
it with strata.zero.Init(module=model) (rank 1 likewise),
"modifier" writes ln_f.weight through GatheredParameters(modifier_rank=0) before training,
"rank0" gives ranks other than 0 other weights (initialize takes rank 0's, as DeepSpeed),
"groups" passes a client AdamW with models.decay_groups and a LambdaLR warmup,
"persist" makes the LayerNorms persistent (whole between steps), "nosync" runs 2 micro-steps
per step, the first inside engine.no_sync() (stages 0-1), "noclose" ends the process with the
engine open (the last case).
STEPS < 0: the rank leaves right after the engine is set up (a dead rank). TEST_DEVICE=cuda: the
model and batches on GPU LOCAL_RANK (the engine then runs on CudaDevice + NCCL)."""
import contextlib
import os
import sys

import torch

import strata
import strata.utils
from models import batch, decay_groups, ds_config, make_model, warmup

steps, outdir, nvme = int(sys.argv[1]), sys.argv[2], sys.argv[3]
cases = sys.argv[4:]
rank = int(os.environ["RANK"])
run_id = os.environ["STRATA_RUN_ID"]
device = torch.device("cpu")
if os.environ.get("TEST_DEVICE") == "cuda":
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
# torch.distributed (gloo) only for what strata.zero uses it for: GatheredParameters' broadcast
# and zero.Init's gathers. The engine talks through its own Gloo communicator.
torch.distributed.init_process_group(
    "gloo", init_method=f"file://{os.environ['STRATA_RDZV_DIR']}/torch-store", rank=rank,
    world_size=int(os.environ["WORLD_SIZE"]))
for i, case in enumerate(cases):
    kind, stage, offload, *flag = case.split(":")
    os.environ["STRATA_RUN_ID"] = f"{run_id}-{i}"
    gas = 2 if flag == ["nosync"] else 1
    cfg = ds_config(int(stage), offload, gas=gas, nvme_path=nvme, world=2)
    if flag == ["persist"]:  # the LayerNorms persistent: whole between steps on both ranks
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 64
    if flag in (["init"], ["initleaf"]):
        with strata.zero.Init(config=cfg):  # rank 1 seeded apart: both get rank 0's model
            model = make_model(kind, seed=0 if rank == 0 else 1)
    elif flag == ["initmodule"]:  # a model built whole, partitioned by zero.Init(module=...)
        model = make_model(kind, seed=0 if rank == 0 else 1)
        strata.zero.Init(module=model, config_dict_or_path=cfg)
        assert all(p.numel() == 0 for p in model.parameters())
        if flag == ["initleaf"]:  # set after construction: one group per block, not zero.Init's
            strata.utils.set_z3_leaf_modules(model, ["Block"])
    else:
        model = make_model(kind).to(device)
    if flag == ["rank0"] and rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # other ranks' weights differ: initialize takes rank 0's
    kw = {}
    if flag == ["groups"]:  # a client AdamW with two param groups and a LambdaLR warmup
        opt = torch.optim.AdamW(decay_groups(model), lr=cfg.pop("optimizer")["params"]["lr"])
        kw = {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, warmup)}
    engine, _, _, _ = strata.initialize(
        model=model, config=cfg, timeout_ms=int(os.environ.get("TEST_TIMEOUT_MS", "60000")),
        **kw)
    if steps < 0:
        os._exit(0)
    if flag == ["modifier"]:
        with strata.zero.GatheredParameters(model.ln_f.weight, modifier_rank=0):
            with torch.no_grad():
                model.ln_f.weight.fill_(0.5 if rank == 0 else 0.25)  # rank 0's values win
    losses, freed = [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            with engine.no_sync() if m < gas - 1 else contextlib.nullcontext():
                loss = engine(*(x.to(device) for x in batch(kind, step, m, rank)))
                engine.backward(loss)
                engine.step()
            total += loss.item() / gas
        losses.append(total)
        if flag == ["lend"]:  # an RL loop: a generation pass keeps gathered copies, which
            with torch.no_grad():  # empty_partition_cache frees; then every state lent out
                engine(*(x.to(device) for x in batch(kind, step, 0, rank)))
            before = engine._engine.device_used_bytes
            engine.empty_partition_cache()
            cached = before - engine._engine.device_used_bytes
            engine.offload_states()
            freed.append((cached, before - engine._engine.device_used_bytes))
            engine.reload_states()
    if flag == ["persist"]:
        assert model.ln_f.weight.numel() == 32 and model.blocks[0].fc.weight.numel() == 0
    master = engine.read_master()
    torch.save({"losses": losses, "master": master, "device": str(engine.device),
                "engine_device": engine._engine.device, "freed": freed},
               os.path.join(outdir, f"{case}.rank{rank}.pt"))
    if flag != ["noclose"]:  # noclose: the script ends with its engine open (run it last)
        engine.close()
torch.distributed.destroy_process_group()
