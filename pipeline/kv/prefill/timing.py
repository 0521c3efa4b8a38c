"""Wall time of a block of tensor work, synchronising CUDA so that queued kernels count."""

from __future__ import annotations

import time

import torch


class BlockTimer:
    """``with BlockTimer(device) as t: ...`` then ``t.seconds``; CUDA is synchronised before and after."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds = device, 0.0

    def __enter__(self) -> BlockTimer:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.t0
