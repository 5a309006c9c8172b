"""A script written for DeepSpeed (ds_script_worker.py, after DeepSpeedExamples' CIFAR example)
run on strata with its imports changed (`import strata as deepspeed`, strata.accelerator's
get_accelerator): add_config_arguments, init_distributed, initialize(args=...) with
model_parameters and training_data, the engine's local_rank / bfloat16_enabled(),
get_accelerator().device_name(local_rank). One process without a launcher trains as torch does on
the batches DeepSpeed's loader gives (a DistributedSampler, shuffled with seed 0, the same order
each epoch); two ranks under `offloadctl launch` end where one rank does."""
import gc
import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from launch import HERE  # noqa: E402

LR, N, BATCH, EPOCHS = 1e-3, 48, 16, 2
LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID")


def write_config(tmp_path, stage, offload="none"):
    z = {"stage": stage}
    if offload != "none":
        z["offload_optimizer"] = {"device": offload}
    cfg = {"train_batch_size": BATCH, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": z}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    return path


def script_args(tmp_path, config, out):
    return ["--deepspeed", "--deepspeed_config", str(config), "-e", str(EPOCHS), "--out", str(out)]


def reference():
    """The worker's model and data trained by torch: AdamW, the DistributedSampler's order."""
    sys.path.insert(0, HERE)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(N, 3, 32, 32, generator=g)
    targets = torch.randint(0, 10, (N,), generator=g)
    data = torch.utils.data.TensorDataset(images, targets)
    src = open(os.path.join(HERE, "ds_script_worker.py")).read()
    net_src = src[src.index("class Net"):src.index("torch.manual_seed(0)\nnet = Net()")]
    scope = {"nn": torch.nn, "F": torch.nn.functional}
    exec(net_src, scope)
    torch.manual_seed(0)
    net = scope["Net"]()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    losses = []
    for _ in range(EPOCHS):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    with torch.no_grad():
        out = net(images)
        correct = (out.argmax(1) == targets).sum().item()
        eval_loss = torch.nn.functional.cross_entropy(out, targets).item()
    return losses, correct, eval_loss


def run_one_process(tmp_path, stage, offload="none"):
    """The worker as one process started without a launcher; what rank 0 wrote."""
    config, out = write_config(tmp_path, stage, offload), tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, os.path.join(HERE, "ds_script_worker.py"),
                        *script_args(tmp_path, config, out)], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage,offload", [(2, "cpu"), (3, "none")])
def test_one_process_without_a_launcher_trains_as_torch(tmp_path, stage, offload):
    """On the CPU (test_cuda.py runs the script on a GPU)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script trains there (test_cuda.py)")
    got = run_one_process(tmp_path, stage, offload)
    assert (got["world"], got["local_rank"], got["args_local_rank"]) == (1, 0, 0)
    assert got["device"] == got["engine_device"] == "cpu"
    assert got["deepspeed"] and got["stage"] == stage and not got["fp16"] and not got["bf16"]
    assert got["train_batch_size"] == BATCH
    steps = EPOCHS * N // BATCH
    assert got["global_steps"] == steps and len(got["losses"]) == steps
    want_losses, want_correct, want_eval = reference()
    assert got["losses"] == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
    assert got["mean_losses"] == got["losses"]  # strata.comm's all-reduce over one rank
    assert got["correct"] == want_correct
    assert got["eval_loss"] == pytest.approx(want_eval, rel=1e-5)
    assert got["comm"] == {"coalesced": [[1.0, 1.0], [1.0, 1.0, 1.0]], "ranks": [0]}
    assert want_eval < want_losses[0]  # it learnt something: the run is not a no-op


EXIT_SCRIPT = """
import atexit, os, sys, torch


def gloo_threads():
    task = f"/proc/{os.getpid()}/task"
    names = []
    for t in os.listdir(task):
        try:
            names.append(open(f"{task}/{t}/comm").read().strip())
        except OSError:
            pass
    return sum(n == "pt_gloo_runloop" for n in names)


# Registered before strata's: runs after it, as the interpreter's last handler.
atexit.register(lambda: print("at the end:", torch.distributed.is_initialized(), gloo_threads(),
                              flush=True))
if sys.argv[1] == "script-first":  # a group up before strata is imported, held by the defaults
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    import torch.distributed.nn.functional
import strata, strata.comm as dist
if sys.argv[1] == "script":  # the script's own group (strata.init_distributed then keeps it)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
strata.init_distributed(dist_backend="gloo")
# The first torch Optimizer imports torch._dynamo, which imports torch.distributed.nn.functional,
# whose defaults hold the group until strata releases them at exit.
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
# Collectives on temporaries right before the end: gloo's thread drops their tensors behind
# the script, after the interpreter began to finalize unless the group ended first.
for _ in range(50):
    dist.all_reduce(torch.ones(100000), async_op=True)
if sys.argv[1] == "raises":
    raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize("started_by", ["strata", "script", "script-first"])
def test_a_script_that_ends_after_its_collectives_exits_cleanly(tmp_path, started_by):
    """A gloo group the script left up is destroyed at exit, its threads ended, before the
    interpreter finalizes: without it, gloo's thread could need the GIL then, and the process
    aborted after the script succeeded ("terminate called without an active exception", about
    one run in seven of this script). torch.distributed.nn.functional, imported while the group
    is up (by the optimizer, or by the script itself before strata), holds it in its default
    arguments until strata releases them."""
    script = tmp_path / "ends.py"
    script.write_text(EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    for _ in range(3):
        r = subprocess.run([sys.executable, str(script), started_by], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "at the end: False 0" in r.stdout, r.stdout + r.stderr
    # A script that fails: its error and exit code stand (the group of one is destroyed too: no
    # peer can be in a collective; with several ranks it is left up, as a peer could be).
    for _ in range(3):
        r = subprocess.run([sys.executable, str(script), "raises"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "RuntimeError: the script failed" in r.stderr, r.stderr
        assert "at the end: False 0" in r.stdout, r.stdout + r.stderr


def test_the_accelerator_names_the_device_the_engine_picks():
    from strata.accelerator import get_accelerator
    acc = get_accelerator()
    assert acc is get_accelerator()
    if torch.cuda.is_available():
        assert (acc.name(), acc.device_name(1), acc.device_name()) == ("cuda", "cuda:1", "cuda")
        assert acc.communication_backend_name() == "nccl"
        assert acc.device_count() == torch.cuda.device_count()
    else:
        assert (acc.name(), acc.device_name(1), acc.device_name()) == ("cpu", "cpu", "cpu")
        assert acc.communication_backend_name() == "gloo" and acc.device_count() == 1
        gc.collect()  # engines earlier tests left unclosed: their device bytes count until then
        assert acc.memory_allocated() == 0 and acc.total_memory() > 0
        acc.synchronize()  # nothing to wait for
        acc.empty_cache()
    want = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    assert acc.current_device_name() == want == str(acc.device(acc.current_device()))
    t = torch.zeros(2)
    assert acc.on_accelerator(t) == (acc.name() == "cpu")


def offloadctl():
    """The build's offloadctl beside the module (build/python/strata -> build/tools)."""
    import strata
    built = os.path.join(os.path.dirname(strata.__file__), "..", "..", "tools", "offloadctl")
    return built if os.path.exists(built) else shutil.which("offloadctl")


def test_two_ranks_under_offloadctl_launch_end_where_one_rank_does(tmp_path):
    """`offloadctl launch -n 2` (torchrun's environment; the script's init_distributed takes
    MASTER_PORT for torch.distributed, the engine's store the port after it). Each rank trains
    on its half of each global batch (DistributedSampler(2, rank) over the same permutation):
    the model after the run is one rank's, up to the order of the sums."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: two ranks would need two")
    launcher = offloadctl()
    assert launcher, "offloadctl is neither in the build tree nor on PATH"
    config, out = write_config(tmp_path, 3), tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    r = subprocess.run([launcher, "launch", "-n", "2", "--", sys.executable,
                        os.path.join(HERE, "ds_script_worker.py"),
                        *script_args(tmp_path, config, out)], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert (got["world"], got["local_rank"], got["args_local_rank"]) == (2, 0, 0)
    assert got["dist_local_rank"] == 0
    assert got["train_batch_size"] == BATCH and got["global_steps"] == EPOCHS * N // BATCH
    want_losses, want_correct, want_eval = reference()
    # The two ranks' losses averaged through strata.comm are one rank's loss on the whole batch.
    assert got["mean_losses"] == pytest.approx(want_losses, rel=1e-4)
    assert got["correct"] == want_correct
    assert got["eval_loss"] == pytest.approx(want_eval, rel=1e-4)
    # all_reduce_coalesced summed each tensor in place: ranks 1 and 2's values, and 1 + 1.
    assert got["comm"] == {"coalesced": [[3.0, 3.0], [2.0, 2.0, 2.0]], "ranks": [0, 1]}


def test_the_engine_store_does_not_need_the_port_after_master_port(tmp_path):
    """Under a launcher with torch.distributed up, the engine's store took MASTER_PORT + 1, which
    the ranks' own connections could hold by then (errno 98 at initialize, 1 launch in 82): rank
    0 now picks a free port and sends it over the group. Here MASTER_PORT + 1 is held throughout."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: two ranks would need two")
    import socket
    launcher = offloadctl()
    assert launcher, "offloadctl is neither in the build tree nor on PATH"
    held = socket.socket()
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            held.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            continue
    held.listen()
    try:
        config, out = write_config(tmp_path, 3), tmp_path / "out.json"
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
        env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
        r = subprocess.run([launcher, "launch", "-n", "2", "--master-port", str(port), "--",
                            sys.executable, os.path.join(HERE, "ds_script_worker.py"),
                            *script_args(tmp_path, config, out)], env=env, capture_output=True,
                           text=True, timeout=240)
    finally:
        held.close()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["world"] == 2 and got["global_steps"] == EPOCHS * N // BATCH


SUPEROFFLOAD_CONFIG = {
    "train_batch_size": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 4e8,
                          "sub_group_size": 4e8,
                          "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                "ratio": 0.80, "super_offload": True,
                                                "cpuadam_cores_perc": 0.90}},
    "wall_clock_breakdown": True}


@pytest.mark.parametrize("ranks", [1, 2])
def test_deepspeed_superoffload_script_runs_alone_and_under_launch(tmp_path, ranks):
    """superoffload_worker.py (DeepSpeed-SuperOffload's finetune_zero3.py in miniature, its
    config as that example writes it): alone it reads the rank through strata.comm without
    having started torch.distributed; under `offloadctl launch -n 2` strata.initialize starts it
    from the launcher's environment, as DeepSpeed's initialize does. Its parameter count through
    ds_tensor / ds_numel is the model's, its MoE blocks are one group each."""
    if ranks == 2 and torch.cuda.is_available():
        pytest.skip("a GPU is present: two ranks would need two")
    pytest.importorskip("transformers")
    cfg = dict(SUPEROFFLOAD_CONFIG, train_batch_size=2 * ranks)
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.join(HERE, "superoffload_worker.py"),
           "--deepspeed_config", str(tmp_path / "ds.json"), "--out", str(out)]
    if ranks == 2:
        launcher = offloadctl()
        assert launcher, "offloadctl is neither in the build tree nor on PATH"
        cmd = [launcher, "launch", "-n", "2", "--local-rank-arg", "--"] + cmd
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert (got["rank"], got["world"]) == (0, ranks)
    assert got["model_size"] == got["whole"]
    assert got["leaf_groups"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert len(got["losses"]) == 3 and all(0 < l < 10 for l in got["losses"])
