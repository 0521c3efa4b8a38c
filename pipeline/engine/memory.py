"""Peak-memory and timing helpers that are honest on both CPU and CUDA.

CUDA: the allocator's peak (``torch.cuda.max_memory_allocated``) since the last reset.
CPU: the process' peak resident set size (``VmHWM``) since the last reset; Linux lets a process
reset it by writing ``5`` to ``/proc/self/clear_refs``. Where that is not possible the value is
the peak since process start.
"""

from __future__ import annotations

import resource
import time

import psutil
import torch

GPU_KV_SHARE, CPU_KV_SHARE = 0.7, 0.25  # of the free GPU memory / available RAM (default_kv_memory)


class PeakMemory:
    """Context manager measuring peak memory of a block on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
            except OSError:  # not Linux, or not allowed: the peak is then the process' peak since start
                pass
        return self

    def __exit__(self, *exc) -> None:
        self.peak_bytes = self.so_far()

    def so_far(self) -> int:
        """The peak since the block began, read now (the block may still be running)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return proc_status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def proc_status_bytes(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``...) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_kv_memory(device: torch.device) -> int:
    """Bytes of KV cache a continuous decode batch may hold when ``kv_memory`` is not given: 70 % of the
    GPU memory free now (call it once the model is loaded; the rest is left for one document's prefill
    activations), on CPU 25 % of the RAM the system reports available now."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(GPU_KV_SHARE * free)
    return int(CPU_KV_SHARE * psutil.virtual_memory().available)


def now(device: torch.device) -> float:
    """perf_counter after the device finished queued work (CUDA-safe timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"
