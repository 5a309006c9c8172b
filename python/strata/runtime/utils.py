"""deepspeed.runtime.utils' see_memory_usage, which scripts call to print memory between phases."""
import gc

import torch

_GiB = float(1 << 30)


def see_memory_usage(message: str, force: bool = False) -> None:
    """As DeepSpeed's: with force=True, on rank 0 (or the one process), prints `message`, the
    GPU's allocated / peak allocated / reserved / peak reserved GiB where a GPU is in use (its
    peaks then reset, so each call reports the span since the last), and the host's used memory
    (total - available, from /proc/meminfo). Without force it does nothing, as DeepSpeed's."""
    if not force:
        return
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()  # as DeepSpeed: what Python still holds is counted once collected
    print(message)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        c = torch.cuda
        print(f"MA {c.memory_allocated() / _GiB:.2f} GB Max_MA {c.max_memory_allocated() / _GiB:.2f}"
              f" GB CA {c.memory_reserved() / _GiB:.2f} GB Max_CA "
              f"{c.max_memory_reserved() / _GiB:.2f} GB")
        c.reset_peak_memory_stats()
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    used = info["MemTotal"] - info.get("MemAvailable", info.get("MemFree", 0))
    print(f"CPU Virtual Memory:  used = {used / _GiB:.2f} GB, "
          f"percent = {100.0 * used / info['MemTotal']:.1f}%")
