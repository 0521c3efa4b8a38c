"""A learned gate in the form of Fast KVzip (Jang et al., arXiv 2601.17668), as pure tensors: an
experimental kind of KVzap file (``kind="gate"``, :class:`~pipeline.kv.kvzap_model.KVzapModel`).

Per layer, from each entry's attention input h_i (hidden,), a low-rank key per KV head and one query per
query head of its group (rank d, both RMS-normalised with learned weights), and S learned sink keys per
KV head. The gate of entry i for query head g of KV head k is a softmax between its own key and the sinks:

    l_ig   = <key_ik, query_ig> / sqrt(d) + bias[k, g]
    s_ig   = <sink_ks, query_ig> / sqrt(d)                  (s = 1 .. S)
    gate_i = mean_g  1 / (1 + sum_s exp(s_ig - l_ig))  =  mean_g sigmoid(l_ig - logsumexp_s s_ig)

in (0, 1), trained with binary cross-entropy on KVzip's own score (max attention, in [0, 1]), every layer
jointly, so that one threshold across layers means the same thing in every layer. The scorer reads
``log gate`` (its exponential is the gate).

Tensors (L layers, KV heads H, group size G, rank d, sinks S, hidden D): ``q_weight`` (L, H*G*d, D),
``q_bias`` (L, H*G*d), ``k_weight`` (L, H*d, D), ``q_norm`` and ``k_norm`` (L, d), ``sink_keys``
(L, H, S, d), ``gate_bias`` (L, H, G).
"""

from __future__ import annotations

import torch

GATE_TENSORS = ("q_weight", "q_bias", "k_weight", "q_norm", "k_norm", "sink_keys", "gate_bias")
RMS_EPS = 1e-6


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight


def gate_log_scores(tensors: dict[str, torch.Tensor], layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
    """hidden: (B, n, D) -> (B, H, n) float32 log of the gate (differentiable in the tensors)."""
    sinks = tensors["sink_keys"][layer_idx].float()  # (H, S, d)
    bias = tensors["gate_bias"][layer_idx].float()  # (H, G)
    heads, groups, rank = sinks.shape[0], bias.shape[1], sinks.shape[-1]
    h = hidden.float()
    bsz, n = h.shape[:2]
    q = h @ tensors["q_weight"][layer_idx].float().T + tensors["q_bias"][layer_idx].float()
    q = _rms_norm(q.view(bsz, n, heads, groups, rank), tensors["q_norm"][layer_idx].float())
    k = _rms_norm(
        (h @ tensors["k_weight"][layer_idx].float().T).view(bsz, n, heads, rank), tensors["k_norm"][layer_idx].float()
    )
    own = torch.einsum("bnhr,bnhgr->bnhg", k, q) / rank**0.5 + bias  # (B, n, H, G)
    sink = torch.einsum("hsr,bnhgr->bnhgs", sinks, q) / rank**0.5  # (B, n, H, G, S)
    log_gate = torch.nn.functional.logsigmoid(own - torch.logsumexp(sink, dim=-1))  # (B, n, H, G)
    mean_gate = torch.logsumexp(log_gate, dim=-1) - torch.log(torch.tensor(float(groups)))  # log mean_g
    return mean_gate.transpose(1, 2)


def init_gate(layers: int, hidden: int, heads: int, groups: int, rank: int = 16, sinks: int = 16, seed: int = 0):
    """Initial gate tensors (small random projections, zero sinks and biases), float32, requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    scale = hidden**-0.5

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    return {
        "q_weight": rand(layers, heads * groups * rank, hidden),
        "q_bias": torch.zeros(layers, heads * groups * rank, requires_grad=True),
        "k_weight": rand(layers, heads * rank, hidden),
        "q_norm": torch.ones(layers, rank, requires_grad=True),
        "k_norm": torch.ones(layers, rank, requires_grad=True),
        "sink_keys": (torch.randn(layers, heads, sinks, rank, generator=gen) * 0.02).requires_grad_(),
        "gate_bias": torch.zeros(layers, heads, groups, requires_grad=True),
    }
