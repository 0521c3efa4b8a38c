"""What the batch runners use of a loaded model: a :class:`ModelRunner`, not the engine.

The sweep batch (:mod:`.sweep`), the continuous decode loop (:mod:`.continuous`, :mod:`.admission`) and
the document sources (:mod:`.sequences`) run a model over caches: they need its chunk forward and answer
text (:class:`~.decoding.Decoder`), the context prefill (:class:`~.prefill.ContextPrefill`, KVzip's
passes included), the reconstruction passes on their own (a sweep scores once for several settings),
the model's shape, device and attention kernels, and the generation limits. The engine builds one
runner per model and hands it to them; they never call back into the engine.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from ..kv.attention.varlen_kernels import KernelChoice
from ..kv.compress import Compressor
from ..kv.storage.cache import VarLenCache
from .answers import ModelShape
from .config import GenerationConfig
from .decoding import Decoder
from .prefill import ContextPrefill
from .reconstruction import ContextReconstruction
from .types import Request


@dataclass(frozen=True)
class ModelRunner:
    """One loaded model as the batch runners see it (see the module docstring)."""

    model: torch.nn.Module
    decoder: Decoder
    prefill: ContextPrefill
    reconstruction: ContextReconstruction
    shape: ModelShape
    device: torch.device
    kernels: KernelChoice  # the attention kernels, chosen once for every cache
    generation: GenerationConfig

    def new_cache(self, compressor: Compressor, compressed: bool = False) -> VarLenCache:
        """An empty cache for this model compressing with ``compressor``, on the runner's kernels;
        ``compressed``: one that rows of compressed caches join (a decode batch), never prefilled."""
        return VarLenCache(self.shape.num_layers, compressor, self.kernels, compressed)

    def max_new_tokens_for(self, request: Request) -> int:
        """The answer limit of ``request``: its own, else the generation config's."""
        return request.max_new_tokens or self.generation.max_new_tokens

    def release_memory(self) -> None:
        """Drop what a failed batch left behind (its cache is unreachable once the frame is gone)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
