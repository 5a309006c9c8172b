"""transformers' own ZeRO-3 load on strata: strata's HfDeepSpeedConfig kept alive makes
transformers' from_pretrained build the model under zero.Init (hf_zero3_init_worker.py, a script
as transformers' non-Trainer DeepSpeed docs write it), gathering through `import deepspeed`,
which gives strata (strata.register_as_deepspeed). Compared with the same script loading the
whole model: every parameter partitioned at load, each rank holding its share, and the same
losses and final weights, on one and two processes, after resize_token_embeddings, and with a
PEFT adapter whose modules_to_save copies a partitioned head. The name itself: deepspeed's
submodules are strata's module objects, a missing one is named, an imported DeepSpeed is refused
by the explicit call and left alone by the implicit one."""
import importlib.metadata
import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from test_hf_trainer import tiny_llama  # noqa: E402  (skips below the integration's transformers)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "hf_zero3_init_worker.py")
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                "stage3_param_persistence_threshold": 0}}


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    tiny_llama().save_pretrained(d)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path, name, model_dir, *argv, world=1):
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps(CONFIG))
    out = tmp_path / f"{name}.pt"
    argv = [str(out), str(model_dir), str(cfg), *map(str, argv)]
    if world == 1:
        p = subprocess.run([sys.executable, WORKER, *argv], env=_env(), capture_output=True,
                           text=True, timeout=240)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    else:
        from launch import launch
        d = tmp_path / name
        d.mkdir()
        with pytest.MonkeyPatch.context() as mp:  # torch.distributed from the launcher's env
            mp.setenv("MASTER_ADDR", "127.0.0.1")
            mp.setenv("MASTER_PORT", str(_free_port()))
            outs = launch(d, "hf_zero3_init_worker.py", lambda r, nvme: argv, world=world)
        for rc, text in outs:
            assert rc == 0, text[-6000:]
    return torch.load(out)


def assert_same_weights(got, ref, atol=0.0):
    assert got["state"].keys() == ref["state"].keys()
    for k, v in ref["state"].items():
        torch.testing.assert_close(got["state"][k], v, rtol=0, atol=atol, msg=k)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, model_dir):
    return run(tmp_path_factory.mktemp("whole"), "whole", model_dir, "--whole")


def test_from_pretrained_builds_partitioned_and_trains_as_the_whole_model(tmp_path, model_dir,
                                                                         whole):
    got = run(tmp_path, "hf", model_dir)
    assert got["partitioned"] and not whole["partitioned"]
    assert got["held"] == got["total"] == whole["total"]  # one rank holds every element
    assert got["loss"] == whole["loss"]
    assert_same_weights(got, whole)


def test_two_processes_each_hold_their_share(tmp_path, model_dir, whole):
    """Each rank keeps its part of every module from the moment it is built (rank 0 reads the
    checkpoint and the module's parameters are gathered one module at a time); the run equals
    one process on the same batches (the ranks see the same data: the mean gradient is the
    same, and the weights agree to the rounding of the reduction)."""
    got = run(tmp_path, "hf2", model_dir, world=2)
    assert got["partitioned"]
    assert 0 < got["held"] < got["total"] * 0.6  # rank 0's share, not the model
    assert got["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert_same_weights(got, whole, atol=1e-6)


def test_resize_token_embeddings_gathers_through_import_deepspeed(tmp_path, model_dir):
    ref = run(tmp_path, "whole-resized", model_dir, "--whole", "--resize", 72)
    got = run(tmp_path, "hf-resized", model_dir, "--resize", 72)
    assert got["partitioned"] and not ref["partitioned"]
    assert got["vocab"] == ref["vocab"] == 72
    assert got["state"]["model.embed_tokens.weight"].shape[0] == 72
    assert got["loss"] == ref["loss"]
    assert_same_weights(got, ref)


def test_peft_modules_to_save_copies_the_partitioned_head(tmp_path, model_dir):
    ref = run(tmp_path, "whole-peft", model_dir, "--whole", "--peft")
    got = run(tmp_path, "hf-peft", model_dir, "--peft")
    assert got["partitioned"] and not ref["partitioned"]
    assert got["loss"] == ref["loss"]
    assert_same_weights(got, ref)


def test_deepspeed_chats_lora_takes_the_partitioned_weights(tmp_path, model_dir):
    """DeepSpeed-Chat's step-1 pattern after the partitioned load: resize the embeddings, then
    swap each decoder Linear for its own LoRA layer holding the (partitioned) weight, found by
    dotted name with strata.compression.helper; only the LoRA weights train."""
    ref = run(tmp_path, "whole-dschat", model_dir, "--whole", "--resize", 72, "--dschat-lora")
    got = run(tmp_path, "hf-dschat", model_dir, "--resize", 72, "--dschat-lora")
    assert got["partitioned"] and not ref["partitioned"]
    assert got["loss"] == ref["loss"]
    assert_same_weights(got, ref)
    from safetensors.torch import load_file
    saved = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"  # frozen under its LoRA layer
    assert torch.equal(got["state"][name], saved[name])
    assert any(k.endswith("lora_left_weight") for k in got["state"])


def _python(code):
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_the_deepspeed_name():
    out = _python("""
import importlib.metadata, sys, types
import strata
assert strata.register_as_deepspeed() is True
import deepspeed, deepspeed.comm
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
import strata.zero, strata.comm, strata.accelerator
assert deepspeed is strata and deepspeed.zero is strata.zero and deepspeed.comm is strata.comm
assert get_accelerator is strata.accelerator.get_accelerator
assert ZeroParamStatus is strata.zero.ZeroParamStatus
import importlib.util
assert importlib.util.find_spec("deepspeed.ops.op_builder") is None  # a probe gets None
try:
    import deepspeed.ops.op_builder
except ModuleNotFoundError as e:
    assert e.name == "deepspeed.ops.op_builder", e
else:
    raise AssertionError("deepspeed.ops.op_builder imported")
try:  # the metadata still says what is installed
    importlib.metadata.version("deepspeed")
    print("installed")
except importlib.metadata.PackageNotFoundError:
    print("not installed")
""")
    try:
        importlib.metadata.version("deepspeed")
        here = "installed"
    except importlib.metadata.PackageNotFoundError:
        here = "not installed"
    assert out.strip() == here
    _python("""
import sys, types
sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # DeepSpeed imported first
import strata
assert strata.register_as_deepspeed(required=False) is False
try:
    strata.register_as_deepspeed()
except RuntimeError as e:
    assert "DeepSpeed is already imported" in str(e), e
else:
    raise AssertionError("no error")
""")


def test_an_installed_deepspeed_keeps_its_name_unless_the_script_asks(tmp_path):
    """DeepSpeed installed (a stand-in package with its metadata on the path): strata's implicit
    users (zero.Init, strata's TrainingArguments at stage 3) leave it the name, the arguments
    setting no hook (a warning says so) so that transformers never partitions with DeepSpeed's
    zero.Init; strata's HfDeepSpeedConfig, an explicit request, takes the name."""
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    (site / "deepspeed-0.19.8.dist-info").mkdir()
    (site / "deepspeed-0.19.8.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    code = f"""
import json, logging, sys
sys.path.insert(0, {str(site)!r})
import strata
from strata.deepspeed_name import installed_elsewhere, is_registered
from strata.integrations.transformers import HfDeepSpeedConfig, TrainingArguments
from transformers.integrations import is_deepspeed_zero3_enabled
assert installed_elsewhere() and strata.register_as_deepspeed(required=False) is False
cfg = {json.dumps(CONFIG)!r}
args = TrainingArguments(output_dir={str(tmp_path / "out")!r}, deepspeed=json.loads(cfg),
                         report_to=[], use_cpu=True)
assert args._strata_hf_config is None and not is_deepspeed_zero3_enabled()
assert not is_registered()
keep = HfDeepSpeedConfig(cfg)
assert is_registered() and is_deepspeed_zero3_enabled()
import deepspeed
assert deepspeed is strata and not hasattr(deepspeed, "REAL")
"""
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "DeepSpeed is installed" in p.stderr and "left unset" in p.stderr


def test_hf_config_reads_what_transformers_reads_and_says_what_is_wrong(tmp_path):
    out = _python(f"""
import json
from strata.integrations.transformers import HfDeepSpeedConfig
from transformers.integrations import is_deepspeed_zero3_enabled, deepspeed_config
cfg = {json.dumps(CONFIG)!r}
keep = HfDeepSpeedConfig(cfg)  # JSON text
assert is_deepspeed_zero3_enabled() and deepspeed_config()["zero_optimization"]["stage"] == 3
assert keep.is_offload() and keep.get_value("optimizer.params.lr") == 1e-2
del keep
assert not is_deepspeed_zero3_enabled()  # only while it is alive
try:
    HfDeepSpeedConfig("no/such/file.json")
except ValueError as e:
    print(e)
""")
    assert "HfDeepSpeedConfig(config_file_or_dict): expected a path" in out
