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


def stage1_reference(cfg) -> float:
    """CriticalKV's stage-1 ratio as documented: the knob, else 0.75 for the kvzap scorer (its scores
    weigh the value norm already), else the paper's 0.5."""
    if cfg.first_stage_ratio is not None:
        return cfg.first_stage_ratio
    return 0.75 if cfg.scorer == "kvzap" else 0.5


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


def layer_reference(scores, budget):
    """Cross-layer counts of one row: the L * H * budget best entries over all layers and heads
    (ties: earlier layer, head, position), counted per (layer, head)."""
    items = [
        (-s, layer, head, j)
        for layer, heads in enumerate(scores)
        for head, row in enumerate(heads)
        for j, s in enumerate(row)
        if s > -math.inf
    ]
    items.sort()
    counts = [[0] * len(heads) for heads in scores]
    for _, layer, head, _ in items[: budget * len(scores) * len(scores[0])]:
        counts[layer][head] += 1
    return counts


def defensivekv_reference(query, key, window, kernel, scaling):
    """Scores for ONE unpadded row: per KV head, max over the group's query heads and the last
    ``window`` queries of their causal attention (window keys dropped, avg-pooled, pooled mass
    restored), clamped from below at its mean over the non-window keys; window +inf."""
    h_q, n, _ = query.shape
    h_kv = key.shape[0]
    g = h_q // h_kv
    w = min(window, n)
    keys = n - w
    out = []
    for kh in range(h_kv):
        best = [-math.inf] * keys
        for h in range(kh * g, (kh + 1) * g):
            for qi in range(n - w, n):
                logits = [float(query[h, qi] @ key[kh, j]) * scaling if j <= qi else -math.inf for j in range(n)]
                m = max(logits)
                exps = [math.exp(x - m) if x > -math.inf else 0.0 for x in logits]
                z = sum(exps)
                row = [exps[j] / z for j in range(keys)]
                if kernel > 1:
                    r = kernel // 2
                    pooled = [
                        sum(row[i] for i in range(j - r, j + r + 1) if 0 <= i < keys) / kernel for j in range(keys)
                    ]
                    total = sum(pooled)
                    row = [p * sum(row) / total for p in pooled] if total > 0 else pooled
                best = [max(a, b) for a, b in zip(best, row)]
        mean = sum(best) / max(keys, 1)
        out.append([max(b, mean) for b in best] + [math.inf] * w)
    return out


def rope_angles(position, dim, base=10000.0):
    """Angles of the standard RoPE at one position: [pos * base^(-2i/dim) for i < dim/2]."""
    return [position * base ** (-2 * i / dim) for i in range(dim // 2)]


def rope_matrix(angles, dim):
    """The D x D rotation of HF's half-split RoPE for these angles (pairs i, i + D/2)."""
    half = dim // 2
    r = [[0.0] * dim for _ in range(dim)]
    for i, a in enumerate(angles):
        c, s = math.cos(a), math.sin(a)
        r[i][i], r[i][i + half], r[i + half][i], r[i + half][i + half] = c, -s, s, c
    return r


def _matvec(m, v):
    return [sum(m[i][j] * v[j] for j in range(len(v))) for i in range(len(m))]


def expected_attention_reference(query, key, value, window, sinks, future, covariance, vnorm, eps, scaling_dim):
    """Scores for ONE unpadded row from post-RoPE queries at positions 0..n-1 (standard RoPE)."""
    h_q, n, d = query.shape
    h_kv = key.shape[0]
    g = h_q // h_kv
    rot = [rope_matrix(rope_angles(p, d), d) for p in range(n)]
    future_mean = [
        [sum(rope_matrix(rope_angles(n + f, d), d)[i][j] for f in range(future)) / future for j in range(d)]
        for i in range(d)
    ]
    out = []
    for kh in range(h_kv):
        per_head = []
        for h in range(kh * g, (kh + 1) * g):
            pre = [_matvec(list(map(list, zip(*rot[t]))), query[h, t].tolist()) for t in range(sinks, n)]
            mu = [sum(v[i] for v in pre) / len(pre) for i in range(d)]
            cov = [[sum((v[i] - mu[i]) * (v[j] - mu[j]) for v in pre) / len(pre) for j in range(d)] for i in range(d)]
            mu2 = _matvec(future_mean, mu)
            rc = [[sum(future_mean[i][a] * cov[a][b] for a in range(d)) for b in range(d)] for i in range(d)]
            cov2 = [[sum(rc[i][b] * future_mean[j][b] for b in range(d)) for j in range(d)] for i in range(d)]
            logits = []
            for j in range(n):
                k = key[kh, j].tolist()
                z = sum(a * b for a, b in zip(mu2, k)) / math.sqrt(scaling_dim)
                if covariance:
                    z += sum(k[a] * cov2[a][b] * k[b] for a in range(d) for b in range(d)) / (2 * scaling_dim)
                logits.append(z if j >= sinks else -math.inf)
            m = max(logits)
            exps = [math.exp(x - m) if x > -math.inf else 0.0 for x in logits]
            per_head.append([e / sum(exps) for e in exps])
        row = [sum(p[j] for p in per_head) / g for j in range(n)]
        if vnorm:
            row = [(x + eps) * math.sqrt(sum(float(t) ** 2 for t in value[kh, j])) for j, x in enumerate(row)]
        w = min(window, n)
        out.append([math.inf if (j < sinks or j >= n - w) else row[j] for j in range(n)])
    return out


def kvzap_position_term(position_weight, j, n):
    """A KVzap file's position term of the entry at position j of an n-token context: position_weight
    [3] . (log(1 + j), log(1 + (n - 1 - j)), log n)."""
    features = (math.log(1 + j), math.log(1 + max(n - 1 - j, 0)), math.log(n))
    return sum(w * f for w, f in zip(position_weight, features))


def kvzap_reference(hidden, weight, bias, window, sinks, position_weight=None):
    """KVzap's linear predictor for ONE unpadded row: hidden [n][D], weight [H][D], bias [H] and
    optionally position_weight [H][3] -> [H][n] exp(h . w + b (+ the position term)), +inf on the
    first ``sinks`` tokens and the window."""
    n = len(hidden)
    out = []
    for head, (w_h, b_h) in enumerate(zip(weight, bias)):
        row = []
        for j in range(n):
            logit = sum(x * y for x, y in zip(hidden[j], w_h)) + b_h
            if position_weight is not None:
                logit += kvzap_position_term(position_weight[head], j, n)
            row.append(math.exp(min(logit, 60.0)))
        out.append([math.inf if (j < sinks or j >= n - window) else row[j] for j in range(n)])
    return out


def _interpolated_table(points, tables, x):
    """Linear interpolation of [L][H] tables given at ascending ``points``, clamped at the ends."""
    if len(points) == 1:
        return tables[0]
    x = min(max(x, points[0]), points[-1])
    i = next((k for k in range(1, len(points)) if points[k] >= x), len(points) - 1)
    t = (x - points[i - 1]) / (points[i] - points[i - 1])
    return [[(1 - t) * a + t * b for a, b in zip(ra, rb)] for ra, rb in zip(tables[i - 1], tables[i])]


def shares_reference(sizes, shares, budget, window, length, share_lengths=None):
    """Shares allocation for one row: interpolate the shares at budget / length (per calibrated
    length, then in log length when ``share_lengths`` is given and shares is [N][S][L][H]), then
    split the pool L * H * budget as min(length, c * share) (saturating the largest first), floor,
    raise to the window."""
    if share_lengths is None:
        weights = _interpolated_table(sizes, shares, budget / length)
    else:
        per_length = [_interpolated_table(sizes, table, budget / length) for table in shares]
        weights = _interpolated_table([math.log(n) for n in share_lengths], per_length, math.log(length))
    flat = [max(x, 0.0) for row in weights for x in row]
    total = budget * len(flat)
    capped: set[int] = set()
    while True:
        free = sum(x for k, x in enumerate(flat) if k not in capped)
        c = (total - length * len(capped)) / free
        over = [k for k, x in enumerate(flat) if k not in capped and c * x > length]
        if not over:
            break
        capped.add(max(over, key=lambda k: flat[k]))
    alloc = [length if k in capped else c * x for k, x in enumerate(flat)]
    heads = len(weights[0])
    counts = [min(max(math.floor(a + 1e-9), window), length) for a in alloc]
    return [counts[layer * heads : (layer + 1) * heads] for layer in range(len(weights))]


# ---------------------------------------------------------------------- per-part references
# Every registered part has one here (tests/kv/test_parts.py fails for a part without one).
# Scorers: (query (H_q, n, D), key (H_kv, n, D), value, window, config, scaling, observed=the pass scores of
# a reconstruction scorer) -> [H_kv][n] for ONE unpadded row.
SCORER_REFERENCES = {
    "snapkv": lambda q, k, v, w, cfg, scaling, observed=None, **_: snapkv_reference(
        q, k, q.shape[1], w, cfg.kernel, cfg.pooling, scaling
    ),
    "streamingllm": lambda q, k, v, w, cfg, scaling, observed=None, **_: [
        streamingllm_reference(k.shape[1], w, cfg.sink_tokens)
    ]
    * k.shape[0],
    "knorm": lambda q, k, v, w, cfg, scaling, observed=None, **_: knorm_reference(k, w),
    "defensivekv": lambda q, k, v, w, cfg, scaling, observed=None, **_: defensivekv_reference(
        q, k, w, cfg.defensive_kernel, scaling
    ),
    "expected_attention": lambda q, k, v, w, cfg, scaling, observed=None, **_: expected_attention_reference(
        q,
        k,
        v,
        w,
        cfg.sink_tokens,
        cfg.future_positions,
        cfg.use_covariance,
        cfg.use_vnorm and cfg.selection != "criticalkv",
        cfg.vnorm_epsilon,
        q.shape[-1],
    ),
    "kvzap": lambda q, k, v, w, cfg, scaling, observed=None, hidden=None, kvzap=None: kvzap_reference(
        hidden, kvzap[0], kvzap[1], w, cfg.sink_tokens, *kvzap[2:]
    ),
    "kvzip": lambda q, k, v, w, cfg, scaling, observed=None, **_: [
        [math.inf if j >= len(row) - min(w, len(row)) else row[j] for j in range(len(row))] for row in observed
    ],
}
# Allocations: (scores [L][H][n], budget, window, length, config, priors [L][H],
# shares=(sizes, [S][L][H]) or (sizes, [N][S][L][H], lengths))
# -> [L][H] counts.
ALLOCATION_REFERENCES = {
    "uniform": lambda s, b, w, n, cfg, priors, **_: [[b] * len(layer) for layer in s],
    "adakv": lambda s, b, w, n, cfg, priors, **_: [adakv_reference(layer, b, cfg.alpha_safeguard) for layer in s],
    "headkv": lambda s, b, w, n, cfg, priors, **_: [
        headkv_reference(priors, i, b, w, n, cfg.alpha_safeguard) for i in range(len(s))
    ],
    "layer": lambda s, b, w, n, cfg, priors, **_: layer_reference(s, b),
    "shares": lambda s, b, w, n, cfg, priors, shares=None: shares_reference(shares[0], shares[1], b, w, n, *shares[2:]),
}
# Selections: (scores [n], value (n, D), o_weight, kv_head, groups, head_dim, budget, window, config) -> kept indices.
SELECTION_REFERENCES = {
    "topk": lambda s, v, o, k, g, d, b, w, cfg: topk_reference(s, b),
    "criticalkv": lambda s, v, o, k, g, d, b, w, cfg: two_stage_reference(
        s, value_norm_reference(v, o, k, g, d, p=1 if cfg.norm == "l1" else 2), b, w, stage1_reference(cfg), cfg.epsilon
    ),
}
