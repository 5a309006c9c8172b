"""Checkpoint helpers: the Python state strata keeps in a checkpoint, and DeepSpeed's
zero_to_fp32 functions.

The Python state (client_state, micro_steps, global_samples and the module's persistent
buffers) is the engine checkpoint's client state blob (`<tag>/client_state.bin`, written by
rank 0): torch.save's zip format, read back with torch.load(weights_only=True), whose unpickler
builds only tensors, dicts, lists, tuples, numbers, strings, None and the globals allowed through
torch.serialization.add_safe_globals, so loading a checkpoint from someone else never runs code.
A blob written before this format (a plain pickle) is read by an unpickler that resolves no
global at all (plain containers, numbers and strings only); anything else is refused, naming the
checkpoint.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Optional

import torch


def pack_state(state: dict) -> bytes:
    """The blob of `state`; refuses (ValueError) what unpack_state would not read back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    try:
        torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001: torch's message names the type
        raise ValueError(
            "save_checkpoint: client_state holds an object load_checkpoint would refuse (it "
            "reads with torch.load(weights_only=True): tensors, dicts, lists, tuples, numbers, "
            f"strings, None; torch.serialization.add_safe_globals allows more): {e}") from None
    return blob


class _NoGlobalsUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global '{module}.{name}' refused")


def unpack_state(blob: bytes, where: str) -> dict:
    """The state a checkpoint's blob holds ({} when none); `where` names the checkpoint."""
    if not blob:
        return {}
    try:
        if blob[:4] == b"PK\x03\x04":  # torch.save's zip
            state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
        else:  # a pickle from an older strata: containers, numbers and strings only
            state = _NoGlobalsUnpickler(io.BytesIO(blob)).load()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(
            f"strata: the client state of checkpoint {where} was not loaded: loading it could run "
            "code or it is damaged (only tensors, dicts, lists, tuples, numbers, strings and None "
            f"are read; torch.serialization.add_safe_globals allows more): {e}") from None
    if not isinstance(state, dict):
        raise RuntimeError(f"strata: the client state of checkpoint {where} is not a dict "
                           f"({type(state).__name__})")
    return state
