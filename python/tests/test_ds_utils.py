"""DeepSpeed's small helpers that scripts import, under strata's module paths (`deepspeed` becoming
`strata`): DeepSpeed-Chat's recursive_getattr / recursive_setattr
(deepspeed.compression.helper), deepspeed.utils' RepeatingLoader, logger and log_dist, and
deepspeed.runtime.utils.see_memory_usage, each as DeepSpeed's behaves."""
import logging

import pytest

torch = pytest.importorskip("torch")
import strata as deepspeed  # noqa: E402
from strata.compression.helper import recursive_getattr, recursive_setattr  # noqa: E402
from strata.runtime.utils import see_memory_usage  # noqa: E402
from strata.utils import RepeatingLoader, log_dist, logger  # noqa: E402


def test_recursive_getattr_and_setattr_replace_a_module_by_its_dotted_name():
    """DeepSpeed-Chat's convert_linear_layer_to_lora: find each Linear by name, put a wrapper in
    its place."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sequential(torch.nn.Linear(3, 4)))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert names == ["0", "1.0"]
    for name in names:
        inner = recursive_getattr(model, name)
        recursive_setattr(model, name, torch.nn.Sequential(inner, torch.nn.Identity()))
    assert isinstance(model[1][0], torch.nn.Sequential) and model[1][0][0].out_features == 4
    with pytest.raises(AttributeError):
        recursive_getattr(model, "1.missing")


def test_repeating_loader_starts_the_loader_again():
    loader = torch.utils.data.DataLoader(torch.arange(6), batch_size=2)
    it = RepeatingLoader(loader)
    got = [next(it).tolist() for _ in range(7)]
    assert got == [[0, 1], [2, 3], [4, 5]] * 2 + [[0, 1]]
    assert iter(it) is it


def test_logger_and_log_dist(caplog, capsys):
    assert logger.name == "DeepSpeed"
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_initialized() else -1  # -1: not started, as DeepSpeed's
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        log_dist("hello", ranks=[0])  # rank 0, or one process without torch.distributed
        log_dist("not here", ranks=[5])
    want = ["[Rank -1] hello", "[Rank -1] not here"] if rank == -1 else ["[Rank 0] hello"]
    assert [r.getMessage() for r in caplog.records] == want
    assert deepspeed.utils.log_dist is log_dist
    # DeepSpeed's once-only and print variants
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        for _ in range(3):
            deepspeed.utils.log_dist_once("once", ranks=[0])
            logger.warning_once("warned once")
    assert [r.getMessage() for r in caplog.records] == [f"[Rank {rank}] once", "warned once"]
    capsys.readouterr()
    deepspeed.utils.logging.print_dist("printed", ranks=[0])  # whatever the logger's level
    assert capsys.readouterr().out == f"[Rank {rank}] printed\n"


def test_see_memory_usage_prints_only_when_forced(capsys):
    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("after init", force=True)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "after init"
    assert out[-1].startswith("CPU Virtual Memory:  used = ") and "percent = " in out[-1]


def test_memory_estimators_print_strata_plans_for_a_transformers_model(capsys):
    """deepspeed.runtime.zero.stage3 / stage_1_and_2's estimators (what Hugging Face's DeepSpeed
    guide has users run) on a transformers GPT-2: DeepSpeed's table, each row strata's plan for
    that placement (strata.plan, the engine's own layout), the CPU figure times the buffer
    factor as DeepSpeed's."""
    transformers = pytest.importorskip("transformers")
    from models import make_lm
    from strata.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from strata.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold
    from strata.runtime.zero._estimate import model_to_params
    model = make_lm("gpt2")
    total, largest = model_to_params(model)
    assert total == sum(p.numel() for p in model.parameters())  # the tied head once
    assert largest == 64 * 256 + 256  # the MLP's c_fc: Conv1D 64 -> 4 x 64, with its bias
    rows = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2,
                                                           additional_buffer_factor=1.0)
    out = capsys.readouterr().out
    assert "HW: Setup with 1 node, 2 GPUs per node." in out and "  per CPU  |  per GPU" in out
    assert [(r["offload_param"], r["offload_optimizer"]) for r in rows] == [
        ("cpu", "cpu"), ("none", "cpu"), ("none", "none"), ("nvme", "nvme")]
    for r in rows:
        want = deepspeed.plan(total, {"train_micro_batch_size_per_gpu": 1,
                                      "bf16": {"enabled": True}}, stage=3,
                              offload_param=r["offload_param"],
                              offload_optimizer=r["offload_optimizer"], gpus=2,
                              largest_group=largest)["configured"]
        assert (r["cpu_bytes"], r["gpu_bytes"]) == (
            int(want["host_bytes_per_node"] - want["host_cache_bytes_per_node"]),
            int(want["hbm_bytes_per_gpu"]))
    # At 7B (a tiny model's groups are all under the persistence threshold, whole on the GPU
    # whatever the placement) offloading moves bytes off the GPU onto the host, NVMe off both.
    from strata.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    cpu_cpu, none_cpu, none_none, nvme = estimate_zero3_model_states_mem_needs_all_cold(
        7e9, 2e8, num_gpus_per_node=8)
    assert "SW: Model with 7000M total params, 200M largest layer params" in \
        capsys.readouterr().out
    assert cpu_cpu["gpu_bytes"] < none_cpu["gpu_bytes"] < none_none["gpu_bytes"]
    assert none_none["cpu_bytes"] < none_cpu["cpu_bytes"]
    assert nvme["nvme_bytes"] > 0 and nvme["cpu_bytes"] < cpu_cpu["cpu_bytes"]
    two = estimate_zero2_model_states_mem_needs_all_cold(1e9, num_gpus_per_node=8)
    assert two[0]["cpu_bytes"] == int(1.5 * deepspeed.plan(
        1e9, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}, stage=2,
        offload_optimizer="cpu", offload_param="none", gpus=8,
        largest_group=1)["configured"]["host_bytes_per_node"])
    assert two[0]["cpu_bytes"] > 12 * 1e9  # fp32 master, m and v of a billion parameters


def test_deepspeed_engine_is_strata_engine_under_its_name():
    """`from deepspeed.runtime.engine import DeepSpeedEngine` for isinstance tests."""
    from strata.runtime.engine import DeepSpeedEngine
    from models import ds_config, make_model
    engine, _, _, _ = deepspeed.initialize(model=make_model("mlp"), config=ds_config(1))
    assert isinstance(engine, DeepSpeedEngine)
    engine.close()


def test_the_configs_log_level_sets_deepspeeds_logger_as_deepspeed_does():
    """"log_level": "info" lowers DeepSpeed's logger (its engine calls set_log_level_from_string),
    so log_dist(..., ranks=[0]) prints; an unknown level is DeepSpeed's ValueError."""
    import torch
    from models import ds_config, make_model
    kept = logger.level
    try:
        engine, _, _, _ = deepspeed.initialize(model=make_model("mlp"),
                                               config=dict(ds_config(0), log_level="info"))
        assert logger.getEffectiveLevel() == logging.INFO
        engine.close()
        # read by the checker: no "unknown key" warning, and --strict passes
        check = deepspeed.check_config({"train_micro_batch_size_per_gpu": 2, "log_level": "info"},
                                       strict=True)
        assert check["ok"] and not check["warnings"], check["warnings"]
        with pytest.raises(ValueError, match="loud is not one of the valid logging levels"):
            deepspeed.initialize(model=make_model("mlp"), config=dict(ds_config(0),
                                                                      log_level="loud"))
    finally:
        logger.setLevel(kept)
