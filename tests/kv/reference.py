"""Naive, loop-based reference implementations written from the formulas (not from pipeline.kv).

They are deliberately slow and explicit: one (row, head, entry) at a time, plain Python sorting.
"""

from __future__ import annotations

import math


def snapkv_reference(query, key, length, window, kernel, pooling, scaling):
    """Scores for ONE unpadded row. query (H_q, n, D), key (H_kv, n, D) -> list[H_kv][n] floats,
    with window entries = +inf."""
    h_q, n, _ = query.shape
    h_kv = key.shape[0]
    g = h_q // h_kv
    w = min(window, length)
    per_qhead = []
    for h in range(h_q):
        kh = h // g
        acc = [0.0] * n
        for qi in range(n - w, n):
            logits = [float(query[h, qi] @ key[kh, j]) * scaling if j <= qi else -math.inf for j in range(n)]
            m = max(logits)
            exps = [math.exp(x - m) if x > -math.inf else 0.0 for x in logits]
            z = sum(exps)
            for j in range(n):
                acc[j] += exps[j] / z / w
        # pool over non-window keys, zero padding
        base = [acc[j] if j < n - w else 0.0 for j in range(n)]
        pooled = []
        r = kernel // 2
        for j in range(n):
            neigh = [
                base[i] if 0 <= i < n else (0.0 if pooling == "avg" else -math.inf) for i in range(j - r, j + r + 1)
            ]
            pooled.append(sum(neigh) / kernel if pooling == "avg" else max(neigh))
        per_qhead.append(pooled)
    out = []
    for kh in range(h_kv):
        row = [sum(per_qhead[kh * g + i][j] for i in range(g)) / g for j in range(n)]
        for j in range(n - w, n):
            row[j] = math.inf
        out.append(row)
    return out


def value_norm_reference(value, o_weight, kv_head, groups, head_dim, p=1):
    """m_i = mean over the group's query heads h of ||V_i W_O^h||_p, one entry at a time."""
    n = value.shape[0]
    res = []
    for i in range(n):
        total = 0.0
        for g in range(groups):
            h = kv_head * groups + g
            w_h = o_weight[:, h * head_dim : (h + 1) * head_dim].double().T  # (D, hidden)
            proj = value[i].double() @ w_h
            total += float(proj.abs().sum()) if p == 1 else float(proj.pow(2).sum().sqrt())
        res.append(total / groups)
    return res


def topk_indices(values, k):
    """Indices of the k largest values (ties: lower index first)."""
    return sorted(sorted(range(len(values)), key=lambda i: -values[i])[:k])


def two_stage_reference(scores, norms, budget, window, alpha, eps):
    """CriticalKV selection for one head: scores (n,) with +inf window, norms (n,)."""
    n = len(scores)
    b1 = min(max(int(math.floor(budget * alpha)), window), budget)
    stage1 = set(topk_indices(scores, b1))
    rest = [i for i in range(n) if i not in stage1]
    crit = {i: (scores[i] + eps) * norms[i] for i in rest}
    stage2 = sorted(rest, key=lambda i: -crit[i])[: budget - b1]
    return sorted(stage1 | set(stage2))


def adakv_reference(scores, budget, alpha_safe):
    """AdaKV per-head counts for one row: scores (H, n) lists with +inf window."""
    h = len(scores)
    safe = int(math.floor(budget * alpha_safe))
    items = []
    for head in range(h):
        ranked = sorted(range(len(scores[head])), key=lambda i: -scores[head][i])
        guaranteed = set(ranked[:safe])
        for i, s in enumerate(scores[head]):
            items.append((math.inf if i in guaranteed else s, head, i))
    items.sort(key=lambda t: -t[0])
    counts = [0] * h
    for _, head, _ in items[: budget * h]:
        counts[head] += 1
    return counts


def streamingllm_reference(n, window, sink_tokens):
    """Scores for ONE unpadded row of n tokens: +inf on sinks and window, position + 1 elsewhere."""
    w = min(window, n)
    return [math.inf if (j < sink_tokens or j >= n - w) else float(j + 1) for j in range(n)]


def topk_reference(scores, budget):
    """Plain selection for one head: the ``budget`` largest scores (ties: lower index), never -inf."""
    valid = [i for i in range(len(scores)) if scores[i] > -math.inf]
    return sorted(sorted(valid, key=lambda i: -scores[i])[:budget])


def headkv_reference(priors, layer, budget, window, length, alpha):
    """HeadKV counts of one row for one layer, from the formula (loop-based water-filling)."""
    flat = [max(p, 0.0) for row in priors for p in row]
    total_p = sum(flat)
    count = len(flat)
    weight = [alpha + (1 - alpha) * (count * p / total_p if total_p > 0 else 1.0) for p in flat]
    pool, cap = budget * count, float(length)
    saturated = [False] * count
    while True:
        free = sum(w for w, s in zip(weight, saturated) if not s)
        c = (pool - cap * sum(saturated)) / free if free > 0 else 0.0
        newly = [i for i in range(count) if not saturated[i] and c * weight[i] > cap]
        if not newly:
            break
        for i in newly:
            saturated[i] = True
    alloc = [cap if s else c * w for w, s in zip(weight, saturated)]
    heads = len(priors[0])
    counts = [math.floor(a + 1e-9) for a in alloc[layer * heads : (layer + 1) * heads]]
    return [min(max(x, window), length) for x in counts]


def knorm_reference(key, window):
    """Scores for ONE unpadded row: softmax over positions of -||K_j||_2 / sqrt(D), window +inf."""
    h_kv, n, d = key.shape
    out = []
    for h in range(h_kv):
        logits = [-math.sqrt(sum(float(x) ** 2 for x in key[h, j])) / math.sqrt(d) for j in range(n)]
        m = max(logits)
        exps = [math.exp(x - m) for x in logits]
        z = sum(exps)
        out.append([math.inf if j >= n - min(window, n) else exps[j] / z for j in range(n)])
    return out


# ---------------------------------------------------------------------- per-part references
# Every registered part has one here (tests/kv/test_parts.py fails for a part without one).
# Scorers: (query (H_q, n, D), key (H_kv, n, D), value, window, config, scaling) -> [H_kv][n] for ONE unpadded row.
SCORER_REFERENCES = {
    "snapkv": lambda q, k, v, w, cfg, scaling: snapkv_reference(q, k, q.shape[1], w, cfg.kernel, cfg.pooling, scaling),
    "streamingllm": lambda q, k, v, w, cfg, scaling: [streamingllm_reference(k.shape[1], w, cfg.sink_tokens)]
    * k.shape[0],
    "knorm": lambda q, k, v, w, cfg, scaling: knorm_reference(k, w),
}
# Allocations: (scores [H][n], budget, window, length, config, priors [L][H] or None, layer) -> [H] counts.
ALLOCATION_REFERENCES = {
    "uniform": lambda s, b, w, n, cfg, priors, layer: [b] * len(s),
    "adakv": lambda s, b, w, n, cfg, priors, layer: adakv_reference(s, b, cfg.alpha_safeguard),
    "headkv": lambda s, b, w, n, cfg, priors, layer: headkv_reference(priors, layer, b, w, n, cfg.alpha_safeguard),
}
# Selections: (scores [n], value (n, D), o_weight, kv_head, groups, head_dim, budget, window, config) -> kept indices.
SELECTION_REFERENCES = {
    "topk": lambda s, v, o, k, g, d, b, w, cfg: topk_reference(s, b),
    "criticalkv": lambda s, v, o, k, g, d, b, w, cfg: two_stage_reference(
        s, value_norm_reference(v, o, k, g, d, p=1 if cfg.norm == "l1" else 2), b, w, cfg.first_stage_ratio, cfg.epsilon
    ),
}
