"""As deepspeed.utils.zero_to_fp32: the fp32 weights of a checkpoint that save_checkpoint wrote,
without the training script or an engine, from Python or from the command line. save_checkpoint
also leaves a `zero_to_fp32.py` in the checkpoint directory, as DeepSpeed does, so the line its
users know works as it is:

    python ckpt/zero_to_fp32.py ckpt out_dir [--safe_serialization] [--max_shard_size 5GB]
                                             [-t TAG] [--exclude_frozen_parameters]
    python -m strata.utils.zero_to_fp32 ckpt out_dir ...        (the same)

out_dir receives `pytorch_model.bin` (torch.save) or `model.safetensors`, split into
`pytorch_model-00001-of-0000N.bin` ... with `pytorch_model.bin.index.json` (safetensors:
`model-...safetensors`, `model.safetensors.index.json`) where the weights exceed max_shard_size:
Hugging Face's layout, which `from_pretrained(out_dir)` reads. The checkpoint may come from any
world size, stage or placement; the rank files are verified (sizes, checksums) and each
parameter is streamed from them whole.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import warnings
from typing import Optional, Union

import torch

from . import unpack_state

_STRATA_SCRIPT = '''#!/usr/bin/env python
# The fp32 weights of a strata checkpoint in this directory, as DeepSpeed's zero_to_fp32.py (which
# strata's save_checkpoint writes in its place; the same arguments):
#   python zero_to_fp32.py . out_dir [--safe_serialization] [--max_shard_size 5GB] [-t TAG]
#                                    [--exclude_frozen_parameters]
from strata.utils.zero_to_fp32 import main

if __name__ == "__main__":
    main()
'''


def write_recovery_script(save_dir) -> None:
    """`<save_dir>/zero_to_fp32.py` (executable), as DeepSpeed's save_checkpoint copies its own
    there: written once per directory, atomically (a rename). Written after the checkpoint is
    committed, so a failure (a full disk) is a warning naming the file, not the save's error;
    no partial file is left (the temporaries of a process killed here are removed by the next)."""
    path = os.path.join(os.fspath(save_dir), "zero_to_fp32.py")
    try:
        with open(path) as f:
            if f.read() == _STRATA_SCRIPT:
                return
    except OSError:
        pass
    for stale in glob.glob(glob.escape(path) + ".tmp.*"):  # of writers no longer running
        pid = stale.rsplit(".", 1)[-1]
        if pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(stale)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(_STRATA_SCRIPT)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        warnings.warn(f"strata: the checkpoint was saved, but its recovery script {path} could "
                      f"not be written: {err}", stacklevel=3)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: alive
    return True


def _resolve_tag(checkpoint_dir: str, tag: Optional[str]) -> str:
    if tag is not None:
        return str(tag)
    latest = os.path.join(checkpoint_dir, "latest")
    if not os.path.isfile(latest):
        raise FileNotFoundError(f"no tag given and {latest} does not exist")
    with open(latest) as f:
        return f.read().strip()


def read_checkpoint(checkpoint_dir, tag: Optional[str] = None,
                    exclude_frozen_parameters: bool = False) -> tuple[dict, dict]:
    """(fp32 weights by parameter name, the Python state) of a strata checkpoint, any world
    size, stage or placement: the rank files are verified (sizes, checksums) and each parameter
    is streamed from them whole (the fp32 master; a frozen parameter's working copy widened, or
    left out with exclude_frozen_parameters). A checkpoint saved with
    save_checkpoint(exclude_frozen_parameters=True) holds no frozen parameters: they are not in
    the result (a warning names how many unless exclude_frozen_parameters asked for that). It
    holds 4 bytes per parameter (the result) and no engine."""
    weights, state, left_out = read_checkpoint_parts(checkpoint_dir, tag,
                                                     exclude_frozen_parameters)
    if left_out and not exclude_frozen_parameters:
        warnings.warn(f"strata: {os.fspath(checkpoint_dir)} was saved without its "
                      f"{len(left_out)} frozen parameter(s) (exclude_frozen_parameters=True; "
                      f"{left_out[0]}, ...): they are not in the state dict; take them from "
                      "the model the run started from")
    return weights, state


def read_checkpoint_parts(checkpoint_dir, tag: Optional[str] = None,
                          exclude_frozen_parameters: bool = False) -> tuple[dict, dict, list]:
    """read_checkpoint's (weights, state) and the names of the parameters the save left out."""
    from .. import _strata
    checkpoint_dir = os.fspath(checkpoint_dir)
    tag = _resolve_tag(checkpoint_dir, tag)
    tag, arrays, blob, left_out = _strata.read_checkpoint(checkpoint_dir, tag,
                                                          bool(exclude_frozen_parameters))
    state = unpack_state(blob, os.path.join(checkpoint_dir, tag)) if blob else {}
    return {n: torch.from_numpy(a) for n, a in arrays.items()}, state, list(left_out)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict:
    """As DeepSpeed's: the model's state_dict from a checkpoint save_checkpoint wrote (any world
    size or stage; strata's, or DeepSpeed's own): fp32 parameters from the fp32 masters, tied
    names too (the same tensor), and the persistent buffers as saved; without the frozen
    parameters where asked. tag None: the
    one `latest` names. lazy_mode is accepted: the values are tensors already, and DeepSpeed's
    lazy tensors are read with `.contiguous()`, which a tensor has too."""
    del lazy_mode
    from .deepspeed_checkpoint import fp32_state_dict, is_deepspeed_checkpoint
    path = os.path.join(os.fspath(checkpoint_dir), _resolve_tag(os.fspath(checkpoint_dir), tag))
    if is_deepspeed_checkpoint(path):  # one DeepSpeed wrote: read as its zero_to_fp32 reads it
        return fp32_state_dict(path, exclude_frozen_parameters)
    weights, state = read_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = dict(weights)
    for alias, owner in state.get("tied", {}).items():
        if owner in out:
            out[alias] = out[owner]
    out.update(state.get("buffers", {}))
    return out


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir,
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """As DeepSpeed's: the model moved to the CPU and the checkpoint's fp32 state_dict loaded into
    it (strict=False, as DeepSpeed's), returned."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag),
                          strict=False)
    return model


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(size: Union[int, str]) -> int:
    """Bytes of a max_shard_size as Hugging Face reads it: an int, or digits and a unit ("5GB" is
    5 * 10**9, "500MiB" 500 * 2**20)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"max_shard_size {size!r}: expected an int or digits and a unit, such as "
                         "'5GB' or '500MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _split(sd: dict, limit: Optional[int]) -> list[list[str]]:
    """Names in shards of at most `limit` bytes each (a tensor larger than that alone), in order;
    a tied name goes with its tensor's first name and counts once."""
    shards: list[list[str]] = [[]]
    size, where = 0, {}
    for name, t in sd.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if key in where:  # a tied name: the same bytes, kept in the first one's shard
            shards[where[key]].append(name)
            continue
        nbytes = t.numel() * t.element_size()
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
        where[key] = len(shards) - 1
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir,
                                               max_shard_size: Union[int, str, None] = "5GB",
                                               safe_serialization: bool = False,
                                               tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """As DeepSpeed's: writes the fp32 state_dict into the directory output_dir (the module
    docstring: one file, or Hugging Face's shards and index beyond max_shard_size; None: one file
    whatever its size). An output_dir ending in .bin, .pt, .pth or .safetensors that is not an
    existing directory is one file of that name instead (what DeepSpeed before 0.14 took)."""
    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = os.fspath(output_dir)
    if not os.path.isdir(out) and out.endswith((".bin", ".pt", ".pth", ".safetensors")):
        _write(out, sd, out.endswith(".safetensors"))
        return
    limit = None if max_shard_size is None else parse_shard_size(max_shard_size)
    os.makedirs(out, exist_ok=True)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards = _split(sd, limit)
    if len(shards) == 1:
        _write(os.path.join(out, weights_name), sd, safe_serialization)
        return
    stem, ext = os.path.splitext(weights_name)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}"
        part = {n: sd[n] for n in names}
        _write(os.path.join(out, fname), part, safe_serialization)
        total += sum(t.numel() * t.element_size() for t in
                     {id(t): t for t in part.values()}.values())
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out, weights_name + ".index.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write(path: str, sd: dict, safetensors: bool) -> None:
    if safetensors:  # each name its own bytes, tied ones too (as save_16bit_model)
        from ..engine import _write_safetensors
        _write_safetensors(path, sd, {"format": "pt"})
    else:
        torch.save(sd, path)


def main(argv=None) -> None:
    """DeepSpeed's zero_to_fp32.py command line."""
    parser = argparse.ArgumentParser(
        description="The fp32 weights of a strata (DeepSpeed-style) checkpoint, as DeepSpeed's "
                    "zero_to_fp32.py")
    parser.add_argument("checkpoint_dir", help="the checkpoint folder (holding `latest` and the "
                                               "tag folders), e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="the folder for the fp32 state_dict files")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="the largest file before the weights are split (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="safetensors files instead of torch.save's")
    parser.add_argument("-t", "--tag", default=None,
                        help="the checkpoint's tag (default: the one `latest` names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out parameters that do not train")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted, as DeepSpeed's")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()
