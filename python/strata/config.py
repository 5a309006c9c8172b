"""Config checking and memory planning (no torch needed)."""
from __future__ import annotations

import base64
import binascii
import json
import math
import os
import tempfile
from typing import Any, Mapping, Optional, Union

from . import _strata

ConfigLike = Union[str, "os.PathLike[str]", Mapping[str, Any]]


class ConfigError(_strata.StrataError, ValueError):
    """An invalid DeepSpeed config; the message lists every error (path: what is wrong)."""


def _json_values(value, path: str):
    """A config dict's values as JSON holds them. DeepSpeed reads the dict itself, where
    accelerate writes "steps_per_print": inf (never print): that key is left out, strata printing
    nothing per step; any other number JSON cannot hold (inf, nan) is refused, named."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if sub == "steps_per_print" and isinstance(v, float) and math.isinf(v) and v > 0:
                continue
            out[k] = _json_values(v, sub)
        return out
    if isinstance(value, (list, tuple)):
        return [_json_values(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f'config "{path}": {value} is not a number JSON can hold')
    return value


def config_json(config: Mapping) -> str:
    """A config dict as the JSON text the native engine reads (_json_values)."""
    return json.dumps(_json_values(config, ""))


def config_bool(value) -> bool:
    """A config flag as the checker reads it (true / false, 0 / 1, "true" / "false" in any case;
    it refuses anything else before the engine starts): the string "false" is false."""
    if isinstance(value, str):
        return value.lower() == "true"
    return bool(value)


def zero_stage(config: Mapping) -> int:
    """A loaded config's zero_optimization.stage (0 without one), as the reader takes it: a
    number or a string of one. Anything else is a ValueError naming the key."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    try:
        return int(str(stage))
    except ValueError:
        raise ValueError(f"zero_optimization.stage: expected 0, 1, 2 or 3, got {stage!r}") from None


def _base64_json(s: str) -> Optional[str]:
    """The JSON text `s` encodes in (URL-safe) base64, as DeepSpeed and transformers take a
    config passed on a command line; None where `s` is no such thing."""
    try:
        text = base64.urlsafe_b64decode(s.strip().encode("ascii")).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeError):
        return None
    return text if text.lstrip().startswith("{") else None


def _text_or_path(config: ConfigLike) -> tuple[str, str]:
    """(json text, path): exactly one is non-empty. A string is JSON text, a path, or base64 of
    JSON text where no such file exists (DeepSpeed's order of reading)."""
    if isinstance(config, Mapping):
        return config_json(config), ""
    if isinstance(config, (str, os.PathLike)):
        s = os.fspath(config)
        if s.lstrip().startswith("{"):
            return s, ""
        if not os.path.exists(s):
            text = _base64_json(s)
            if text is not None:
                return text, ""
        return "", s
    raise TypeError(f"config must be a dict, a JSON string, base64 of one or a path, not "
                    f"{type(config).__name__}")


def check_config(config: ConfigLike, *, world_size: Optional[int] = None, strict: bool = False,
                 check_here: bool = False, auto_values: Optional[Mapping[str, Any]] = None,
                 hidden_size: Optional[int] = None,
                 params: Union[int, float, str, None] = None,
                 trainer_fills_auto: bool = True) -> dict:
    """Checks a DeepSpeed config (a dict, JSON text or a file path) as `offloadctl config check`.

    Returns {"ok", "errors", "warnings", "notes", "nvme_paths", "effective_json", ...}; each
    error and warning is a dict with kind, path, message, line, column and text. check_here
    checks each nvme_path in use on this machine (nvme_paths: key, dir, free_bytes); with
    `params` (7e9 or "7B") also whether it has room for what the engine puts there for that
    model on `world_size` ranks of this machine (as `offloadctl config check --here --params`).
    trainer_fills_auto=False (a script's own initialize): the "auto" values a trainer would fill
    in DeepSpeed's config-model sections (zero_optimization, fp16, bf16) take their defaults, as
    DeepSpeed's initialize drops them ("dropped_auto" lists the paths; the others stay in
    "unresolved_auto").
    Never raises for a bad config; raises StrataError when the file cannot be read.
    """
    text, path = _text_or_path(config)
    autos = {k: json.dumps(v) for k, v in (auto_values or {}).items()}
    if params is not None:
        if not check_here:
            raise ValueError("check_config: params needs check_here=True")
        params = float(_parse_count(params) if isinstance(params, str) else params)
    # A dict is serialized here: its diagnostics name the key's path, not a line of that text.
    located = not isinstance(config, Mapping)
    return _strata.check_config(text, path, world_size, strict, check_here, autos, hidden_size,
                                params, trainer_fills_auto, located)


def add_config_arguments(parser):
    """As deepspeed.add_config_arguments: adds the "DeepSpeed" argument group (--deepspeed,
    --deepspeed_config FILE, and the deprecated --deepscale / --deepscale_config) to an argparse
    parser and returns it; strata.initialize(args=args, ...) reads the config from
    args.deepspeed_config."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no effect on strata)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated: as --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated: as --deepspeed_config")
    return parser


def load_config(config: ConfigLike, *, world_size: Optional[int] = None,
                auto_values: Optional[Mapping[str, Any]] = None) -> dict:
    """Checks the config and returns it as a dict (comments stripped, "auto" values substituted);
    raises ConfigError with every error's text when it is invalid."""
    res = check_config(config, world_size=world_size, auto_values=auto_values)
    if not res["ok"]:
        path = _text_or_path(config)[1]
        raise ConfigError(f"invalid DeepSpeed config{' ' + path if path else ''}:\n" +
                          "\n".join(e["text"] for e in res["errors"]))
    return json.loads(res["normalized_json"])


def plan(params: Union[int, float, str], config: Optional[ConfigLike] = None, *,
         stage: Optional[int] = None, offload_optimizer: Optional[str] = None,
         offload_param: Optional[str] = None, gpus: int = 8, nodes: int = 1,
         hbm_gb: float = 80, dram_gb: float = 1024, nvme_gb: float = 3840,
         nvme_gbps: float = 6, largest_group: float = 0, activations_gb: float = 0,
         grad_accum: int = 0, recipe: str = "", text: bool = False,
         trainable: Union[int, float, str] = 0):
    """The ZeRO memory plan for `params` parameters, as `offloadctl plan --json` (a dict; the
    readable report with text=True). `params` may be a count or a string like "7B";
    `trainable` (`--trainable`) those that train, the rest frozen (0: all)."""
    if isinstance(params, str):
        params = _parse_count(params)
    if isinstance(trainable, str):
        trainable = _parse_count(trainable)
    tmp = None
    config_path = ""
    if config is not None:
        ctext, config_path = _text_or_path(config)
        if ctext:
            tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
            tmp.write(ctext)
            tmp.close()
            config_path = tmp.name
    try:
        js, report, _fits = _strata.plan(
            float(params), config_path, -1 if stage is None else stage, offload_optimizer or "",
            offload_param or "", gpus, nodes, hbm_gb, dram_gb, nvme_gb, nvme_gbps,
            float(largest_group), activations_gb, grad_accum, recipe, float(trainable))
    finally:
        if tmp is not None:
            os.unlink(tmp.name)
    return report if text else json.loads(js)


def _parse_count(s: str) -> float:
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    t = s.strip().lower()
    if t and t[-1] in mult:
        return float(t[:-1]) * mult[t[-1]]
    return float(t)
