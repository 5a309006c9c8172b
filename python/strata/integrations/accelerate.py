"""accelerate's `Accelerator` with a DeepSpeed plugin, trained by strata.

A script written for accelerate with DeepSpeed (`Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))`,
or the plugin accelerate builds from `ACCELERATE_USE_DEEPSPEED` and the `ACCELERATE_DEEPSPEED_*`
variables) changes one import:

    from strata.integrations.accelerate import Accelerator   # was: from accelerate import Accelerator

(and `DummyOptim` / `DummyScheduler` from here too, where the script imports them: accelerate.utils
exports them only where deepspeed is installed)
and `accelerator.prepare(model, optimizer, dataloader, scheduler)` returns a strata engine in the
DeepSpeed engine's place. The rest is accelerate's own DeepSpeed path: the plugin's "auto" values
filled as accelerate fills them, `DummyOptim` / `DummyScheduler`, `accelerator.backward` (the
engine's backward, and its step at each accumulation boundary), `accumulate`, `clip_grad_norm_`
(the norm the engine clipped with), `save_state` / `load_state` (the engine's checkpoint beside
accelerate's RNG, scheduler and sampler states), `get_state_dict` / `save_model`.
`accelerator.distributed_type` is `DistributedType.DEEPSPEED` and `accelerator.state.deepspeed_plugin`
the plugin, as under DeepSpeed; torch.distributed and the data sharding are accelerate's own
(gloo on the CPU, NCCL on GPUs). `docs/python.md` lists what differs.
"""
import contextlib
import copy
import logging
import os
import sys
import types
from typing import Optional

import accelerate
import torch
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType, DynamoBackend
from accelerate.utils.other import compile_regions_deepspeed
# accelerate.utils exports these only where deepspeed is installed; scripts import them from here.
from accelerate.utils.deepspeed import (DeepSpeedEngineWrapper, DeepSpeedOptimizerWrapper,
                                        DeepSpeedSchedulerWrapper, DummyOptim, DummyScheduler)

from ..engine import StrataEngine, init_distributed, initialize
from ._autos import HIDDEN_SIZE_KEYS, hidden_size_values

# accelerate's Accelerator imports these wrappers only where deepspeed is installed, and its
# save_state / load_state name DeepSpeedSchedulerWrapper under DistributedType.DEEPSPEED: the
# same classes, where its own import did not put them.
for _name, _cls in (("DeepSpeedEngineWrapper", DeepSpeedEngineWrapper),
                    ("DeepSpeedOptimizerWrapper", DeepSpeedOptimizerWrapper),
                    ("DeepSpeedSchedulerWrapper", DeepSpeedSchedulerWrapper),
                    ("DummyOptim", DummyOptim), ("DummyScheduler", DummyScheduler)):
    vars(accelerate.accelerator).setdefault(_name, _cls)



def _one_plugin(deepspeed_plugin, deepspeed_plugins) -> Optional[DeepSpeedPlugin]:
    """The run's DeepSpeedPlugin: the one given, or accelerate's from its environment."""
    if deepspeed_plugin is not None and deepspeed_plugins is not None:
        raise ValueError("You cannot pass in both `deepspeed_plugins` and `deepspeed_plugin`.")
    plugin = deepspeed_plugin if deepspeed_plugin is not None else deepspeed_plugins
    if isinstance(plugin, dict):
        if len(plugin) != 1:
            raise NotImplementedError(
                f"strata Accelerator: {len(plugin)} DeepSpeed plugins "
                f"({', '.join(map(str, plugin))}); strata trains one model per Accelerator: "
                "pass one plugin")
        plugin = next(iter(plugin.values()))
    if plugin is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        plugin = DeepSpeedPlugin()  # as accelerate builds it from `accelerate launch`'s variables
    if plugin is not None and not isinstance(plugin, DeepSpeedPlugin):
        raise TypeError("`deepspeed_plugin` must be a DeepSpeedPlugin object.")
    return plugin


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _transport_view(transport):
    """A later Accelerator in the process is built while the shared state shows the transport
    (MULTI_CPU, MULTI_GPU, NO) that accelerate set up, not DEEPSPEED: accelerate would otherwise
    reach for deepspeed as for a second DeepSpeed Accelerator."""
    if transport is None:
        yield
        return
    for shared in (AcceleratorState._shared_state, PartialState._shared_state):
        shared["distributed_type"] = transport
    try:
        yield
    finally:
        for shared in (AcceleratorState._shared_state, PartialState._shared_state):
            shared["distributed_type"] = DistributedType.DEEPSPEED


def compile_engine(engine, dynamo) -> None:
    """What accelerate does with a DeepSpeed engine for a TorchDynamoPlugin whose backend is set:
    engine.compile(backend, the plugin's kwargs), or its regional compilation of the engine's
    module; nothing for backend NO (or no plugin)."""
    if dynamo is None or dynamo.backend == DynamoBackend.NO:
        return
    compile_kwargs = dynamo.to_kwargs()
    if dynamo.use_regional_compilation:
        compile_regions_deepspeed(engine.module, **compile_kwargs)
    else:
        engine.compile(backend=compile_kwargs.pop("backend"), compile_kwargs=compile_kwargs)


class Accelerator(accelerate.Accelerator):
    """accelerate.Accelerator whose DeepSpeed plugin runs on strata (module docstring). Without
    a plugin (none given, ACCELERATE_USE_DEEPSPEED unset) it is accelerate's Accelerator."""

    def __init__(self, *args, deepspeed_plugin=None, deepspeed_plugins=None,
                 mixed_precision=None, **kwargs):
        plugin = _one_plugin(deepspeed_plugin, deepspeed_plugins)
        transport = AcceleratorState._shared_state.get("_strata_transport")
        if plugin is None and transport is not None:
            plugin = AcceleratorState._shared_state["deepspeed_plugins"]  # an earlier one's
        self._strata_plugin = plugin
        if plugin is None:
            super().__init__(*args, mixed_precision=mixed_precision, **kwargs)
            return
        for other in ("fsdp_plugin", "megatron_lm_plugin"):
            if kwargs.get(other) is not None:
                raise ValueError(f"strata Accelerator: a DeepSpeed plugin and {other} together")
        if mixed_precision is None:
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        mixed_precision = str(mixed_precision).lower()
        if mixed_precision not in ("no", "fp16", "bf16"):
            raise NotImplementedError(f"strata Accelerator: mixed_precision={mixed_precision!r}: "
                                      "strata trains in fp32, fp16 or bf16")
        # accelerate itself takes no part in DeepSpeed here: it starts torch.distributed as for
        # any multi-process run (its DeepSpeed path would import deepspeed for that), and the
        # precision is the engine's, through the plugin's config, as under DeepSpeed.
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and "cpu" not in kwargs and not torch.cuda.is_available():
            # Several processes on a machine without a GPU: accelerate's DeepSpeed path starts
            # their group whatever the device; its plain path would see one process unless told
            # the run is on the CPU.
            kwargs["cpu"] = True
        with _env("ACCELERATE_USE_DEEPSPEED", "false"), _transport_view(transport):
            super().__init__(*args, mixed_precision="no", **kwargs)
        if transport is None:
            AcceleratorState._shared_state["_strata_transport"] = self.state.distributed_type
        if not torch.distributed.is_initialized():
            # One process without a launcher: a group of one, as DeepSpeed's initialize starts
            # (accelerate's gather, reduce and barriers then run as under DeepSpeed).
            init_distributed(dist_backend="gloo" if self.device.type == "cpu" else None)
        if torch.distributed.get_world_size() != self.num_processes:
            hint = ("pass cpu=True (or ACCELERATE_USE_CPU=true) on a machine without a GPU"
                    if launched > 1 and not torch.cuda.is_available() else
                    "start the processes with a launcher that sets RANK, WORLD_SIZE and "
                    "LOCAL_RANK for accelerate (torchrun, offloadctl launch)")
            raise RuntimeError(
                f"strata Accelerator: accelerate sees {self.num_processes} process(es), "
                f"torch.distributed {torch.distributed.get_world_size()} (WORLD_SIZE "
                f"{launched}): each process would load every batch; {hint}")
        plugin.set_mixed_precision(mixed_precision)
        # transformers' zero.Init hook, as accelerate sets it when it selects the plugin, with
        # strata's HfDeepSpeedConfig (also what plugin.zero3_init_context_manager calls).
        plugin.set_deepspeed_weakref = types.MethodType(_set_deepspeed_weakref, plugin)
        plugin.set_deepspeed_weakref()
        plugin._set_selected(True)
        state = self.state
        state.distributed_type = DistributedType.DEEPSPEED
        state.deepspeed_plugins = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED  # as accelerate
        self.deepspeed_engine_wrapped = None

    # prepare() dispatches here under DistributedType.DEEPSPEED, as for DeepSpeed's engine.
    def _prepare_deepspeed(self, *args):
        plugin = self.state.deepspeed_plugin
        result = [self._prepare_one(obj, first_pass=True)
                  if isinstance(obj, torch.utils.data.DataLoader) else obj for obj in args]
        model, optimizer, scheduler = _find_parts(result)
        self._fill_autos(plugin, args, model, optimizer, scheduler)
        if model is None:
            return tuple(result)
        _check_parts(plugin.deepspeed_config, optimizer, scheduler)
        if self.deepspeed_engine_wrapped is not None:
            raise RuntimeError("strata Accelerator: a second model; strata trains one model per "
                               "Accelerator (create another process for another model)")

        # The engine trains where accelerate puts the batches (its device; cpu=True keeps a
        # GPU machine's run on the host).
        kwargs = dict(model=model, config=self.deepspeed_config, device=str(self.device))
        client_scheduler = None
        if isinstance(optimizer, DummyOptim):
            kwargs["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable:
                kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif optimizer is not None:
            # accelerate swaps an offloaded torch Adam(W) for DeepSpeedCPUAdam; the engine runs
            # its own Adam on the client's param groups wherever the states live.
            kwargs["optimizer"] = optimizer
            if scheduler is not None and not isinstance(scheduler, DummyScheduler):
                client_scheduler = scheduler  # stepped by the script, on the client's groups
        engine, engine_optimizer, _, engine_scheduler = initialize(**kwargs)
        compile_engine(engine, self.state.dynamo_plugin)

        wrapped_optimizer = None
        if optimizer is not None:
            wrapped_optimizer = DeepSpeedOptimizerWrapper(engine_optimizer)
        wrapped_scheduler = None
        if client_scheduler is not None:
            wrapped_scheduler = AcceleratedScheduler(
                client_scheduler, wrapped_optimizer,
                step_with_optimizer=self.step_scheduler_with_optimizer,
                split_batches=self.split_batches)
        elif scheduler is not None:
            wrapped_scheduler = DeepSpeedSchedulerWrapper(engine_scheduler, wrapped_optimizer)
        for i, obj in enumerate(result):
            if obj is model:
                result[i] = engine
            elif obj is optimizer:
                result[i] = wrapped_optimizer
            elif obj is scheduler:
                result[i] = wrapped_scheduler
        self.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
        self._models.append(engine)
        if wrapped_optimizer is not None:
            self._optimizers.append(wrapped_optimizer)
        if wrapped_scheduler is not None:
            self._schedulers.append(wrapped_scheduler)
        return tuple(result)

    def _fill_autos(self, plugin, args, model, optimizer, scheduler) -> None:
        """The plugin's "auto" values, as accelerate's DeepSpeed path fills them: batch sizes
        from the dataloaders, accumulation from the Accelerator (or the config's, which then
        wins), clipping 1.0, bucket sizes from the model's hidden size, the DummyOptim's and
        DummyScheduler's values."""
        loaders = [obj for obj in args if isinstance(obj, torch.utils.data.DataLoader)]
        if plugin.is_auto("train_micro_batch_size_per_gpu"):
            sizes = [getattr(dl, "batch_size", None) for dl in loaders]
            if not sizes or any(bs is None for bs in sizes):
                raise ValueError(
                    "strata Accelerator: \"train_micro_batch_size_per_gpu\" is \"auto\" in the "
                    "DeepSpeed config and no dataloader with an integer batch_size was passed to "
                    "prepare(); give a number in the config or pass the dataloader")
            if self.split_batches:
                sizes = [bs // self.num_processes for bs in sizes]
            micro = min(sizes) if plugin.is_train_batch_min else max(sizes)
        else:
            micro = plugin.get_value("train_micro_batch_size_per_gpu")
        plugin.fill_match("gradient_accumulation_steps", must_match=False,
                          gradient_accumulation_steps=self.gradient_accumulation_steps)
        gas = plugin.get_value("gradient_accumulation_steps")
        if gas != self.gradient_accumulation_steps:
            # The config's, as accelerate takes it, with its warning.
            logging.getLogger("strata").warning(
                "Gradient accumulation steps mismatch: GradientAccumulationPlugin has %d, "
                "DeepSpeed config has %d. Using DeepSpeed's value.",
                self.gradient_accumulation_steps, gas)
            self.gradient_accumulation_steps = gas
        values = {"gradient_clipping": 1.0,
                  "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
        if micro is not None:
            values["train_micro_batch_size_per_gpu"] = micro
            values["train_batch_size"] = micro * gas * self.num_processes
        if model is None:
            return
        if any(plugin.is_auto(k) for k in HIDDEN_SIZE_KEYS):
            values.update(hidden_size_values(_hidden_size(model)))
        if isinstance(optimizer, DummyOptim):
            values.update({"optimizer.params.lr": optimizer.lr,
                           "optimizer.params.weight_decay": optimizer.weight_decay})
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            opt = scheduler.optimizer
            max_lr = (getattr(opt, "lr", None) if getattr(opt, "defaults", None) is None
                      else opt.defaults["lr"])
            values.update({"scheduler.params.warmup_min_lr": 0,
                           "scheduler.params.warmup_max_lr": max_lr,
                           "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps)})
            if scheduler.total_num_steps is not None:
                total = scheduler.total_num_steps
                values["scheduler.params.total_num_steps"] = (
                    total if self.split_batches else -(-total // self.num_processes))
        plugin.deepspeed_config_process(must_match=False, **values)
        self.deepspeed_config = plugin.deepspeed_config

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, StrataEngine):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model, unwrap=True):
        """As under DeepSpeed: at stage 3 the 16-bit weights gathered, on the main process only
        (None elsewhere), if the config's stage3_gather_16bit_weights_on_model_save allows;
        below stage 3 a copy of the module's on every process."""
        if not isinstance(model, StrataEngine):
            return super().get_state_dict(model, unwrap)
        if model.zero_optimization_partition_weights() and \
                not model.zero_gather_16bit_weights_on_model_save():
            raise ValueError(
                "Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` "
                "in DeepSpeed config is False. To save the model weights in 16bit, set "
                "`stage3_gather_16bit_weights_on_model_save` to True in DeepSpeed config file or "
                "set `zero3_save_16bit_model` to True when using `accelerate config`. To save the "
                "full checkpoint, use `accelerator.save_state(dir)` (the engine's checkpoint).")
        return model._zero3_consolidated_16bit_state_dict(
            all_ranks=not model.zero_optimization_partition_weights())


def _set_deepspeed_weakref(plugin) -> None:
    """DeepSpeedPlugin.set_deepspeed_weakref with strata's HfDeepSpeedConfig (transformers' own
    needs the deepspeed package): the plugin's config, its unresolved batch sizes and
    accumulation set as accelerate sets them, made what transformers' from_pretrained consults,
    so that a model built after the Accelerator at ZeRO stage 3 is partitioned as it is
    constructed. Unlike accelerate 1.16's, it honours zero3_init_flag: off (or
    zero3_init_context_manager(enable=False)), models load whole and prepare() partitions them."""
    plugin.dschf = None
    if "transformers" in sys.modules:  # accelerate unsets the previous one first, too
        import transformers.integrations.deepspeed as hf_deepspeed
        hf_deepspeed.unset_hf_deepspeed_config()
    if not plugin.zero3_init_flag:
        return
    from .transformers import zero3_hook
    config = copy.deepcopy(plugin.deepspeed_config)
    for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
        if config.get(key, "auto") == "auto":
            config[key] = 1
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]
    plugin.dschf = zero3_hook(config, "strata Accelerator")  # kept alive by the plugin


def _find_parts(objs):
    """The model, optimizer and scheduler among prepare()'s arguments, as accelerate finds them."""
    model = optimizer = scheduler = None
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            model = obj
        elif isinstance(obj, (torch.optim.Optimizer, DummyOptim)):
            optimizer = obj
        elif isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler)):
            scheduler = obj
    return model, optimizer, scheduler


def _check_parts(config: dict, optimizer, scheduler) -> None:
    """accelerate's rules for an optimizer / scheduler in the config and in the code."""
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise ValueError("You cannot specify an optimizer in the config file and in the code "
                             "at the same time. Please remove the optimizer from the config file "
                             "or create `accelerate.utils.DummyOptim` in the code.")
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise ValueError("You cannot create a `DummyOptim` without specifying an optimizer "
                             "in the config file.")
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise ValueError("You cannot specify a scheduler in the config file and in the code "
                             "at the same time. Please remove the scheduler from the config file "
                             "or create `accelerate.utils.DummyScheduler` in the code.")
        if "scheduler" not in config and isinstance(scheduler, DummyScheduler) \
                and scheduler.lr_scheduler_callable is None:
            raise ValueError("Either specify a scheduler in the config file or pass in the "
                             "`lr_scheduler_callable` parameter when using "
                             "`accelerate.utils.DummyScheduler`.")
    if isinstance(optimizer, DummyOptim) and scheduler is not None \
            and not isinstance(scheduler, DummyScheduler):
        raise ValueError("You can only specify `accelerate.utils.DummyScheduler` in the code when "
                         "using `accelerate.utils.DummyOptim`.")


def _hidden_size(model) -> int:
    config = getattr(model, "config", None)
    why = ("so the \"auto\" bucket sizes of the DeepSpeed config cannot be filled; give them "
           "numbers")
    if config is None:
        raise ValueError(f"strata Accelerator: the model has no `config`, {why}")
    if getattr(config, "hidden_size", None) is not None:
        return int(config.hidden_size)
    if getattr(config, "hidden_sizes", None):
        return int(max(config.hidden_sizes))
    raise ValueError(f"strata Accelerator: the model's config has neither hidden_size nor "
                     f"hidden_sizes, {why}")


__all__ = ["Accelerator", "AcceleratorState", "DeepSpeedPlugin", "DummyOptim", "DummyScheduler"]
