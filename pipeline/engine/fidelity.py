"""Answer fidelity: how likely a compressed cache finds the full cache's answer.

For one question round, the full cache's greedy answer (its tokens, and the EOS that ended it, if
any) is teacher-forced after the question over a cache, and the mean per-token negative
log-likelihood of those tokens is returned. A sweep computes it for the full cache itself and for
every compressed setting from the same prefill; the output's ``answer_nll_delta`` is the
difference (compressed minus full), a low-noise measure of what compression lost even where the
greedy answers agree (accuracy on a few documents moves in steps of one document).
"""

from __future__ import annotations

import torch

from ..kv.cache import VarLenCache, run_chunk
from .batching import left_pad


def teacher_forced_nll(
    model: torch.nn.Module,
    cache: VarLenCache,
    question_ids: list[list[int]],
    targets: list[list[int]],
    ctx_len: torch.Tensor,
    prefill_logits: torch.Tensor,
    pad_id: int,
) -> list[float | None]:
    """Mean NLL per row of ``targets[b]`` after ``question_ids[b]`` (positions after the row's context).

    The cache must hold the compressed context only (the caller restores it); it holds the question
    and target tokens afterwards. A row without target tokens gets None. prefill_logits: (B, V) the
    context prefill's last logits (the first target's prediction when a question is empty, i.e.
    query-aware rows).
    """
    device = prefill_logits.device
    sequences = [q + t for q, t in zip(question_ids, targets)]
    if not any(sequences):
        return [None] * len(targets)
    ids, pos = left_pad([s if s else [pad_id] for s in sequences], ctx_len, pad_id, device)
    for b, seq in enumerate(sequences):
        if not seq:
            pos[b] = -1
    keep = max(len(t) for t in targets) + 1
    logits = run_chunk(model, cache, ids, pos, logits_to_keep=keep).logits.float()  # (B, keep, V)
    out: list[float | None] = []
    for b, (q, t) in enumerate(zip(question_ids, targets)):
        if not t:
            out.append(None)
            continue
        # predictions of t[k] come from the token before it: the last len(t) + 1 positions, minus the last
        rows = logits[b, keep - len(t) - 1 : keep - 1]
        if not q:  # the first target is predicted by the context's last position
            rows = torch.cat([prefill_logits[b : b + 1].float(), logits[b, keep - len(t) : keep - 1]])
        target = torch.tensor(t, device=device)
        nll = -torch.log_softmax(rows, dim=-1).gather(1, target[:, None]).squeeze(1)
        out.append(float(nll.mean()))
    return out
