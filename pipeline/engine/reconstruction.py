"""KVzip's context-reconstruction passes, the engine side: prompts and the passes over a batch.

For each row the context body (after the chat-template prefix) is cut into chunks of
``reconstruction_chunk`` tokens. Pass t feeds, positioned right after the row's context (the pass's
own K/V are dropped afterwards, so every pass starts at the same position):

    "Repeat the previous context exactly."                                  (t = 0)
    "Repeat the part of the previous context exactly, starting with " + the last 8 tokens of chunk t-1
    + the template tail (end of the user turn, assistant header) + chunk t's own tokens (teacher forced)

i.e. the instruction continues the user turn that holds the context (whose chunk ends with "\\n\\n")
and the chunk is the assistant's answer, as in snu-mllab/KVzip (``ModelKVzip.self_task``; the same
wording as its code, chunk 2048 as kvpress). Where this differs from the original:

* scores are computed in float32 (the original in the model dtype);
* the sinks are the whole template prefix (as the original), always kept; the last ``window``
  context tokens are always kept too (this project's convention for every scorer);
* batches of left-padded rows run their passes together; a row with fewer chunks takes part as
  padding in the later passes.

The scores are per layer (B, H_kv, n) in the dense left-padded layout of the pending layers;
the held prefill's ``finish`` (:mod:`pipeline.kv.prefill.layers`) takes them as the scorer's ``observed``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..kv.compress import PendingLayer
from ..kv.prefill.reconstruction import ReconstructionCache
from ..kv.storage.cache import run_chunk
from .batching import left_pad
from .prompts import PromptBuilder

REPEAT_FIRST = "Repeat the previous context exactly."
REPEAT_NEXT = "Repeat the part of the previous context exactly, starting with "
PREVIOUS_TAIL = 8  # tokens of the previous chunk quoted in the next pass's instruction


class ContextReconstruction:
    """Runs the passes for one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, prompts: PromptBuilder, pad_id: int, device: torch.device) -> None:
        self.model, self.prompts, self.pad_id, self.device = model, prompts, pad_id, device
        self.first = prompts.text_ids(REPEAT_FIRST)
        self.next = prompts.text_ids(REPEAT_NEXT)
        self.tail = prompts.tail_ids()

    @torch.inference_mode()
    def scores(
        self, contexts: list[list[int]], prefixes: list[int], layers: list[PendingLayer], chunk: int, kvzip_plus: bool
    ) -> list[torch.Tensor]:
        """Per layer (B, H_kv, n) float32 KVzip scores of the pending layers (+inf on the sinks).

        contexts: each row's context token ids (what was prefilled); prefixes: each row's number of
        template-prefix tokens (the sinks)."""
        key_pos = layers[0].key_pos
        bsz, h_kv, n, _ = layers[0].key.shape
        sinks = torch.tensor(prefixes, device=key_pos.device)
        lengths = torch.tensor([len(c) for c in contexts], device=key_pos.device)
        scores = [torch.zeros(bsz, h_kv, n, dtype=torch.float32, device=key_pos.device) for _ in layers]
        sink = (key_pos >= 0) & (key_pos < sinks[:, None])
        for s in scores:
            s.masked_fill_(sink[:, None, :], float("inf"))
        passes = max(math.ceil(max(int(length - prefix), 0) / chunk) for length, prefix in zip(lengths, sinks))
        for t in range(passes):
            start = torch.minimum(sinks + t * chunk, lengths)
            end = torch.minimum(start + chunk, lengths)
            cache = ReconstructionCache(layers, start, end, sinks, scores, kvzip_plus)
            ids, pos = self._pass_inputs(contexts, t, start.tolist(), end.tolist(), lengths)
            with self._norm_hooks(cache, kvzip_plus):
                run_chunk(self.model.base_model, cache, ids, pos)
        return scores

    def _pass_inputs(self, contexts: list[list[int]], t: int, starts: list[int], ends: list[int], lengths):
        """Left-padded ids and positions of pass t (rows without a chunk: all padding)."""
        sequences = []
        for ids, s, e in zip(contexts, starts, ends):
            if s >= e:
                sequences.append([])
                continue
            instruction = self.first if t == 0 else self.next + ids[max(s - PREVIOUS_TAIL, 0) : s]
            sequences.append(instruction + self.tail + ids[s:e])
        if not any(sequences):
            sequences[0] = [self.pad_id]  # keep the batch's shape; positions below mark it as padding
        ids, pos = left_pad(sequences, lengths.cpu(), self.pad_id, self.device)
        for b, seq in enumerate(sequences):
            if not seq or starts[b] >= ends[b]:
                pos[b] = -1
        return ids, pos

    @contextmanager
    def _norm_hooks(self, cache: ReconstructionCache, enabled: bool):
        """KVzip+: record each layer's attention-input norms (B, T) with forward pre-hooks (removed after)."""
        handles = []
        if enabled:
            for layer in self.model.base_model.layers:
                attention = layer.self_attn

                def record(module, args, kwargs, _cache=cache):
                    hidden = kwargs.get("hidden_states", args[0] if args else None)
                    _cache.hidden_norms[module.layer_idx] = hidden.float().norm(dim=-1)

                handles.append(attention.register_forward_pre_hook(record, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
