"""The tensor math of the perturbation diagnostics (:mod:`pipeline.eval.perturbation`): full-cache
attention of some queries at one layer, and what a kept set does to it (formulas in that module)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.value_norms import OutputProjection, per_head_l1_norms


def group_l1_norms(value: torch.Tensor, proj: OutputProjection) -> torch.Tensor:
    """m_{h,i} = ||V_i W_O^h||_1 for every query head h. value: (H_kv, N, D) -> (H_kv, G, N) fp32."""
    return torch.stack([per_head_l1_norms(value[k], proj, k) for k in range(value.shape[0])])


@dataclass
class HeadStats:
    """Per-KV-head results of :meth:`LayerProbe.evaluate`, each (H_kv,) float64."""

    perturbation: torch.Tensor
    group_perturbation: torch.Tensor
    bound: torch.Tensor
    evicted_term: torch.Tensor
    evicted_mass: torch.Tensor


class LayerProbe:
    """Full-cache attention of some queries at one layer, against which kept sets are evaluated.

    query: (H_q, T, D) post-RoPE queries; key, value: (H_kv, N, D) every key they may see;
    query_pos: (T,) and key_pos: (N,) (default ``arange(N)``) original positions (key j visible
    to query t iff key_pos[j] <= query_pos[t]); proj: the layer's W_O slices; scaling: softmax
    scale; norms: optional precomputed :func:`group_l1_norms` of ``value``. Everything is
    computed in float32.
    """

    def __init__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query_pos: torch.Tensor,
        proj: OutputProjection,
        scaling: float,
        key_pos: torch.Tensor | None = None,
        norms: torch.Tensor | None = None,
    ) -> None:
        h_q, t, dim = query.shape
        h_kv, n, _ = key.shape
        if h_q % h_kv:
            raise ValueError(f"{h_q} query heads do not group into {h_kv} KV heads")
        self.groups = h_q // h_kv
        key_pos = torch.arange(n, device=key.device) if key_pos is None else key_pos.to(key.device)
        q = query.float().reshape(h_kv, self.groups, t, dim)
        logits = torch.einsum("kgtd,knd->kgtn", q, key.float()) * scaling
        self.visible = key_pos[None, :] <= query_pos.to(key.device)[:, None]  # (T, N)
        if not bool(self.visible.any(-1).all()):
            raise ValueError("every query must see at least one key (check query_pos / key_pos)")
        self.logits = logits.masked_fill(~self.visible, float("-inf"))
        self.probs = torch.softmax(self.logits, dim=-1)  # (H_kv, G, T, N)
        self.values = value.float()
        self.norms = group_l1_norms(value, proj) if norms is None else norms.float()  # (H_kv, G, N)
        self.w = proj.per_kv.view(h_kv, dim, self.groups, proj.hidden)  # w[k, :, g] = W_O^h
        self._pm = self.probs * self.norms[:, :, None, :]  # A_i m_{h,i}

    def evaluate(self, keep: torch.Tensor) -> HeadStats:
        """keep: (H_kv, N) bool, the kept set of every KV head (over all N keys)."""
        keep = keep.to(self.logits.device, torch.bool)
        if keep.shape != (self.logits.shape[0], self.logits.shape[-1]):
            expected = (self.logits.shape[0], self.logits.shape[-1])
            raise ValueError(f"keep must be (H_kv, N) = {expected}, got {tuple(keep.shape)}")
        mask = keep[:, None, None, :]
        if not bool((mask & self.visible).any(-1).all()):
            raise ValueError("a query sees no kept key (keep the queries' own positions)")
        probs_hat = torch.softmax(self.logits.masked_fill(~mask, float("-inf")), dim=-1)
        delta = torch.einsum("kgtn,knd->kgtd", self.probs - probs_hat, self.values)  # o - ô
        projected = torch.einsum("kgtd,kdge->kgte", delta, self.w)  # (H_kv, G, T, hidden)
        per_head = projected.abs().sum(-1)  # (H_kv, G, T)
        group = projected.sum(1).abs().sum(-1)  # (H_kv, T)
        evicted = ~mask
        e_term = (self._pm * evicted).sum(-1)  # (H_kv, G, T)
        k_term = (self._pm * mask).sum(-1)
        e_mass = (self.probs * evicted).sum(-1)
        k_mass = (self.probs * mask).sum(-1)
        bound = e_term + e_mass / k_mass * k_term
        return HeadStats(
            perturbation=per_head.mean((1, 2)).double(),
            group_perturbation=group.mean(-1).double(),
            bound=bound.mean((1, 2)).double(),
            evicted_term=e_term.mean((1, 2)).double(),
            evicted_mass=e_mass.mean((1, 2)).double(),
        )
