"""Answer fidelity: how likely a compressed cache finds the full cache's answer.

For one question round, the full cache's greedy answer (its tokens, and the EOS that ended it, if
any) is teacher-forced after the question over a cache, and the mean per-token negative
log-likelihood of those tokens is returned. A sweep computes it for the full cache itself and for
every compressed setting from the same prefill; the output's ``answer_nll_delta`` is the
difference (compressed minus full), a low-noise measure of what compression lost even where the
greedy answers agree (accuracy on a few documents moves in steps of one document).

The question is not prefilled again: the decoder measures right after a round's greedy answer,
with the cache rolled back to the end of the question, whose last logits predict the first answer
token; only the answer's tokens but the last are run, as one teacher-forced chunk.
"""

from __future__ import annotations

import torch

from ..kv.compress import Compressor
from ..kv.storage.cache import VarLenCache, run_chunk
from ..kv.storage.rows import take_rows
from ..kv.storage.store import VarLenLayer
from .batching import left_pad
from .runner import ModelRunner
from .sequences import Sequence

# answers whose fidelity is measured together at most (their rows are held as copies until then)
FIDELITY_ROWS = 32
References = dict[int, list[list[int]]]  # row index -> per question round, the reference answer's tokens


def continuation_nll(
    model: torch.nn.Module,
    cache: VarLenCache,
    first_logits: torch.Tensor,
    targets: list[list[int]],
    start_pos: torch.Tensor,
    pad_id: int,
) -> list[float | None]:
    """Mean NLL per row of ``targets[b]`` as the continuation of what ``cache`` holds now.

    first_logits: (B, V), each row's prediction of its first target token (the question chunk's
    last logits; the context's for query-aware rows). The other target tokens but the last are
    teacher-forced as one left-padded chunk at positions ``start_pos[b], start_pos[b] + 1, ...``
    (start_pos: (B,), the position after each row's question); the cache holds them afterwards.
    A row without target tokens gets None.
    """
    chunks = [t[:-1] for t in targets]
    width = max((len(c) for c in chunks), default=0)
    later = None
    if width:
        ids, pos = left_pad([c if c else [pad_id] for c in chunks], start_pos, pad_id, first_logits.device)
        for b, chunk in enumerate(chunks):
            if not chunk:
                pos[b] = -1
        later = run_chunk(model, cache, ids, pos, logits_to_keep=width).logits.float()  # (B, width, V)
    out: list[float | None] = []
    for b, target in enumerate(targets):
        if not target:
            out.append(None)
            continue
        rows = first_logits[b : b + 1].float()
        if len(target) > 1:  # t[k] is predicted at the position of t[k - 1]: the chunk's last len - 1
            rows = torch.cat([rows, later[b, width - len(target) + 1 :]])
        ids = torch.tensor(target, device=rows.device)
        nll = -torch.log_softmax(rows, dim=-1).gather(1, ids[:, None]).squeeze(1)
        out.append(float(nll.mean()))
    return out


class FidelityMeter:
    """The answer NLL of each answer of a decode loop (:mod:`.continuous`), measured on copies of the
    answered rows, :data:`FIDELITY_ROWS` at a time: of ``references`` (row index -> [round] tokens), or
    with ``references=None`` of the row's own answer. ``capped``: the rows' marks are copies (a
    decode-time cap's eviction reorders entries), else segment lengths."""

    def __init__(self, runner: ModelRunner, compressor: Compressor, references: References | None) -> None:
        self.runner, self.compressor, self.references = runner, compressor, references
        self.capped = compressor.config.max_cache_tokens is not None
        self.held: list[tuple] = []  # answers waiting for their fidelity

    def hold(self, cache: VarLenCache, j: int, seq: Sequence) -> None:
        """Keep a copy of row ``j`` at its question's end, with the answer just recorded, until its
        fidelity is measured (with other rows', :meth:`measure`)."""
        if self.capped:
            layers = seq.asked
        else:
            layers = [take_rows(layer, [j], mark) for layer, mark in zip(cache.store, seq.asked)]
        target = seq.results[-1].reference_tokens
        if self.references is not None:
            target = self.references[seq.index][seq.round - 1]
        self.held.append((seq.results[-1], layers, target, seq.question_logits, seq.ctx_len + seq.question_tokens))
        if len(self.held) >= FIDELITY_ROWS:
            self.measure()

    def measure(self) -> None:
        """Each held answer's ``answer_nll``: its target teacher-forced after its question, on the held
        rows together (:func:`continuation_nll`)."""
        if not self.held:
            return
        results, rows, targets, first, start = zip(*self.held)
        self.held = []
        layers = [VarLenLayer.concat([row[idx] for row in rows]) for idx in range(len(rows[0]))]
        probe = VarLenCache.from_layers(layers, self.compressor, self.runner.kernels)
        start = torch.tensor(start, device=self.runner.device)
        nll = continuation_nll(
            self.runner.model, probe, torch.stack(first), list(targets), start, self.runner.decoder.pad_id
        )
        for result, value in zip(results, nll):
            result.answer_nll = value
