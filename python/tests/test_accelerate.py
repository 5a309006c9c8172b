"""strata.integrations.accelerate: an accelerate script with a DeepSpeed plugin
(accelerate_worker.py, written as accelerate's users write them) trained through strata against
the same script on accelerate's own Accelerator without DeepSpeed (torch AdamW; DDP on two
processes): the same losses, learning rates, gradient norms and final weights (fp32, the
tolerances of test_hf_trainer), at stages 1-3 with the optimizer and parameters offloaded,
with the plugin from the code or from accelerate's environment, DummyOptim / DummyScheduler,
a PEFT LoRA model, save_state / load_state, save_pretrained, and two processes."""
import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from strata.integrations import accelerate as sa  # noqa: E402
from strata.integrations.accelerate import DeepSpeedPlugin, DummyOptim, DummyScheduler  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LOSS_RTOL = 1e-4
WEIGHT_ATOL = 1e-5


def config(stage, offload_optimizer="none", offload_param="none", nvme=None, **extra):
    """A config as accelerate's docs write them: "auto" wherever accelerate fills a value."""
    zero = {"stage": stage, "reduce_bucket_size": "auto"}
    if nvme is not None:
        os.makedirs(nvme, exist_ok=True)
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_gather_16bit_weights_on_model_save=True)
    for key, dev in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if dev != "none":
            zero[key] = {"device": dev, **({"nvme_path": str(nvme)} if dev == "nvme" else {})}
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
           "bf16": {"enabled": "auto"}}
    cfg.update(extra)
    return cfg


def write(tmp_path, cfg, name="ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def run(tmp_path, name, *argv):
    out = tmp_path / f"{name}.pt"
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, os.path.join(HERE, "accelerate_worker.py"), str(out),
                        *map(str, argv)], env=e, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return {**torch.load(out), "stderr": p.stderr}


def assert_same_run(got, ref, weights=True):
    assert got["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
    assert got["lr"] == pytest.approx(ref["lr"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
    if weights:
        assert got["state"].keys() == ref["state"].keys()
        for k, v in ref["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=0, atol=WEIGHT_ATOL, msg=k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref"), "ref")


@pytest.mark.parametrize("stage,opt,param", [(2, "cpu", "none"), (3, "nvme", "cpu")])
def test_matches_accelerate_without_deepspeed(tmp_path, reference, stage, opt, param):
    cfg = write(tmp_path, config(stage, opt, param, nvme=tmp_path / "nvme"))
    got = run(tmp_path, "strata", "--strata", cfg, "--save-model", tmp_path / "model")
    assert got["distributed_type"] == "DEEPSPEED" and got["mixed_precision"] == "no"
    assert got["bf16"] is False and "state_error" not in got
    assert_same_run(got, reference)
    assert reference["distributed_type"] == "NO"
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "model" / "model.safetensors"))  # accelerator.save_model
    for k, v in saved.items():
        torch.testing.assert_close(v, got["state"][k], rtol=0, atol=0, msg=k)
    # a tied head is saved once, as accelerate's save_model saves shared tensors
    assert set(got["state"]) - set(saved) <= {"lm_head.weight"}


def test_plugin_from_accelerates_environment(tmp_path, reference):
    """`accelerate launch --use_deepspeed --deepspeed_config_file` sets these variables; the
    Accelerator builds its plugin from them as accelerate's does."""
    got = run(tmp_path, "env", "--env", write(tmp_path, config(1)))
    assert got["distributed_type"] == "DEEPSPEED"
    assert_same_run(got, reference)


def test_bf16_from_mixed_precision(tmp_path, reference):
    """mixed_precision="bf16" enables the config's "auto" bf16 section: the engine trains bf16
    parameters with fp32 master weights (losses near the fp32 run's)."""
    got = run(tmp_path, "bf16", "--strata", write(tmp_path, config(2, "cpu")),
              "--mixed-precision", "bf16")
    assert got["mixed_precision"] == "bf16" and got["bf16"] is True
    assert got["loss"] == pytest.approx(reference["loss"], rel=3e-2)


def test_accumulation_of_the_config_wins_with_accelerates_warning(tmp_path):
    """The Accelerator's gradient_accumulation_steps (2) against the config's (4): the config's,
    with accelerate's warning, as its DeepSpeed path does."""
    cfg = config(2)
    cfg["gradient_accumulation_steps"] = 4
    got = run(tmp_path, "gas", "--strata", write(tmp_path, cfg), "--steps", 1)
    assert got["gas"] == 4
    assert ("Gradient accumulation steps mismatch: GradientAccumulationPlugin has 2, DeepSpeed "
            "config has 4. Using DeepSpeed's value.") in got["stderr"]


def test_stage3_state_dict_needs_the_gather_flag(tmp_path):
    cfg = config(3)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    got = run(tmp_path, "nogather", "--strata", write(tmp_path, cfg), "--steps", 1,
              "--second-accelerator")
    assert "stage3_gather_16bit_weights_on_model_save" in got["state_error"]
    assert got["second"] == ("DEEPSPEED", True, "DEEPSPEED")  # a later Accelerator() shares it
    assert "a second model" in got["second_model"]


def test_from_pretrained_after_the_accelerator_loads_partitioned(tmp_path, reference):
    """As under accelerate with DeepSpeed: at stage 3 the Accelerator sets transformers' zero.Init
    hook (strata's HfDeepSpeedConfig), so transformers' from_pretrained after it builds the model
    partitioned (every parameter empty when it returns) and prepare() trains it as the
    reference; with zero3_init_flag=False it loads whole."""
    from test_hf_trainer import tiny_llama
    tiny_llama().save_pretrained(tmp_path / "m")
    cfg = write(tmp_path, config(3, "cpu"))
    got = run(tmp_path, "z3", "--strata", cfg, "--from-pretrained", tmp_path / "m")
    assert got["partitioned_at_load"] is True
    assert_same_run(got, reference)
    whole = run(tmp_path, "z3off", "--strata", cfg, "--from-pretrained", tmp_path / "m",
                "--no-zero3-init", "--steps", 1)
    assert whole["partitioned_at_load"] is False


def test_dummy_optimizer_and_scheduler(tmp_path, reference):
    """The config's AdamW ("auto" lr and weight decay from DummyOptim), DummyScheduler's
    callable building the schedule on the engine's optimizer."""
    cfg = config(3, "cpu", optimizer={"type": "AdamW", "params": {"lr": "auto",
                                                                   "weight_decay": "auto"}})
    got = run(tmp_path, "dummy", "--strata", write(tmp_path, cfg), "--dummy")
    assert_same_run(got, reference)


def test_lora_matches_and_save_pretrained_round_trips(tmp_path):
    ref = run(tmp_path, "ref-lora", "--lora")
    saved = tmp_path / "saved"
    got = run(tmp_path, "lora", "--strata", write(tmp_path, config(3, "cpu", "cpu")), "--lora",
              "--save-pretrained", saved)
    assert_same_run(got, ref)
    files = os.listdir(saved)
    assert "adapter_model.safetensors" in files, files
    import peft
    from safetensors.torch import load_file
    adapter = load_file(str(saved / "adapter_model.safetensors"))
    lora = {k: v for k, v in got["state"].items() if "lora_" in k}
    assert len(adapter) == len(lora) > 0
    base = peft.PeftModel.from_pretrained(
        __import__("test_hf_trainer").tiny_llama(), str(saved))
    loaded = {k: v for k, v in base.state_dict().items() if "lora_" in k}
    for k, v in lora.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0, msg=k)


def test_save_state_and_load_state_resume_as_uninterrupted(tmp_path):
    cfg = write(tmp_path, config(3, "cpu", nvme=tmp_path / "nvme"))
    whole = run(tmp_path, "whole", "--strata", cfg, "--save-state-at", 3,
                "--state-dir", tmp_path / "state")
    assert "pytorch_model" in os.listdir(tmp_path / "state")  # the engine's checkpoint
    resumed = run(tmp_path, "resumed", "--strata", cfg, "--save-state-at", 3,
                  "--resume-from", tmp_path / "state")
    micro = 3 * 2
    assert resumed["loss"] == pytest.approx(whole["loss"][micro:], rel=1e-6)
    assert resumed["lr"] == pytest.approx(whole["lr"][3:], rel=1e-9)
    for k, v in whole["state"].items():
        torch.testing.assert_close(resumed["state"][k], v, rtol=0, atol=1e-6, msg=k)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two(tmp_path, name, extra):
    from launch import launch
    d = tmp_path / name
    d.mkdir()
    env = dict(os.environ)
    os.environ["MASTER_PORT"] = str(_free_port())  # accelerate's gloo group
    try:
        res = launch(d, "accelerate_worker.py", lambda r, nvme: [d / "out.pt", *extra], world=2)
    finally:
        os.environ.clear()
        os.environ.update(env)
    for rc, text in res:
        assert rc == 0, text[-6000:]
    return torch.load(d / "out.pt")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _launch_two(tmp_path_factory.mktemp("ddp"), "ddp", [])


@pytest.mark.parametrize("stage", [1, 3])
def test_two_processes_match_ddp(tmp_path, ddp, stage):
    """Two processes against accelerate's DDP on the same two shards of the data: at stage 1
    accumulate() holds the reduction back through the engine's no_sync, at stage 3 the engine
    reduce-scatters every micro-step."""
    got = _launch_two(tmp_path, "strata", ["--strata", write(tmp_path, config(stage, "cpu"))])
    assert got["distributed_type"] == "DEEPSPEED"
    assert ddp["distributed_type"] == "MULTI_CPU"
    assert_same_run(got, ddp)
    micro = len(ddp["loss"])
    assert ddp["no_sync_calls"] == micro // 2
    assert got["no_sync_calls"] == (micro // 2 if stage < 2 else 0)


def test_two_processes_without_cpu_argument_on_a_machine_without_a_gpu(tmp_path, ddp):
    """A script written for GPUs (no cpu=True) launched on two processes of a machine without
    one: as under accelerate's DeepSpeed path the two form one group (accelerate's plain path
    would see one process each, and each would load every batch)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: accelerate uses it without cpu=True")
    got = _launch_two(tmp_path, "strata", ["--strata", write(tmp_path, config(3, "cpu")),
                                            "--no-cpu-arg"])
    assert got["distributed_type"] == "DEEPSPEED"
    assert_same_run(got, ddp)


def test_refusals_name_the_problem():
    a, b = DeepSpeedPlugin(hf_ds_config=config(2)), DeepSpeedPlugin(hf_ds_config=config(3))
    with pytest.raises(NotImplementedError, match="2 DeepSpeed plugins"):
        sa._one_plugin(None, {"a": a, "b": b})
    assert sa._one_plugin(None, {"a": a}) is a
    with pytest.raises(ValueError, match="both"):
        sa._one_plugin(a, {"a": a})
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="optimizer in the config file and in the code"):
        sa._check_parts({"optimizer": {"type": "AdamW"}}, opt, None)
    with pytest.raises(ValueError, match="DummyOptim` without specifying an optimizer"):
        sa._check_parts({}, DummyOptim(model.parameters()), None)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ValueError, match="scheduler in the config file and in the code"):
        sa._check_parts({"scheduler": {"type": "WarmupLR"}}, opt, sched)
    with pytest.raises(ValueError, match="lr_scheduler_callable"):
        dummy = DummyOptim(model.parameters())
        sa._check_parts({"optimizer": {"type": "AdamW"}}, dummy, DummyScheduler(dummy))
    with pytest.raises(ValueError, match="no `config`"):
        sa._hidden_size(model)
