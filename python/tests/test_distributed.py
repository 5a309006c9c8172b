"""Two processes (the engine's Gloo communicator, file-store rendezvous through STRATA_RDZV_DIR)
against torch's AdamW on the mean of both ranks' gradients; and a rank that dies makes the other
fail with the engine's message, not hang. One launch runs every case (see dist_worker.py)."""
import pytest

torch = pytest.importorskip("torch")

from launch import launch as run_ranks  # noqa: E402
from models import reference  # noqa: E402

STEPS = 3
# Pairwise over stage x offload at 2 ranks, with the odd-sized and hidden-384 models (shard
# boundaries off the O_DIRECT alignment), zero.Init's sharded construction (also with each block
# set as a ZeRO-3 leaf after it: the engine's groups then merge zero.Init's; and a model built
# whole, partitioned by zero.Init(module=...); rank 1 built from another seed: rank 0's wins),
# persistent LayerNorms (whole between steps), modifier_rank, and
# ranks whose modules hold other weights than rank 0's (rank0: the engine scatters rank 0's, so
# the run still matches torch's from rank 0's weights); the tied head read in the parent's
# forward (tiedmm: `x @ wte.weight.t()`, whole at stages 0-2, gathered on read at stage 3);
# engine.no_sync() around the first of 2 micro-steps (nosync, stages 0-1: reduced once); a
# client AdamW with two parameter groups and a LambdaLR warmup (groups); frozen parameters (lora:
# a LoRA fine-tune, gptfe: a frozen tied embedding); empty_partition_cache and offload_states /
# reload_states after every step (lend).
CASES = ["gpt:0:none", "mlp:1:cpu", "gpt:2:cpu", "gpt:3:nvme", "gpt384:3:cpu",
         "gpt:3:none:init", "gpt:3:cpu:initleaf", "gpt:3:cpu:initmodule", "gpt:3:nvme:persist", "gpt:2:none:modifier", "mlp:0:none:rank0", "gpt:3:cpu:rank0",
         "tiedmm:0:none", "tiedmm:1:cpu", "tiedmm:2:none", "tiedmm:3:cpu",
         "mlp:0:none:nosync", "gpt:1:cpu:nosync", "gpt:1:none:groups", "gpt:3:nvme:groups",
         "lora:3:cpu", "lora:2:none", "gptfe:1:none", "gpt:3:none:lend"]


def launch(tmp_path, cases, steps=STEPS, world=2, die_rank=None, timeout_ms=60000):
    return run_ranks(tmp_path, "dist_worker.py", lambda r, nvme: [
        -1 if r == die_rank else steps, tmp_path, nvme, *cases], world, timeout_ms)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    outs = launch(tmp, CASES)
    return tmp, outs


@pytest.mark.parametrize("case", CASES, ids=[
    "-".join(["stage" + c.split(":")[1] if i == 1 else ("offload_" + p if i == 2 else p)
              for i, p in enumerate(c.split(":"))]) + "-2proc" for c in CASES])
def test_two_processes_match_torch(two_process_runs, case):
    tmp, outs = two_process_runs
    for rc, out in outs:
        assert rc == 0, out
    res = [torch.load(tmp / f"{case}.rank{r}.pt") for r in range(2)]
    kind, _, _, *flag = case.split(":")
    for n, p in res[0]["master"].items():
        assert torch.equal(p, res[1]["master"][n]), n  # both ranks agree bit for bit
    if flag == ["lend"]:  # the kept gathered copies, then the states, left the device
        for r in range(2):
            assert len(res[r]["freed"]) == STEPS
            assert all(0 < cached < lent for cached, lent in res[r]["freed"]), res[r]["freed"]
    if flag == ["modifier"]:
        # Rank 0's 0.5 reached both ranks' shards before training; training moves it from there.
        init = {n: p.detach().clone() for n, p in __import__("models").make_model(kind).named_parameters()}
        assert not torch.equal(res[0]["master"]["ln_f.weight"], init["ln_f.weight"])
        assert (res[0]["master"]["ln_f.weight"] - 0.5).abs().max() < 0.1
        return
    gas = 2 if flag == ["nosync"] else 1
    ref_losses, ref_params = reference(kind, STEPS, 1e-2, 0.01, gas=gas, world=2,
                                       groups=flag == ["groups"])
    mean_losses = [(a + b) / 2 for a, b in zip(res[0]["losses"], res[1]["losses"])]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-5)
    for n, p in res[0]["master"].items():
        torch.testing.assert_close(p, ref_params[n], atol=2e-5, rtol=1e-4, msg=n)


def test_zero_init_partitions_a_class_defined_inside_the_block_as_rank_0_built_it(tmp_path):
    """A module class created inside zero.Init (defined there, or a library's imported there
    first) is partitioned at construction like torch's, from rank 0's values: with each rank
    seeded apart the engine starts from rank 0's model (its own parameter was left whole, and
    each rank kept its range of its own construction)."""
    outs = run_ranks(tmp_path, "zero_init_class_worker.py", lambda r, nvme: [tmp_path], 2, 60000)
    for rc, out in outs:
        assert rc == 0, out
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert res[0]["partitioned"] and res[1]["partitioned"]
    torch.manual_seed(0)
    w, lin = torch.randn(64), torch.nn.Linear(64, 64)
    for r in range(2):
        assert torch.equal(res[r]["master"]["w"], w), r
        assert torch.equal(res[r]["master"]["lin.weight"], lin.weight.detach()), r


def test_a_module_built_whole_beside_zero_init_partitions_starts_from_rank_0s(tmp_path):
    """A Linear replaced after zero.Init (as resize_token_embeddings' new embedding or a PEFT
    adapter are built), each rank seeded apart: the engine starts from rank 0's values, as
    DeepSpeed broadcasts them before partitioning; before, each rank filled its own range from
    its own copy (rows 0-39 from rank 0, 40-63 from rank 1)."""
    outs = run_ranks(tmp_path, "zero_init_class_worker.py",
                     lambda r, nvme: [tmp_path, "replaced"], 2, 60000)
    for rc, out in outs:
        assert rc == 0, out
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.manual_seed(0)
    w = torch.randn(64)
    torch.manual_seed(100)
    lin = torch.nn.Linear(64, 64)
    for r in range(2):
        assert torch.equal(res[r]["master"]["w"], w), r
        assert torch.equal(res[r]["master"]["lin.weight"], lin.weight.detach()), r
        assert torch.equal(res[r]["master"]["lin.bias"], lin.bias.detach()), r


def test_ranks_that_end_without_close_leave_no_swap_file(tmp_path):
    """Two ranks training on NVMe that end without engine.close() (DeepSpeed scripts never call
    one): each removes its swap files at exit, so the next run finds no crashed run's leftovers
    (it cannot close: finalizing the communicator waits for the other rank)."""
    outs = launch(tmp_path, ["gpt:3:nvme:noclose"])
    for rc, out in outs:
        assert rc == 0, out
        assert "closing an engine at exit failed" not in out, out
    assert len(torch.load(tmp_path / "gpt:3:nvme:noclose.rank0.pt")["losses"]) == STEPS
    assert sorted(p.name for p in tmp_path.glob("nvme*")) == ["nvme0", "nvme1"]
    assert not list(tmp_path.rglob("*.swp"))


def test_dead_rank_fails_the_other_with_a_message(tmp_path):
    # Rank 1 leaves right after setup: rank 0's first collective fails (no hang past the timeout).
    outs = launch(tmp_path, ["mlp:3:cpu"], die_rank=1, timeout_ms=8000)
    rc0, out0 = outs[0]
    assert rc0 != 0
    assert "StrataError" in out0, out0
    print(out0[-600:])
