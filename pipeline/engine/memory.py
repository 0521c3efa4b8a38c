"""Peak-memory and timing helpers that are honest on both CPU and CUDA.

CUDA: the allocator's peak (``torch.cuda.max_memory_allocated``) since the last reset.
CPU: the process' peak resident set size (``VmHWM``) since the last reset; Linux lets a process
reset it by writing ``5`` to ``/proc/self/clear_refs``. Where that is not possible the value is
the peak since process start.
"""

from __future__ import annotations

import resource
import time

import torch


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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self.peak_bytes = proc_status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


def now(device: torch.device) -> float:
    """perf_counter after the device finished queued work (CUDA-safe timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"
