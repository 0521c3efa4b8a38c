"""KVzip (Kim et al., arXiv 2505.23416; code snu-mllab/KVzip): an entry matters as much as the model
needs it to *reconstruct the context*. After the prefill, teacher-forced passes "repeat the previous
context" over the cached context, chunk by chunk; an entry's score is the max of its attention
weight over the reconstruction queries and the query heads of its KV group
(:mod:`pipeline.kv.prefill.reconstruction`, driven by :mod:`pipeline.engine.reconstruction`). The scores
do not depend on any question, so one compressed cache serves every later question.

The engine fills ``observed`` with those pass scores (the chat-template prefix, KVzip's sink, is
+inf); this part adds the window / padding conventions. Published with one budget over all layers
and heads: ``layer-kvzip`` (``kvzip`` alone: uniform per-head budgets, the original's
``pair-uniform`` level). Cost: one more forward over the context's tokens (chunked), each chunk
attending to the full context.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, Field

from ..parts import LayerContext, Scorer
from ..phases import Phase
from .common import finalise


class KVzipOptions(BaseModel):
    """KVzip scorer"""

    reconstruction_chunk: int = Field(2048, ge=16, description="context tokens reconstructed per pass")
    kvzip_plus: bool = Field(False, description="KVzip+: weigh each attention weight by ||V W_O||_2 / ||h||_2")


class KVzip(Scorer):
    name = "kvzip"
    options = KVzipOptions
    summary = "attention needed to reconstruct the context in teacher-forced passes (arXiv 2505.23416)"
    decides = Phase.PASSES

    def observe(self, query, key_pos, options, window, rotary=None, inputs=None) -> None:
        return None  # the scores come from the reconstruction passes, after the prefill

    def score(self, ctx: LayerContext, options: KVzipOptions) -> torch.Tensor:
        if not isinstance(ctx.observed, torch.Tensor):
            raise RuntimeError("kvzip scores come from the context-reconstruction passes (none were run)")
        return finalise(ctx.observed.float(), ctx.key_pos, ctx.row_window)
