"""TRL's trainers on strata: `from strata.integrations.trl import SFTTrainer, SFTConfig` in place of
`from trl import ...` is the one change a TRL script needs (DPOTrainer / DPOConfig, GRPOTrainer /
GRPOConfig, RewardTrainer / RewardConfig and every other trainer and config of trl alike).

Each name is trl's class made by strata.integrations.transformers.with_strata: TRL's own methods
(its datasets, collators, losses and metrics, logging, model cards) run first and reach strata's
Trainer / TrainingArguments through super() where they would reach transformers'. The config's
`deepspeed` (a path, JSON text or a dict; or `accelerate launch`'s DeepSpeed config) is run by
strata.initialize exactly as for strata's Trainer (docs/python.md, "Hugging Face Trainer"); TRL
sees no DeepSpeed plugin, so its DeepSpeed-only workarounds (ZeRO-3 reentrant checkpointing for
PEFT, adapter dtypes) do not apply and are not needed. Without `deepspeed` the classes are trl's.

A frozen model the trainer holds beside the policy at ZeRO stage 3 runs in a forward-only
strata engine of its own, with the run's zero_optimization (its parameters partitioned, on the
CPU or NVMe where offload_param says so: its swap files in a `strata-<name>` directory of each
nvme_path), as DeepSpeed's run gets it from TRL's prepare_deepspeed: the reference model
(`ref_model`: DPO, KTO, RLOO, GRPO with beta > 0), the teacher (`teacher_model`: distillation),
and each reward model among GRPO's and RLOO's `reward_funcs` (named reference, teacher and
reward-<i>). That holds whether the script passed it whole or TRL or transformers built it
partitioned (from_pretrained after stage-3 arguments, or TRL loading it from a path). Its
parameters are frozen; it keeps no optimizer state. Below stage 3 it stays the torch module it
is. sync_ref_model (mixing the policy into the reference every ref_model_sync_steps) gathers
the reference with modifier_rank 0 at stage 3, as DeepSpeed's run does (the policy, only read,
without), and the reference's engine takes the mixed values.
With precompute_ref_log_probs and no reference model, the policy itself gets a forward-only
engine for TRL's precompute pass where it is still zero.Init's partitions then.

Two functions of TRL's are wrapped on import. trl.models.utils._unwrap_model_for_generation, which
TRL's online trainers enter around model.generate: with ds3_gather_for_generation (True by
default) the stage-3 policy's engine gathers every group for the block, as DeepSpeed's run
gathers the model there. And trl.trainer.utils.maybe_gather_lm_head_ctx, which its
fused LM head (SFT's default chunked_nll loss, DPO's log-probabilities) calls with `lm_head.weight`
in the forward and again in its autograd Function's backward, reading `ds_status` of what it is
given. In that backward the weight is what autograd unpacked from the tensors saved in the
forward, and under strata (whose saved-tensor hooks keep no pointer into a released buffer) that
is a plain tensor without DeepSpeed's attributes, not the Parameter: the wrapper passes on only
tensors that carry `ds_status`. A saved parameter that strata gives back in a backward is the
gathered one (or the unpacking fails, naming it), so there is nothing left to gather.
"""
from __future__ import annotations

import contextlib

import torch
import transformers
import trl
import trl.models.utils as _trl_model_utils
import trl.trainer.callbacks as _trl_callbacks
import trl.trainer.utils as _trl_utils

from ..config import zero_stage
from ..engine import open_engines_of
from .transformers import Trainer as _StrataTrainer
from .transformers import _still_zero_init, frozen_config, with_strata

__all__ = ["SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig", "GRPOTrainer", "GRPOConfig",
           "RLOOTrainer", "RLOOConfig", "RewardTrainer", "RewardConfig", "KTOTrainer", "KTOConfig",
           "DistillationTrainer", "DistillationConfig", "strata_class"]


def _passes_partitioned_only(gather):
    def maybe_gather_lm_head_ctx(*params):
        return gather(*(p for p in params if p is None or hasattr(p, "ds_status")))

    maybe_gather_lm_head_ctx.__doc__ = gather.__doc__
    maybe_gather_lm_head_ctx._strata_wraps = gather
    return maybe_gather_lm_head_ctx


_gather = getattr(_trl_utils, "maybe_gather_lm_head_ctx", None)
if _gather is not None and not hasattr(_gather, "_strata_wraps"):
    _trl_utils.maybe_gather_lm_head_ctx = _passes_partitioned_only(_gather)


def _gathers_for_generation(unwrap):
    """trl.models.utils._unwrap_model_for_generation, which TRL's online trainers (GRPO, RLOO,
    distillation, ...) enter around model.generate: with gather_deepspeed3_params (the config's
    ds3_gather_for_generation, True by default) DeepSpeed's run gathers the whole ZeRO-3 model
    once for the generation; TRL sees no DeepSpeed plugin under strata, so this does the same
    with the model's strata engine (every group gathered for the block; the per-module hooks
    then find their groups gathered, so a generated token costs no gather)."""
    @contextlib.contextmanager
    def _unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params=True,
                                     *args, **kwargs):
        with unwrap(model, accelerator, gather_deepspeed3_params, *args, **kwargs) as unwrapped:
            engine = _stage3_engine(unwrapped) if gather_deepspeed3_params else None
            if engine is None:
                yield unwrapped
                return
            with engine.gathered_parameters():
                yield unwrapped

    _unwrap_model_for_generation.__doc__ = unwrap.__doc__
    _unwrap_model_for_generation._strata_wraps = unwrap
    return _unwrap_model_for_generation


def _stage3_engine(model: torch.nn.Module):
    """The open stage-3 strata engine that holds the model's parameters, or None."""
    return next((e for e in open_engines_of(model) if not e._whole), None)


def _syncs_partitioned(sync):
    """trl.trainer.callbacks.SyncRefModelCallback.sync_target_model (sync_ref_model: every
    ref_model_sync_steps the reference becomes (1 - alpha) ref + alpha policy): DeepSpeed's run
    gathers both models there with modifier_rank 0 (rank 0 mixes, the others receive); TRL
    sees no DeepSpeed plugin under strata, and would mix the empty tensors stage-3 parameters
    are outside a gather, changing nothing. With a stage-3 strata engine on either model this
    gathers them through strata.zero.GatheredParameters, the reference with modifier_rank=0 as
    DeepSpeed's run does (the policy, only read, without), and the reference's engine takes
    the mixed values."""
    def sync_target_model(model, target_model, alpha):
        if _stage3_engine(model) is None and _stage3_engine(target_model) is None:
            return sync(model, target_model, alpha)
        from ..zero import GatheredParameters, _rank_world
        # The policy is only read: gathered without a modifier (nothing written back to it).
        with GatheredParameters(list(model.parameters())), \
                GatheredParameters(list(target_model.parameters()), modifier_rank=0):
            if _rank_world()[0] == 0:
                _trl_callbacks.SyncRefModelCallback._sync_target_model(model, target_model,
                                                                       alpha)

    sync_target_model.__doc__ = sync.__doc__
    sync_target_model._strata_wraps = sync
    return staticmethod(sync_target_model)


_sync = _trl_callbacks.SyncRefModelCallback.__dict__.get("sync_target_model")
if _sync is not None and not hasattr(_sync.__func__, "_strata_wraps"):
    _trl_callbacks.SyncRefModelCallback.sync_target_model = _syncs_partitioned(_sync.__func__)

_unwrap = getattr(_trl_model_utils, "_unwrap_model_for_generation", None)
if _unwrap is not None and not hasattr(_unwrap, "_strata_wraps"):
    _trl_model_utils._unwrap_model_for_generation = _gathers_for_generation(_unwrap)


# The trainer's attributes that hold a frozen model of its own, and the name each one's engine
# goes by (its swap files' directory in each nvme_path: strata-<name>).
_FROZEN_SLOTS = {"ref_model": "reference", "teacher_model": "teacher"}


class _Trainer(_StrataTrainer):
    """strata's Trainer under one of TRL's (module docstring): at stage 3 each frozen model the
    trainer holds gets a forward-only engine: a reference (`ref_model`) or teacher
    (`teacher_model`) model as it is assigned, wherever the trainer assigns it (TRL builds,
    prepares and uses a reference inside its own __init__), and the reward models among
    `reward_funcs` once TRL's __init__ has returned."""

    _strata_first = ("_precompute_ref_logps",)

    def _precompute_ref_logps(self, *args, **kwargs):
        """TRL's (DPO's, KTO's: precompute_ref_log_probs without a reference model), with the
        policy given a forward-only engine for it while it is still zero.Init's partitions
        (built after stage-3 arguments, its training engine not made yet), as DeepSpeed's run
        wraps it in an inference engine there."""
        library = self._strata_wraps._precompute_ref_logps
        if getattr(self, "ref_model", None) is not None or not _still_zero_init(self.model):
            return library(self, *args, **kwargs)
        with self._strata_borrowed(self.model):
            return library(self, *args, **kwargs)

    def __setattr__(self, name, value):
        if name in _FROZEN_SLOTS:
            self._strata_frozen(_FROZEN_SLOTS[name], value)
        super().__setattr__(name, value)

    def _strata_constructed(self) -> None:
        super()._strata_constructed()
        for attr, name in _FROZEN_SLOTS.items():  # assigned before the arguments were known
            self._strata_frozen(name, self.__dict__.get(attr))
        for i, func in enumerate(self.__dict__.get("reward_funcs") or []):
            self._strata_frozen(f"reward-{i}", func)

    def _strata_frozen(self, name: str, model) -> None:
        """Gives `model` (held as `name`) a forward-only engine at stage 3, frozen and
        partitioned as the policy is, and closes the engine of the model it replaces (DPO drops
        its reference once its log-probabilities are precomputed)."""
        engines = self.__dict__.setdefault("_strata_frozen_engines", {})
        held = engines.get(name)
        if held is not None and held.module is model:
            return  # the same model again (accelerate's prepare_model returns it)
        if held is not None:
            del engines[name]
            held.close()
        config = self._strata_config()
        if not isinstance(model, torch.nn.Module) or config is None or zero_stage(config) != 3:
            return
        import strata
        model.requires_grad_(False)
        engine, _, _, _ = strata.initialize(
            model=model, config=frozen_config(config, self.args, model, name),
            device=self.args.device)
        model.eval()
        engines[name] = engine


def strata_class(cls: type) -> type:
    """Any TRL trainer or config class made to train through strata, as the names of this module
    are: for those it does not reach, such as trl.experimental's
    (`strata_class(trl.experimental.orpo.ORPOTrainer)`). A trainer gets everything this module
    does for TRL's (the frozen models' engines, the precompute and generation gathers)."""
    if isinstance(cls, type) and issubclass(cls, transformers.Trainer):
        return with_strata(cls, strata_trainer=_Trainer)
    return with_strata(cls)


def __getattr__(name: str):
    try:
        cls = getattr(trl, name)
    except AttributeError:
        raise AttributeError(f"module 'strata.integrations.trl' has no attribute {name!r} "
                             f"(trl {trl.__version__} has none either)") from None
    try:
        made = strata_class(cls)
    except TypeError:
        raise AttributeError(f"strata.integrations.trl.{name}: trl.{name} is neither a Trainer "
                             "nor a TrainingArguments; import it from trl") from None
    globals()[name] = made
    return made


def __dir__():
    return sorted(set(globals()) | set(__all__))
