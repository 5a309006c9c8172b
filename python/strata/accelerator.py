"""As deepspeed.accelerator: get_accelerator() for scripts written for DeepSpeed
(`from strata.accelerator import get_accelerator` in place of deepspeed's). The CUDA accelerator
where torch sees a GPU, else the CPU, where strata runs its host stand-in. The calls DeepSpeed's
example scripts make: device_name, current_device_name, device, set_device, device_count,
is_available, synchronize, empty_cache, the memory counters, manual_seed(_all),
communication_backend_name, is_bf16_supported / is_fp16_supported, pin_memory."""
from __future__ import annotations

from typing import Optional

import torch


class Accelerator:
    """One kind of device: "cuda" or "cpu" (name())."""

    def __init__(self, cuda: bool):
        self._cuda = cuda

    def name(self) -> str:
        return "cuda" if self._cuda else "cpu"

    def device_name(self, device_index: Optional[int] = None) -> str:
        """"cuda:N" ("cuda" without an index), or "cpu" whatever the index, as DeepSpeed's."""
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device() if self._cuda else None)

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        """torch's allocations on the device plus what live strata engines hold there (their
        states and buffers, which DeepSpeed keeps in torch tensors and strata does not): what
        DeepSpeed's memory_allocated counts. On the host stand-in, the engines' share alone."""
        torch_bytes = torch.cuda.memory_allocated(device_index) if self._cuda else 0
        return torch_bytes + _engine_bytes(self._index(device_index), peak=False)

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        """torch's peak plus each live engine's own: an upper bound of the two together."""
        torch_bytes = torch.cuda.max_memory_allocated(device_index) if self._cuda else 0
        return torch_bytes + _engine_bytes(self._index(device_index), peak=True)

    def _index(self, device_index) -> Optional[int]:
        if not self._cuda:
            return None
        if device_index is None:
            return torch.cuda.current_device()
        return torch.device("cuda", device_index).index if isinstance(device_index, int) \
            else torch.device(device_index).index

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if not self._cuda:
            import os
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        index = self.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def communication_backend_name(self) -> str:
        """The torch.distributed backend: strata.init_distributed's default."""
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.name()


_accelerator: Optional[Accelerator] = None


def _engine_bytes(cuda_index: Optional[int], peak: bool) -> int:
    """Device bytes held by the live strata engines on CUDA device `cuda_index` (None: those
    on the host stand-in)."""
    from . import engine  # noqa: PLC0415 (engine imports this module)
    return engine._engine_device_bytes(cuda_index, peak)


def get_accelerator() -> Accelerator:
    """The process's accelerator, decided on the first call: CUDA where torch sees a GPU."""
    global _accelerator
    if _accelerator is None:
        _accelerator = Accelerator(torch.cuda.is_available())
    return _accelerator
