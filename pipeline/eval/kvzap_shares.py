"""Predictor-aware shares: the cross-layer budgets that suit the learned scorer's own ranking.

KVzip's global top-k (arXiv 2505.23416; the ``layer`` allocation) gives each (layer, KV head) the
number of its entries among the document's top-k true KVzip+ scores. Those counts are right for a
head that keeps its *true* top entries; a KVzap head (arXiv 2601.07891) keeps its *predicted* top
entries instead, so a slot is worth what the next entry in the predicted order truly scores. With
``C_h(k)`` the true scores of head h's first k entries in its predicted order, summed, the
predictor-aware counts maximise ``sum_h C_h(k_h)`` subject to ``sum_h k_h = pool`` — KVzip's own
objective (the kept score mass), under the predictor's ranking. With a perfect predictor they are
exactly the global top-k's counts; where the predictor ranks a head poorly its marginal slots are
worth less and go elsewhere, where it ranks well they are worth their true scores.

The maximum is taken on the concave envelope of each ``C_h`` (Lagrangian: each head keeps the k
maximising ``C_h(k) - lam * k``; ``lam`` by bisection so the counts sum to the pool, mixing the
two counts around the crossing to meet it exactly), on a document's sampled entries
(:class:`~pipeline.eval.kvzap_calibration.DocumentTargets`, a uniform sample of the entries after
the template prefix). Every head also keeps ``fixed`` entries (the attention sinks and the window)
inside its count, as the ``shares`` allocation's heads do, so the pool is what is left of the row's
budget ``L * H * (f * n - fixed)``; shares are the counts over their mean.
"""

from __future__ import annotations

import torch

from ..kv.kvzap_model import KVzapModel


def predictions(model: KVzapModel, hidden: torch.Tensor, positions=None, tokens: int = 0) -> torch.Tensor:
    """hidden: (L, m, hidden) sampled attention inputs -> (L, H_kv, m) predicted log-scores;
    ``positions`` (m,) and ``tokens`` (the row's length) feed a file's position term."""
    key_pos = None if positions is None else positions[None].to(torch.long)
    lengths = torch.tensor([tokens])
    return torch.stack(
        [model.predict(layer, hidden[layer][None].float(), key_pos, lengths)[0] for layer in range(hidden.shape[0])]
    )


def score_curves(predicted: torch.Tensor, log_scores: torch.Tensor) -> torch.Tensor:
    """predicted, log_scores: (K, m) one row per head -> (K, m + 1) float64: the true scores
    ``exp(log_scores)`` summed along each head's predicted order (descending; ties to the earlier entry)."""
    order = torch.sort(predicted.double(), dim=-1, descending=True, stable=True).indices
    gains = log_scores.double().exp().gather(-1, order)
    return torch.cat([torch.zeros_like(gains[:, :1]), gains.cumsum(-1)], dim=-1)


def envelope_counts(curves: torch.Tensor, pool: float, steps: int = 100) -> torch.Tensor:
    """curves: (K, m + 1) non-decreasing from 0 -> (K,) float64 counts in [0, m] summing to ``pool``
    (clamped to [0, K * m]) that maximise ``sum_k curves[k, count_k]`` on the concave envelopes."""
    heads, m = curves.shape[0], curves.shape[1] - 1
    pool = min(max(float(pool), 0.0), float(heads * m))
    ks = torch.arange(m + 1, dtype=curves.dtype, device=curves.device)

    def counts(lam: float) -> torch.Tensor:  # the largest maximiser: ties keep the slot
        value = curves - lam * ks
        return (m - torch.flip(value, [-1]).argmax(-1)).double()

    lo, hi = 0.0, 2.0 * float((curves[:, 1:] - curves[:, :-1]).max().clamp(min=0)) + 1e-300
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if float(counts(mid).sum()) > pool else (lo, mid)
    many, few = counts(lo), counts(hi)
    spread = float(many.sum() - few.sum())
    weight = 0.0 if spread <= 0 else (pool - float(few.sum())) / spread
    return few + min(max(weight, 0.0), 1.0) * (many - few)


def predicted_shares(model: KVzapModel, hidden: torch.Tensor, log_scores: torch.Tensor, sizes: list[float],
                     tokens: int, fixed: int, positions=None) -> torch.Tensor:  # fmt: skip
    """One document's predictor-aware shares (S, L, H_kv) float32 (mean 1 at each size).

    hidden: (L, m, hidden) attention inputs and log_scores: (L, H_kv, m) true KVzip+ log-scores of
    its m sampled entries; ``tokens``: the row's length n; ``fixed``: entries every head keeps anyway
    (sinks + window), counted in its share; ``positions`` (m,): the entries' positions (a file's
    position term)."""
    layers, heads, m = log_scores.shape
    predicted = predictions(model, hidden, positions, tokens)
    curves = score_curves(predicted.reshape(-1, m), log_scores.reshape(-1, m))
    out = []
    for size in sizes:
        pool = max(size * tokens - fixed, 0.0) * layers * heads * m / tokens
        counts = fixed + envelope_counts(curves, pool) * tokens / m
        out.append((counts / counts.mean()).view(layers, heads))
    return torch.stack(out).float()


def kept_of_global_top(
    model: KVzapModel,
    hidden: torch.Tensor,
    log_scores: torch.Tensor,
    fractions,
    tokens: int,
    fixed: int,
    positions=None,
) -> list[tuple[float, float]]:
    """How well the file's shares and predictors keep one document's best entries at each kept fraction f,
    on its m sampled entries: each head keeps its predicted top ``floor((share * f * n - fixed) * m / n)``
    (its count less the sinks and window). Per fraction: (kept true score / the global top's, the fraction
    of KVzip's global top-T entries kept), T the same pool. hidden: (L, m, hidden); log_scores: (L, H_kv, m)."""
    layers, heads, m = log_scores.shape
    curves = score_curves(predictions(model, hidden, positions, tokens).reshape(-1, m), log_scores.reshape(-1, m))
    in_order = curves[:, 1:] - curves[:, :-1]  # true scores along each head's predicted order
    out = []
    for fraction in fractions:
        share = model.shares_at(torch.tensor([fraction]), torch.tensor([tokens]))[0].reshape(-1).cpu()
        counts = torch.floor((share * fraction * tokens - fixed).clamp(min=0) * m / tokens + 1e-6).clamp(0, m).long()
        pool = round(max(fraction * tokens - fixed, 0.0) * m / tokens * layers * heads)
        if pool == 0:
            out.append((1.0, 1.0))
            continue
        best = in_order.reshape(-1).topk(pool).values
        kept = torch.arange(m)[None] < counts[:, None]
        mass = float(curves.gather(1, counts[:, None]).sum() / best.sum())
        out.append((mass, float((kept & (in_order >= best[-1])).sum()) / pool))
    return out
