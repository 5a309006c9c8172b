"""Hugging Face Trainer on strata: `from strata.integrations.transformers import Trainer,
TrainingArguments` in place of transformers' is the one change a Trainer script needs.

TrainingArguments(deepspeed=<DeepSpeed config: a path, JSON text or a dict>, ...) takes the
config out of `deepspeed` before transformers' __post_init__ sees it (which would otherwise set up
DeepSpeed) and keeps it as `args.strata_config`; the real `deepspeed` package is neither needed
nor touched. Without `deepspeed=`, under `accelerate launch` with a DeepSpeed config
(ACCELERATE_USE_DEEPSPEED), the launcher's config is taken, as transformers' arguments take it. Trainer then builds a strata engine (strata.initialize) where transformers builds
DeepSpeed's:
  - "auto" values are resolved from the TrainingArguments as transformers does for DeepSpeed
    (resolve_auto: HfTrainerDeepSpeedConfig.trainer_config_process / trainer_config_finalize);
    a value that is not "auto" and differs from the arguments is an error listing every one.
  - the optimizer: the config's "optimizer" section, or else the Trainer's own (create_optimizer:
    AdamW with its decay / no-decay groups), run inside the engine; the schedule: the config's
    "scheduler" section, or else the Trainer's (create_scheduler, built on the engine's
    optimizer) which engine.step() steps after each applied step. The Trainer's own
    optimizer.step() / lr_scheduler.step() calls are no-ops; the learning rate and grad norm it
    logs are the engine's (clipping is the engine's, from gradient_clipping).
  - training_step computes the loss as transformers does (compute_loss, the same scaling for
    gradient accumulation), then engine.backward(loss, scale_wrt_gas=False) (the micro-steps'
    gradients summed, as transformers asks of DeepSpeed) and engine.step() (applied at the
    accumulation boundary the Trainer chose).
  - evaluate() runs the model under no_grad through the engine's hooks (stage 3 gathers per
    module); save_model() writes a from_pretrained-loadable model from the engine's fp32 master
    weights (cast to each parameter's dtype before strata.initialize); checkpoints (save_steps)
    hold engine.save_checkpoint's files in checkpoint-N/ next to transformers' trainer_state.json
    and rng state, and train(resume_from_checkpoint=...) restores them with engine.load_checkpoint.
At ZeRO stage 3 the arguments also set transformers' zero.Init hook while they live
(HfDeepSpeedConfig, as transformers' arguments set DeepSpeed's): a model that transformers'
from_pretrained loads after them is built partitioned. HfDeepSpeedConfig itself serves scripts
that use transformers' hook without the Trainer.
torch_compile (torch_compile_backend / _mode) compiles the engine's module as accelerate does
DeepSpeed's (engine.compile).
Refused, naming the option: fsdp, fp16_full_eval / bf16_full_eval,
auto_find_batch_size, several GPUs in one process (DataParallel), an optimizer strata does not run
(args.optim other than the AdamW / Adam ones when the config has no "optimizer" section).
Needs transformers >= 5.3 (MIN_TRANSFORMERS_VERSION: the Trainer methods it overrides, checked
when a Trainer with a strata config is built); tested with 5.3.0, 5.5.4, 5.10.4, 5.17.0 and 5.25
(it overrides private Trainer methods: see docs/python.md).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import transformers
import transformers.integrations.deepspeed as _hf_deepspeed
from accelerate.utils.deepspeed import HfDeepSpeedConfig as _AccelerateHfDeepSpeedConfig

from ..config import ConfigError, check_config, load_config, zero_stage
from .._strata import StrataError
from ..deepspeed_name import installed_elsewhere, register_as_deepspeed
from ..engine import nvme_dirs_in_use, start_distributed
from ._autos import HIDDEN_SIZE_KEYS, hidden_size_values

logger = logging.getLogger(__name__)

__all__ = ["Trainer", "TrainingArguments", "HfDeepSpeedConfig", "from_pretrained", "resolve_auto",
           "with_strata", "MIN_TRANSFORMERS_VERSION", "unsupported_reason"]

# The first transformers with the Trainer methods the strata Trainer overrides to put its engine
# where DeepSpeed's goes (5.0 - 5.2 build DeepSpeed inline in _inner_training_loop).
MIN_TRANSFORMERS_VERSION = "5.3.0"
_TRAINER_HOOKS = ("_prepare_for_training", "_clip_grad_norm", "_get_grad_norm",
                  "_get_learning_rate", "_save_optimizer_and_scheduler",
                  "_load_optimizer_and_scheduler", "_load_from_checkpoint", "_load_best_model")


def unsupported_reason() -> Optional[str]:
    """None when the installed transformers has every Trainer method the strata Trainer
    overrides (a feature check, not a version comparison); else why not, naming the minimum
    version."""
    missing = [m for m in _TRAINER_HOOKS if not hasattr(transformers.Trainer, m)]
    if not missing:
        return None
    return (f"strata's Trainer needs transformers >= {MIN_TRANSFORMERS_VERSION}: the installed "
            f"transformers {transformers.__version__} has no "
            f"Trainer.{', Trainer.'.join(missing)} "
            f"(pip install 'transformers>={MIN_TRANSFORMERS_VERSION}')")


# -- "auto" values (transformers/integrations/deepspeed.py: HfTrainerDeepSpeedConfig) ----------
def _node(config: dict, key: str):
    """(the dict holding the last part of the dotted key, the last part); (None, part) when a
    parent is missing (find_config_node)."""
    *parents, last = key.split(".")
    for p in parents:
        config = config.get(p) if isinstance(config, dict) else None
        if config is None:
            return None, last
    return config, last


def _get(config: dict, key: str, default=None):
    node, last = _node(config, key)
    return default if node is None else node.get(last, default)


def _hidden_size(model) -> Optional[int]:
    """The model's hidden size where transformers looks for it (trainer_config_finalize)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    if hasattr(cfg, "hidden_size"):
        return cfg.hidden_size
    if hasattr(cfg, "hidden_sizes"):
        return max(cfg.hidden_sizes)
    text = getattr(cfg, "text_config", None)
    if text is not None and hasattr(text, "hidden_size"):
        return text.hidden_size
    if text is not None and hasattr(text, "hidden_sizes"):
        return max(text.hidden_sizes)
    return None


def _autos_left(obj, path="") -> list:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _autos_left(v, f"{path}.{k}" if path else k)]
    return [path] if obj == "auto" else []


def accelerate_plugin_values() -> dict:
    """What accelerate's DeepSpeedPlugin puts in a config's "auto" ZeRO keys when built with no
    arguments (as TrainingArguments builds it): its defaults, or the ACCELERATE_DEEPSPEED_*
    variables `accelerate launch` sets."""
    env = os.environ.get
    return {
        "zero_optimization.stage": int(env("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2)),
        "zero_optimization.offload_optimizer.device":
            env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
        "zero_optimization.offload_param.device":
            env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none"),
        "zero_optimization.offload_optimizer.nvme_path":
            env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", "none"),
        "zero_optimization.offload_param.nvme_path":
            env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "none"),
        "zero_optimization.stage3_gather_16bit_weights_on_model_save":
            env("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() == "true",
    }


def resolve_auto(config: dict, args, model, num_training_steps: int, world_size: int) -> dict:
    """The DeepSpeed config with its "auto" values filled from the TrainingArguments, exactly as
    transformers fills them for DeepSpeed (trainer_config_process, accelerate's DeepSpeedPlugin,
    then trainer_config_finalize);
    returns a new dict. A value that is not "auto" and differs from the arguments' is a mismatch;
    ValueError lists every one (transformers' message), and names any "auto" left over that
    DeepSpeed would not drop (a key transformers does not fill outside DeepSpeed's config-model
    sections)."""
    cfg = copy.deepcopy(dict(config))
    mismatches = []

    def fill(key, hf_val, hf_key=None, must_match=True):
        node, last = _node(cfg, key)
        if node is None:
            return
        if node.get(last) == "auto":
            node[last] = hf_val
            return
        if not must_match:
            return
        ds_val = node.get(last)
        if ds_val is not None and ds_val != hf_val:
            mismatches.append(f"- ds {key}={ds_val} vs hf {hf_key}={hf_val}")

    auto_bs = bool(getattr(args, "auto_find_batch_size", False))
    # trainer_config_process
    train_batch_size = world_size * args.per_device_train_batch_size * \
        args.gradient_accumulation_steps
    fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size,
         "per_device_train_batch_size", not auto_bs)
    fill("gradient_accumulation_steps", args.gradient_accumulation_steps,
         "gradient_accumulation_steps")
    fill("train_batch_size", train_batch_size, "train_batch_size (calculated)", not auto_bs)
    fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill("scheduler.params.warmup_min_lr", 0, must_match=False)
    fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if getattr(args, "save_on_each_node", False):
        cfg.setdefault("checkpoint", {})["use_node_local_storage"] = args.save_on_each_node
    fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    # The DeepSpeedPlugin(hf_ds_config=...) TrainingArguments then builds fills its own keys
    # (accelerate's defaults or ACCELERATE_DEEPSPEED_* variables) where still "auto".
    for key, value in accelerate_plugin_values().items():
        fill(key, value, must_match=False)
    # trainer_config_finalize
    autos = [k for k in HIDDEN_SIZE_KEYS if _get(cfg, k) == "auto"]
    if autos:
        h = _hidden_size(model)
        if h is None:
            raise ValueError(
                "The model's config file has neither `hidden_size` nor `hidden_sizes` entry, "
                "therefore it's not possible to automatically fill out the following `auto` "
                f"entries in the DeepSpeed config file: {autos}. You can fix that by replacing "
                "`auto` values for these keys with an integer value of your choice.")
        stage3 = _get(cfg, "zero_optimization.stage", -1) == 3
        for key, value in hidden_size_values(h).items():
            if stage3 or key == "zero_optimization.reduce_bucket_size":  # the rest: stage 3's
                fill(key, value, must_match=False)
    fill("scheduler.params.total_num_steps", num_training_steps,
         "num_training_steps (calculated)")
    fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
         "warmup_steps")
    if mismatches:
        raise ValueError(
            "Please correct the following DeepSpeed config values that mismatch "
            "TrainingArguments values:\n" + "\n".join(mismatches) +
            "\nThe easiest method is to set these DeepSpeed config values to 'auto'.")
    # What transformers and accelerate leave, DeepSpeed's initialize drops in its config-model
    # sections (zero_optimization.sub_group_size: "auto" takes the default); elsewhere it would
    # use the string itself.
    checked = check_config(cfg, trainer_fills_auto=False)
    left = checked["unresolved_auto"] if checked["ok"] else _autos_left(cfg)
    if left:
        raise ValueError(f"DeepSpeed config: \"auto\" is not resolved for {', '.join(left)} "
                         "(transformers fills only the keys it knows); give a value")
    return cfg


def _read_config(value, what: str = "TrainingArguments(deepspeed=...)") -> dict:
    """The `deepspeed` argument as a dict: a dict (copied), a file path, JSON text, or base64 of
    JSON text (what transformers accepts); `what` names the argument in the error."""
    if isinstance(value, dict):
        return copy.deepcopy(value)
    try:
        return load_config(value)  # strata's one reading rule (config.py): comments taken
    except ConfigError as e:  # read, and invalid: its errors, naming the file
        raise ValueError(f"{what}: {e}") from e
    except (OSError, TypeError, ValueError, StrataError) as e:
        raise ValueError(f"{what}: expected a path to an existing config file, a dict, JSON "
                         f"text or base64 JSON; got {value!r}") from e


def _is_zero3(config: Optional[dict]) -> bool:
    return config is not None and zero_stage(config) == 3


# -- transformers' ZeRO-3 hook: from_pretrained under zero.Init ----------------------------------
class HfDeepSpeedConfig(_AccelerateHfDeepSpeedConfig):
    """transformers.integrations.HfDeepSpeedConfig for a strata run (transformers' own refuses to
    be built without the deepspeed package). Kept alive, it is what transformers consults
    (is_deepspeed_zero3_enabled, deepspeed_config): at ZeRO stage 3 every model transformers
    builds from then on (from_pretrained, from_config) is built under zero.Init and partitioned
    as it is constructed, rank 0's checkpoint values written into each module's parameters
    gathered one module at a time, and resize_token_embeddings, weight initialisation and PEFT
    gather as they do under DeepSpeed. transformers' code imports `deepspeed` for that: it gets
    strata (strata.register_as_deepspeed), and a RuntimeError says so where DeepSpeed itself
    was imported first.

        dschf = HfDeepSpeedConfig(ds_config)   # keep this object alive
        model = AutoModelForCausalLM.from_pretrained(path)
        engine, *_ = strata.initialize(model=model, config=ds_config)

    config_file_or_dict: a dict (copied), a path, JSON text or base64 JSON, as transformers'."""

    def __init__(self, config_file_or_dict):
        config = _read_config(config_file_or_dict, "HfDeepSpeedConfig(config_file_or_dict)")
        super().__init__(config)
        if self.is_zero3():
            register_as_deepspeed()
            # transformers' ZeRO-3 load asks torch.distributed for the rank: started here as
            # DeepSpeed's zero.Init starts it.
            start_distributed("strata HfDeepSpeedConfig")
        _hf_deepspeed.set_hf_deepspeed_config(self)


def zero3_hook(config: Optional[dict], who: str) -> Optional[HfDeepSpeedConfig]:
    """The hook strata's TrainingArguments and Accelerator set at stage 3 (None below it or
    without a config). Where
    DeepSpeed itself is installed and strata does not yet stand in for it, transformers would
    partition with DeepSpeed's zero.Init: no hook then (a warning says so), and models load
    whole until strata.initialize partitions them; HfDeepSpeedConfig, or
    strata.register_as_deepspeed() first, takes the name explicitly."""
    if not _is_zero3(config):
        return None
    if installed_elsewhere():
        logger.warning("%s: DeepSpeed is installed, so transformers' from_pretrained would "
                       "partition with it: its ZeRO-3 hook is left unset and models load whole "
                       "(strata.initialize partitions them). strata.register_as_deepspeed() "
                       "before this makes `import deepspeed` give strata and sets the hook", who)
        return None
    return HfDeepSpeedConfig(config)


# -- loading a pretrained model partitioned ------------------------------------------------------
def _safetensors_files(path: str) -> dict:
    """{file: [tensor names]} of a save_pretrained directory (one file or an index of shards)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files: dict = {}
        for name, file in weight_map.items():
            files.setdefault(os.path.join(path, file), []).append(name)
        return files
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"strata from_pretrained: {path} has neither model.safetensors nor "
                                "model.safetensors.index.json (save_pretrained with safetensors)")
    from safetensors import safe_open
    with safe_open(single, "pt") as f:
        return {single: list(f.keys())}


def _read_range(f, name: str, begin: int, end: int) -> torch.Tensor:
    """Elements [begin, end) of tensor `name` (flattened) as fp32, reading only the rows that
    hold them."""
    sl = f.get_slice(name)
    shape = sl.get_shape()
    if len(shape) == 0:
        return f.get_tensor(name).reshape(-1)[begin:end].float()
    row = 1
    for d in shape[1:]:
        row *= d
    r0, r1 = begin // row, -(-end // row)
    return sl[r0:r1].reshape(-1)[begin - r0 * row:end - r0 * row].float()


@contextlib.contextmanager
def _zero3_hook_for(cfg: dict):
    """transformers' ZeRO-3 hook (strata's HfDeepSpeedConfig for `cfg`) for the block, the
    hook set before it (or none) restored after."""
    kept = _hf_deepspeed._hf_deepspeed_config_weak_ref
    hook = HfDeepSpeedConfig(cfg)
    try:
        yield hook
    finally:
        _hf_deepspeed._hf_deepspeed_config_weak_ref = kept


def from_pretrained(model_class, path: str, config, **kwargs):
    """model_class.from_pretrained(path) for a strata run. At ZeRO stage 3 no rank holds the
    whole model: it is built as transformers builds it under DeepSpeed's ZeRO-3 hook
    (HfDeepSpeedConfig): under zero.Init, each module's parameters partitioned as its
    construction ends and initialised gathered, one module at a time. Then each rank reads from
    the directory's safetensors files only the element ranges it keeps. Files whose tensor
    names are not the model's (a checkpoint in an older layout that transformers renames or
    converts on load: ViT's attention names, BERT's LayerNorm gamma/beta) are loaded by
    transformers' own from_pretrained under the hook instead, as DeepSpeed's users load them
    (rank 0 reads each file and writes each module's parameters gathered). Below stage 3, or
    with a config that is None, it is model_class.from_pretrained(path, **kwargs).
    model_class: a model class or an Auto class (AutoModelForCausalLM); config: the DeepSpeed
    config (a path, JSON text or a dict) or strata's TrainingArguments; kwargs go to the
    model's config (AutoConfig.from_pretrained). Parameters the files lack keep their
    initialisation (a new head), listed in one warning."""
    if isinstance(config, TrainingArguments):
        config = config.strata_config
    cfg = None if config is None else _read_config(config)
    if not _is_zero3(cfg):
        return model_class.from_pretrained(path, **kwargs)
    hf_config = transformers.AutoConfig.from_pretrained(path, **kwargs)
    build = getattr(model_class, "from_config", None) or model_class._from_config
    files = _safetensors_files(path)
    if installed_elsewhere():
        # transformers' hook would partition with DeepSpeed itself (zero3_hook): strata's
        # zero.Init alone, and the files' names as they are.
        from .. import zero
        with zero.Init(config=cfg):
            model = build(hf_config)
        unknown = _unknown_names(model, files)
        if unknown:
            logger.warning("strata from_pretrained(%s): DeepSpeed is installed, so transformers' "
                           "conversion of older tensor names is not used; not in the model, "
                           "ignored: %s", path, unknown)
    else:
        with _zero3_hook_for(cfg):
            model = build(hf_config)
            unknown = _unknown_names(model, files)
            if unknown:  # transformers' renaming and conversions apply: its own load
                del model
                logger.info("strata from_pretrained(%s): the files name %d tensor(s) the model "
                            "does not (%s): loaded by transformers' from_pretrained under the "
                            "ZeRO-3 hook", path, len(unknown), ", ".join(unknown[:3]))
                model = model_class.from_pretrained(path, **kwargs)
                model.eval()
                return model
    _read_partitioned(model, files)
    missing = sorted(set(dict(model.named_parameters())) -
                     {n for names in files.values() for n in names})
    if missing:
        logger.warning("strata from_pretrained(%s): not in the files, left as initialised: %s",
                       path, missing)
    model.eval()
    return model


def _unknown_names(model, files: dict) -> list:
    """The files' tensor names the model's state_dict lacks (tied aliases included there)."""
    keys = set(model.state_dict().keys())
    return sorted(n for names in files.values() for n in names if n not in keys)


def _read_partitioned(model, files: dict) -> None:
    """Each rank's element ranges of the model's parameters, and the buffers, from `files`
    (_safetensors_files); names the model lacks are skipped (_unknown_names). A tied
    parameter named twice in the files (the embedding and the head) is read under each name:
    the same values."""
    named = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    from safetensors import safe_open
    for file, names in files.items():
        with safe_open(file, "pt") as f:
            for name in names:
                p = named.get(name)
                with torch.no_grad():
                    if p is None:
                        if name in buffers:
                            buffers[name].copy_(f.get_tensor(name))
                        continue
                    part = getattr(p, "_strata_part", None)
                    if part is None:  # not partitioned (a class defined inside the block)
                        p.copy_(f.get_tensor(name))
                    else:
                        part.shard = _read_range(f, name, part.begin, part.end).contiguous()


# -- the arguments -------------------------------------------------------------------------------
def _launched_with_deepspeed() -> bool:
    """`accelerate launch` with a DeepSpeed config (--use_deepspeed, or an accelerate config
    file's distributed_type DEEPSPEED) sets ACCELERATE_USE_DEEPSPEED for the script."""
    from accelerate.utils import str_to_bool
    return bool(str_to_bool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false")))


def _launcher_config() -> dict:
    """The DeepSpeed config `accelerate launch` passes, as transformers' arguments take it:
    accelerate's DeepSpeedPlugin built from the environment (ACCELERATE_DEEPSPEED_CONFIG_FILE,
    or the ACCELERATE_DEEPSPEED_* / ACCELERATE_GRADIENT_* values it builds one from, refused by
    accelerate where both are given)."""
    from accelerate.utils import DeepSpeedPlugin
    return DeepSpeedPlugin().deepspeed_config


def _with_mixed_precision(config: dict, mixed_precision: str) -> dict:
    """`config` (a copy) with the arguments' precision applied as accelerate applies it to every
    DeepSpeed run of the Trainer (AcceleratorState: DeepSpeedPlugin.set_mixed_precision, run
    here on the config itself): bf16=True adds {"bf16": {"enabled": true}} where the config has
    no "bf16" section, fp16=True {"fp16": {"enabled": true, "auto_cast": true}}; an "auto"
    enabled takes the arguments' value; and a precision the config enables for the other dtype
    is accelerate's ValueError. Without this a short config ({"zero_optimization": ...}) under
    bf16=True (TRL's configs' default) would train in fp32, where DeepSpeed trains in bf16."""
    import functools
    import types
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    hf = HfDeepSpeedConfig(config)  # a deep copy
    plugin = types.SimpleNamespace(hf_ds_config=hf, deepspeed_config=hf.config)
    plugin.fill_match = functools.partial(DeepSpeedPlugin.fill_match, plugin)
    DeepSpeedPlugin.set_mixed_precision(plugin, mixed_precision)
    return hf.config


def _mixed_precision(args) -> str:
    """The arguments' precision as accelerate names it ("fp16", "bf16" or "no")."""
    mp = getattr(args, "mixed_precision", None)
    if isinstance(mp, str):
        return mp
    return "fp16" if args.fp16 else "bf16" if args.bf16 else "no"


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments whose `deepspeed` config is run by strata: it is moved to
    `strata_config` (a dict, "auto" values still unresolved) before transformers' __post_init__,
    which then sees no DeepSpeed. Options strata cannot honour are refused here, naming them."""

    def __post_init__(self):
        raw = self.deepspeed
        self.deepspeed = None
        # `accelerate launch` with a DeepSpeed config: transformers' arguments take that config
        # where `deepspeed` is unset, and so do these.
        from_launcher = raw is None and _launched_with_deepspeed()
        refused = [
            ("fsdp", bool(self.fsdp), "FSDP shards the model itself; use the config's ZeRO stage"),
            ("fp16_full_eval", self.fp16_full_eval, "it casts the model, whose parameters are "
             "the engine's"),
            ("bf16_full_eval", self.bf16_full_eval, "it casts the model, whose parameters are "
             "the engine's"),
            ("auto_find_batch_size", self.auto_find_batch_size, "not supported with strata"),
        ]
        if raw is not None or from_launcher:
            for name, on, why in refused:
                if on:
                    raise ValueError(f"TrainingArguments({name}=...) with a strata config: {why}")
            # transformers and accelerate would set DeepSpeed itself up from the launcher's
            # variable: strata runs the config instead, for the rest of the process.
            os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
        super().__post_init__()
        if from_launcher:
            raw = _launcher_config()
        self.strata_config = None if raw is None else _with_mixed_precision(
            _read_config(raw), _mixed_precision(self))
        # As transformers' arguments set up HfTrainerDeepSpeedConfig: at stage 3 a model built
        # after them (from_pretrained) is partitioned as it is constructed, while they live.
        self._strata_hf_config = zero3_hook(self.strata_config, "strata TrainingArguments")


# -- what the Trainer sees of the engine's optimizer and schedule --------------------------------
class _EngineStepped:
    """The Trainer's self.optimizer / self.lr_scheduler: the engine's, with step() a no-op (the
    engine steps both at engine.step()); everything else passes through."""

    def __init__(self, inner, engine):
        self.__dict__["_inner"] = inner
        self.__dict__["_engine"] = engine

    def step(self, *args, **kwargs):
        return None

    def get_last_lr(self):
        return self._engine.get_lr()

    def __getattr__(self, name):
        return getattr(self.__dict__["_inner"], name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["_inner"], name, value)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def frozen_config(config: dict, args, model: torch.nn.Module, name: str = "reference") -> dict:
    """The DeepSpeed config of the engine of a frozen model (a reference, teacher or reward
    model) named `name`: the run's, "auto" values resolved from the arguments, without the
    optimizer and scheduler sections (nothing of it trains) and the monitors. Its NVMe swap files go to a
    `strata-<name>` directory inside each nvme_path (created): the policy's engine holds the
    rank's swap file in the nvme_path itself, and each frozen model's engine its own. Where an
    open engine of this process uses that directory already (the trainer a notebook cell made
    before, still referenced while its replacement is built), `strata-<name>-2`, -3, ..."""
    # Without the optimizer and scheduler, and the monitors (the policy's engine writes them).
    dropped = ("optimizer", "scheduler", "tensorboard", "csv_monitor", "wandb", "comet")
    cfg = resolve_auto({k: v for k, v in config.items() if k not in dropped},
                       args, model, num_training_steps=1, world_size=args.world_size)  # a copy
    zero = cfg.get("zero_optimization", {})
    in_use = nvme_dirs_in_use()
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("nvme_path"):
            paths = section["nvme_path"]
            several = isinstance(paths, (list, tuple))
            moved = [_free_dir(os.fspath(p), f"strata-{name}", in_use)
                     for p in (paths if several else [paths])]
            for path in moved:
                os.makedirs(path, exist_ok=True)
            section["nvme_path"] = moved if several else moved[0]
    return cfg


def _free_dir(base: str, name: str, in_use: set) -> str:
    """<base>/<name>, or <base>/<name>-<k> for the first k from 2 whose directory no open
    engine of this process uses (in_use: real paths). The names are those `offloadctl clean`
    looks into (nvme/leftovers.h IsEngineDirName: strata- and lowercase letters, digits, -)."""
    if not re.fullmatch(r"strata-[a-z0-9-]+", name):
        raise ValueError(f"frozen engine directory {name!r}: strata-[a-z0-9-]+ only")
    path, k = os.path.join(base, name), 1
    while os.path.realpath(path) in in_use:
        k += 1
        path = os.path.join(base, f"{name}-{k}")
    return path


def _still_zero_init(model: torch.nn.Module) -> bool:
    """Whether some of the model's parameters are still zero.Init's partitions (partitioned at
    construction, in no engine yet)."""
    return any(getattr(p, "_strata_part", None) is not None for p in model.parameters())


class Trainer(transformers.Trainer):
    """transformers.Trainer training through a strata engine when args.strata_config is set
    (strata.integrations.transformers.TrainingArguments(deepspeed=...)); without one it is
    transformers' Trainer unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.strata_engine = None
        self._strata_dtypes: dict = {}
        if self._strata_config() is not None:
            why = unsupported_reason()
            if why is not None:  # it would train without strata (no hook for the engine)
                raise RuntimeError(why)
        if self._strata_config() is not None and self.is_deepspeed_enabled:
            raise ValueError("strata Trainer: accelerate set up DeepSpeed (ACCELERATE_USE_DEEPSPEED "
                             "or an accelerate config); strata replaces it, unset that")
        if self._strata_config() is not None and self.args.save_only_model and \
                self.args.load_best_model_at_end:
            # transformers' rule for DeepSpeed: a model-only checkpoint has no engine state for
            # the best model to be loaded from.
            raise ValueError("strata can't be used with `save_only_model` along with "
                             "`load_best_model_at_end`.")

    def _strata_config(self):
        return getattr(getattr(self, "args", None), "strata_config", None)

    def _strata_constructed(self) -> None:
        """Called by with_strata's classes once the library's own __init__ has returned (it
        sets attributes after transformers' __init__ that a subclass may need to see)."""

    # -- the engine ------------------------------------------------------------------------
    def _strata_close(self) -> None:
        """Closes the engine of an earlier train() call, leaving the model's parameters with its
        last weights (stage 3 empties them: they are written back from the masters)."""
        engine = self.strata_engine
        if engine is None:
            return
        if not engine._closed:
            engine.close_keeping_weights()
        self.strata_engine = None

    @contextlib.contextmanager
    def _strata_borrowed(self, model: torch.nn.Module):
        """`model` (zero.Init's partitions, maybe beside whole parameters: a PEFT adapter's) in a
        forward-only engine inside the block; after it every parameter is as it was (its data,
        whole or zero.Init's partition, and its attributes; nothing trains, so the values are
        unchanged) for the engine that will train them."""
        import strata
        kept = {p: (p.data, dict(p.__dict__), p.requires_grad) for p in model.parameters()}
        model.requires_grad_(False)
        try:
            engine, _, _, _ = strata.initialize(
                model=model, config=frozen_config(self._strata_config(), self.args, model,
                                                  "precompute"), device=self.args.device)
            try:
                yield engine
            finally:
                engine.close()
        finally:
            for p, (data, attrs, trains) in kept.items():
                p.data = data
                p.__dict__.clear()
                p.__dict__.update(attrs)
                p.requires_grad_(trains)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Where transformers builds DeepSpeed's engine (max_steps known): the strata engine, its
        optimizer and schedule. Returns (the model, train_dataloader) as transformers does; the
        model is the Trainer's own (its modules carry the engine's hooks), self.model_wrapped
        the engine."""
        config = self._strata_config()
        if config is None:
            return super()._prepare_for_training(max_steps, train_dataloader,
                                                 resume_from_checkpoint)
        import strata
        if self.args.n_gpu > 1:
            raise ValueError("strata Trainer: several GPUs in one process (DataParallel, "
                             f"n_gpu={self.args.n_gpu}) are not supported; launch one process "
                             "per GPU (torchrun)")
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self._strata_close()
        model = self.model
        world = self.args.world_size
        cfg = resolve_auto(config, self.args, model, max_steps, world)
        if self.args.should_log:
            logger.info("strata: the DeepSpeed config with \"auto\" resolved:\n%s",
                        json.dumps(cfg, indent=2, sort_keys=True))
        check = check_config(cfg, world_size=world)
        if not check["ok"]:
            raise ConfigError("invalid DeepSpeed config:\n" +
                              "\n".join(e["text"] for e in check["errors"]))
        # Its warnings are logged by the engine (rank 0, once per process).
        optimizer = None
        if not cfg.get("optimizer"):
            if isinstance(self.optimizer, _EngineStepped):
                self.optimizer = None  # an earlier train() call's
            optimizer = self.create_optimizer()
        lr_scheduler = None
        if not cfg.get("scheduler"):
            if self.lr_scheduler is not None and not isinstance(self.lr_scheduler,
                                                                _EngineStepped):
                lr_scheduler = self.lr_scheduler  # the client's, on its optimizer
            else:
                def lr_scheduler(engine_optimizer, _steps=max_steps):
                    self.lr_scheduler = None
                    return self.create_scheduler(num_training_steps=_steps,
                                                 optimizer=engine_optimizer)
        self._strata_dtypes = {n: p.dtype for n, p in model.named_parameters()}
        try:
            engine, eopt, _, esched = strata.initialize(
                model=model, config=cfg, optimizer=optimizer, lr_scheduler=lr_scheduler,
                device=self.args.device)  # use_cpu keeps the stand-in on a GPU machine
        except TypeError as e:
            if optimizer is not None:
                raise ValueError(f"strata Trainer: optim={getattr(self.args.optim, 'value', self.args.optim)!r} is not supported "
                                 f"({e}); use an AdamW / Adam optim or give the config an "
                                 "\"optimizer\" section") from e
            raise
        self.strata_engine = engine
        self.model_wrapped = engine
        # torch_compile: as accelerate compiles DeepSpeed's engine for the Trainer's dynamo plugin
        # (engine.compile; the hooks run eagerly between the graphs).
        from .accelerate import compile_engine
        compile_engine(engine, getattr(self.accelerator.state, "dynamo_plugin", None))
        self._strata_route_accelerator()
        self.optimizer = _EngineStepped(eopt, engine)
        if isinstance(esched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            # lr_scheduler_type="reduce_lr_on_plateau": the Trainer steps it with the metric
            # after each evaluation (its isinstance check needs the scheduler itself); the
            # engine reads the lrs it writes and never steps it.
            self.lr_scheduler = esched
        else:
            self.lr_scheduler = _EngineStepped(
                esched if esched is not None else _ConstantLr(engine), engine)
        self._created_lr_scheduler = False

        if resume_from_checkpoint is not None:
            if not os.path.isfile(os.path.join(resume_from_checkpoint, "latest")):
                raise ValueError(f"Can't find a strata checkpoint at {resume_from_checkpoint} "
                                 "(no 'latest' file; a checkpoint saved with "
                                 "save_only_model=True holds the model alone and resumes no "
                                 "training state: start a new run from its weights instead)")
            logger.info(f"strata: resuming from {resume_from_checkpoint}")
            path, _ = engine.load_checkpoint(resume_from_checkpoint,
                                             load_module_strict=not _is_peft(self.model))
            if path is None:
                raise ValueError(f"strata: failed to resume from {resume_from_checkpoint}")
            self._load_deepspeed_trainer_scheduler(resume_from_checkpoint, path, esched)

        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    @staticmethod
    def _load_deepspeed_trainer_scheduler(checkpoint: str, path: str, scheduler) -> None:
        """A checkpoint DeepSpeed's Trainer wrote: the scheduler the Trainer created (its config
        had no "scheduler") is not in DeepSpeed's files but in the Trainer's scheduler.pt, which
        transformers loads after DeepSpeed's load; so does this (DeepSpeed's files gave the lr
        of the next step, the saved param_groups')."""
        from ..utils.deepspeed_checkpoint import is_deepspeed_checkpoint
        saved = os.path.join(checkpoint, "scheduler.pt")
        if (scheduler is None or not is_deepspeed_checkpoint(path) or not os.path.isfile(saved)
                or not hasattr(scheduler, "load_state_dict")
                or type(scheduler).__module__.startswith("strata")):
            return
        scheduler.load_state_dict(torch.load(saved, map_location="cpu", weights_only=True))

    def _strata_route_accelerator(self) -> None:
        """The Trainer's accelerator treats the engine as accelerate treats a DeepSpeed engine
        (code that bypasses training_step reaches it: TRL's generation unwraps
        trainer.model_wrapped, trl.experimental's OnlineDPOTrainer calls accelerator.backward):
        unwrap_model takes the engine to its module (for a PEFT model, the PeftModel, whose
        attributes the engine does not list), and backward runs the engine's backward and, at
        an accumulation boundary (sync_gradients), its step (DeepSpeedEngineWrapper.backward)."""
        acc = self.accelerator
        if getattr(acc.unwrap_model, "_strata_routes", False):
            return
        from ..engine import StrataEngine
        unwrap, backward = acc.unwrap_model, acc.backward

        def unwrap_model(model, *args, **kwargs):
            return unwrap(model.module if isinstance(model, StrataEngine) else model,
                          *args, **kwargs)

        def engine_backward(loss, **kwargs):
            engine = self.strata_engine
            if engine is None or engine._closed:
                return backward(loss, **kwargs)
            sync = bool(acc.sync_gradients)
            engine.set_gradient_accumulation_boundary(sync)
            engine.backward(loss, **kwargs)
            if sync:
                engine.step()

        unwrap_model._strata_routes = True
        acc.unwrap_model = unwrap_model
        acc.backward = engine_backward

    # -- a step ------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.strata_engine
        if engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        # transformers' scaling for gradient accumulation (Trainer.training_step); the
        # loss_is_scaled_for_ga override is newer than 5.18 (absent: None, the rule below)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        # The Trainer chose the boundary (the last micro-batch of an accumulation, or of the
        # epoch); scale_wrt_gas=False: the micro-steps' gradients summed, as transformers asks
        # of DeepSpeed.
        engine.set_gradient_accumulation_boundary(bool(self.accelerator.sync_gradients))
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model):
        if self.strata_engine is None:
            return super()._clip_grad_norm(model)
        return self.strata_engine.get_global_grad_norm()  # clipped by the engine

    def _get_grad_norm(self, model, grad_norm=None):
        if self.strata_engine is None:
            return super()._get_grad_norm(model, grad_norm)
        if grad_norm is None:
            grad_norm = self.strata_engine.get_global_grad_norm()
        return None if grad_norm is None else float(grad_norm)

    def _get_learning_rate(self):
        engine = self.strata_engine
        if engine is None:
            return super()._get_learning_rate()
        report = engine.last_step_report
        if report is not None:
            return float(report["lr"])  # the lr of the step just applied
        return float(engine.get_lr()[0])

    # -- saving --------------------------------------------------------------------------------
    def _strata_state_dict(self) -> dict:
        """The model's state_dict with the engine's fp32 master weights (each cast to the dtype
        the parameter had before strata.initialize); tied names share one tensor. Collective."""
        engine = self.strata_engine
        from ..engine import _tied_names
        masters = engine.read_master()
        tied = _tied_names(self.model)
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        out = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            src = k if k in masters else tied.get(k)
            if src in masters:
                if src in out:
                    out[k] = out[src]
                else:
                    out[k] = out[src] = masters[src].to(self._strata_dtypes.get(src, torch.float32))
            elif k not in params:
                out[k] = v.detach().cpu().clone()  # a buffer
        return {k: out[k] for k in self.model.state_dict(keep_vars=True) if k in out}

    def evaluation_loop(self, *args, **kwargs):
        """transformers' (evaluate, predict); at stage 3 before the first train() call, while the
        model is still zero.Init's partitions (from_pretrained after the arguments: the
        documented order), inside a forward-only engine, as transformers' DeepSpeed path builds
        an inference engine there. Before, the forward met the empty partitions."""
        if self.strata_engine is None and self._strata_config() is not None and \
                _still_zero_init(self.model):
            with self._strata_borrowed(self.model):
                return super().evaluation_loop(*args, **kwargs)
        with self._strata_compiled_once():
            return super().evaluation_loop(*args, **kwargs)

    @contextlib.contextmanager
    def _strata_compiled_once(self):
        """With torch_compile, the engine's module is compiled in place (_prepare_for_training):
        transformers' evaluation_loop would have accelerate compile it again and wrap it
        (prepare_model with the dynamo plugin), making the compiled wrapper the Trainer's
        model_wrapped in place of the engine. The plugin is off for the loop."""
        plugin = getattr(self.accelerator.state, "dynamo_plugin", None)
        if self.strata_engine is None or plugin is None:
            yield
            return
        from accelerate.utils import DynamoBackend
        kept, plugin.backend = plugin.backend, DynamoBackend.NO
        try:
            yield
        finally:
            plugin.backend = kept

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        if self.strata_engine is not None:
            state_dict = self._strata_state_dict()
        elif self._strata_config() is not None and _still_zero_init(self.model):
            # Before train(), the model still zero.Init's partitions: gathered whole for the
            # save (collective), else the file would hold their empty placeholders.
            from ..zero import GatheredParameters
            with GatheredParameters(list(self.model.parameters())):
                state_dict = {k: v.detach().cpu().clone()
                              for k, v in self.model.state_dict().items()}
        else:
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir if output_dir is not None else self.args.output_dir,
                   state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.strata_engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # The engine's checkpoint (weights, optimizer state, schedule, a client scheduler's
        # state_dict) in output_dir/global_step<N>/ and output_dir/latest. Collective. A PEFT
        # model's frozen base is left out, as transformers asks DeepSpeed (its resume and
        # _load_best_model load with load_module_strict=False, the base from the pretrained
        # weights the script loads).
        self.strata_engine.save_checkpoint(output_dir,
                                           exclude_frozen_parameters=_is_peft(self.model))

    def _load_optimizer_and_scheduler(self, checkpoint):
        if self.strata_engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        # engine.load_checkpoint restored them in _prepare_for_training

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self._strata_config() is not None and os.path.isfile(
                os.path.join(resume_from_checkpoint, "latest")):
            return  # the engine loads its checkpoint once it exists (_prepare_for_training)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if self.strata_engine is None:
            return super()._load_best_model()
        logger.info(f"Loading best model from {self.state.best_model_checkpoint} "
                    f"(score: {self.state.best_metric}).")
        path, _ = self.strata_engine.load_checkpoint(self.state.best_model_checkpoint,
                                                     load_module_strict=not _is_peft(self.model))
        if path is None:  # the run would go on from its last weights, not the best
            raise ValueError(f"strata Trainer: the best model's checkpoint "
                             f"{self.state.best_model_checkpoint} holds no engine state to load "
                             "(no `latest` in it)")


_made: dict = {}  # (the library's class, strata's Trainer class) -> with_strata's class


def with_strata(cls: type, strata_trainer: Optional[type] = None) -> type:
    """A Trainer or TrainingArguments subclass from another library (TRL's SFTTrainer / SFTConfig,
    ...) that trains through strata: the same class with strata's Trainer / TrainingArguments
    put between it and transformers' (its own methods run first and reach strata's through
    super(), as they would reach transformers'). Its arguments' `deepspeed` config is then
    strata's; without one both behave as the library's own. `strata_trainer`: a subclass of
    strata's Trainer to put there instead (strata.integrations.trl's). One class per class
    (asked again, the same one); strata's classes are returned as they are; anything else is a
    TypeError. The methods a `strata_trainer` names in `_strata_first` go before the library's
    own of that name, where it has one (they call the library's through `_strata_wraps`)."""
    if not isinstance(cls, type):
        raise TypeError(f"with_strata({cls!r}): not a class")
    if issubclass(cls, (Trainer, TrainingArguments)):
        return cls
    if issubclass(cls, transformers.Trainer):
        base, extra = strata_trainer or Trainer, {}
        if not issubclass(base, Trainer):
            raise TypeError(f"with_strata(strata_trainer={base!r}): not a subclass of "
                            "strata.integrations.transformers.Trainer")
    elif issubclass(cls, transformers.TrainingArguments):
        # Pickled (the Trainer saves its arguments in each checkpoint) as the library's class
        # and remade here on loading: the made class has no importable name of its own.
        base, extra = TrainingArguments, {"__reduce_ex__": _reduce_arguments}
    else:
        raise TypeError(f"with_strata({cls.__qualname__}): not a subclass of "
                        "transformers.Trainer or transformers.TrainingArguments")
    if (cls, base) in _made:
        return _made[cls, base]
    # Methods the strata Trainer puts before the library's own (it calls theirs itself).
    extra.update({name: base.__dict__[name] for name in getattr(base, "_strata_first", ())
                  if hasattr(cls, name)})
    made = type(cls.__name__, (cls, base), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": f"{cls.__module__}.{cls.__qualname__}, training through strata "
                   "(strata.integrations.transformers.with_strata).", **extra})
    if base is TrainingArguments:
        made = dataclass(made)
    else:
        made.__init__ = _constructed_after(made, cls.__init__)
    made._strata_wraps = cls
    _made[cls, base] = made
    return made


def _constructed_after(made: type, library_init):
    """made's __init__: the library's (its signature kept), then Trainer._strata_constructed."""
    @functools.wraps(library_init)
    def __init__(self, *args, **kwargs):
        super(made, self).__init__(*args, **kwargs)
        self._strata_constructed()
    return __init__


def _reduce_arguments(self, protocol):
    return _remake_arguments, (type(self)._strata_wraps, self.__dict__.copy())


def _remake_arguments(cls: type, state: dict):
    made = with_strata(cls)
    obj = made.__new__(made)
    obj.__dict__.update(state)
    return obj


class _ConstantLr:
    """The schedule when the engine has none (a config "optimizer" without "scheduler" cannot
    reach here: the Trainer's scheduler is then built on the engine's optimizer)."""

    def __init__(self, engine):
        self._engine = engine

    def get_last_lr(self):
        return self._engine.get_lr()

    def step(self, *a, **k):
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: Any) -> None:
        pass
