"""Calibrating the learned one-pass scorer (KVzap, arXiv 2601.07891) on the model itself.

Per calibration document (:mod:`pipeline.eval.kvzap_data`), :func:`document_targets`:

1. prefills the context as the engine encodes it (chat template, query-agnostic) while recording
   every layer's attention input h (B=1, n, hidden);
2. runs KVzip's context-reconstruction passes with KVzip+ weighting on the held dense cache (the
   engine's own passes, :mod:`pipeline.engine.reconstruction`): the true score per (layer, KV head,
   entry) ``max_{j,g} a_ji^g ||V_i W_O^g|| / ||h_j||``;
3. keeps ``sample_tokens`` random entries after the template prefix (KVzip's sinks, always kept) as
   (h_i, log score) pairs per layer, and, at each kept fraction of ``share_sizes``, what the global
   top-k of those scores over every layer and head (the ``layer`` allocation, window included) gives
   each (layer, KV head), divided by the mean head budget.

:func:`fit` then fits one predictor per layer on the training documents (``linear``: ridge
regression in closed form; ``mlp``: D -> width -> GELU -> H_kv, AdamW on the squared error; with
``positions``, plus a linear term in each entry's position and the row's length,
:func:`pipeline.kv.kvzap_model.position_features`, fitted jointly by the ridge), and
measures it on the held-out documents: R^2 of the log-scores, Spearman rank correlation per KV head
(mean), and the overlap of the predicted and true top 20 % per head. Shares are the mean over
every document, or with ``shares_by_length`` over the documents of each calibration length (one
table per length), of KVzip's counts or, with ``shares_target="predicted"``, of the counts that suit
the fitted predictors (:mod:`pipeline.eval.kvzap_shares`); the report says how far held-out
documents' own shares lie from either table, and how much of KVzip's global top the file keeps.
:func:`pipeline.engine.kvzap_file.write_kvzap` writes the result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from ..engine.types import Request
from ..kv.allocation import row_budgets
from ..kv.allocation.layer import layer_head_budgets
from ..kv.attention.registered import recorded_attention_inputs
from ..kv.compress import Compressor
from ..kv.config import CompressionConfig
from ..kv.kvzap_model import KVzapModel, position_features
from ..kv.scorers.common import SinkOptions, finalise
from .kvzap_shares import kept_of_global_top, predicted_shares

MIN_SCORE = 1e-12  # log of a zero score
REPORT_FRACTIONS = (0.1, 0.2, 0.4)  # kept fractions of the held-out report (the RULER sweeps' cache sizes)


@dataclass
class DocumentTargets:
    """One document's training pairs: hidden (L, m, hidden), log_scores (L, H_kv, m) float32 at the
    sampled prompt positions ``positions`` (m,), and shares (S, L, H_kv) (what the global top-k gave
    each head / the mean head budget)."""

    doc_id: str
    kind: str
    length: int
    hidden: torch.Tensor
    log_scores: torch.Tensor
    shares: torch.Tensor
    positions: torch.Tensor
    tokens: int = 0  # the row's length n (template included); 0: unknown, ``length`` stands in


def _global_shares(scores: list[torch.Tensor], key_pos: torch.Tensor, sizes: list[float], window: int):
    """(S, L, H_kv): the ``layer`` allocation's counts over the mean head budget, at each kept fraction."""
    lengths = (key_pos >= 0).sum(-1)
    out = []
    for size in sizes:
        budget, win = row_budgets(lengths, size, None, window)
        final = [finalise(s, key_pos, win) for s in scores]
        counts = torch.stack(layer_head_budgets(final, budget), dim=1)[0]  # (L, H_kv)
        out.append(counts.double() / float(budget[0]))
    return torch.stack(out).float()


@torch.inference_mode()
def document_targets(engine, doc: dict, sample_tokens: int, share_sizes: list[float], seed: int) -> DocumentTargets:
    """Training pairs of one calibration document (see the module docstring). ``engine`` prefills in one
    forward (``layerwise_prefill=0``): a layer-by-layer prefill records each layer's input a slice at a time."""
    if engine.context_prefill.layer_slice:
        raise ValueError("calibration targets need a one-forward prefill: load the model with layerwise_prefill=0")
    config = CompressionConfig(method="layer-kvzip", cache_size=0.5, kvzip_plus=True)
    request = Request(doc["doc_id"], doc["context"], ["Summarize."])
    rows = engine._rows_for(request)[:1]
    cache = engine.new_cache(Compressor(config))
    hidden: dict[int, torch.Tensor] = {}
    with recorded_attention_inputs(engine.model, hidden):
        engine.prefill(rows, cache, passes=False)
    held = cache.prefill.awaiting_passes  # every layer's dense prefill, for the passes run here (KVzip+)
    scores = engine.reconstruction.scores(
        [rows[0].prompt.context_ids], [rows[0].prompt.prefix_tokens], held, config.reconstruction_chunk, True
    )
    key_pos = held[0].key_pos
    shares = _global_shares(scores, key_pos, share_sizes, config.window)
    prefix, n = rows[0].prompt.prefix_tokens, key_pos.shape[1]
    candidates = [i for i in range(n) if int(key_pos[0, i]) >= prefix]
    picked = sorted(random.Random(f"{seed}/{doc['doc_id']}").sample(candidates, min(sample_tokens, len(candidates))))
    index = torch.tensor(picked, device=key_pos.device)
    layers = range(engine.shape.num_layers)
    h = torch.stack([hidden[i][0, index].float().cpu() for i in layers])
    y = torch.stack([scores[i][0][:, index].clamp(min=MIN_SCORE).log().cpu() for i in layers])
    return DocumentTargets(doc["doc_id"], doc["kind"], doc["length"], h, y, shares, index.cpu(), n)


# --------------------------------------------------------------------------- fitting


def ridge(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression with an intercept, in float64. x: (N, D), y: (N, H) -> weight (H, D), bias (H,).
    ``alpha`` is relative to the mean diagonal of the centred Gram matrix (scale-free)."""
    x, y = x.double(), y.double()
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    gram = xc.T @ xc
    reg = alpha * float(gram.diagonal().mean())
    weight = torch.linalg.solve(gram + reg * torch.eye(gram.shape[0], dtype=gram.dtype), xc.T @ yc).T
    return weight.float(), (my - weight.double() @ mx).float()


def train_mlp(x: torch.Tensor, y: torch.Tensor, width: int, epochs: int, seed: int) -> dict[str, torch.Tensor]:
    """D -> width -> GELU -> H MLP on the squared error (AdamW lr 5e-3, batch 512, as KVzap's training)."""
    gen = torch.Generator().manual_seed(seed)
    mlp = torch.nn.Sequential(torch.nn.Linear(x.shape[1], width), torch.nn.GELU(), torch.nn.Linear(width, y.shape[1]))
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.0))
        mlp[2].bias.copy_(y.mean(0))
    opt = torch.optim.AdamW(mlp.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    with torch.enable_grad(), torch.inference_mode(False):
        for _ in range(epochs):
            for batch in torch.randperm(x.shape[0], generator=gen).split(512):
                loss = torch.nn.functional.mse_loss(mlp(x[batch]), y[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
    w1, b1, w2, b2 = (p.detach().clone() for p in mlp.parameters())
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}


def _ranks(v: torch.Tensor) -> torch.Tensor:
    return v.argsort(dim=-1).argsort(dim=-1).double()


def fit_quality(pred: torch.Tensor, true: torch.Tensor, top: float = 0.2) -> dict:
    """pred / true: (H, N) log-scores of held-out entries -> R^2 (over all), mean Spearman and
    mean top-``top`` overlap over heads."""
    pred, true = pred.double(), true.double()
    r2 = 1.0 - float(((pred - true) ** 2).sum() / ((true - true.mean(-1, keepdim=True)) ** 2).sum())
    rp, rt = _ranks(pred), _ranks(true)
    rp, rt = rp - rp.mean(-1, keepdim=True), rt - rt.mean(-1, keepdim=True)
    spearman = (rp * rt).sum(-1) / (rp.norm(dim=-1) * rt.norm(dim=-1)).clamp(min=1e-12)
    k = max(1, int(round(top * pred.shape[-1])))
    overlap = [len(set(p.topk(k).indices.tolist()) & set(t.topk(k).indices.tolist())) / k for p, t in zip(pred, true)]
    return {
        "r2": round(r2, 4),
        "spearman": round(float(spearman.mean()), 4),
        "top20_overlap": round(sum(overlap) / len(overlap), 4),
    }


def _layer_data(targets: list[DocumentTargets], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat([t.hidden[layer] for t in targets])
    y = torch.cat([t.log_scores[layer].T for t in targets])
    return x, y


def _position_data(targets: list[DocumentTargets]) -> torch.Tensor:
    """(N, 3) position features of every sampled entry, in :func:`_layer_data`'s order."""
    return torch.cat([_doc_positions(t) for t in targets])


def _doc_positions(t: DocumentTargets) -> torch.Tensor:
    return position_features(t.positions[None].to(torch.long), torch.tensor([t.tokens or t.length]))[0]


def fit(
    train: list[DocumentTargets],
    held_out: list[DocumentTargets],
    share_sizes: list[float],
    kind: str = "linear",
    alpha: float = 1e-3,
    mlp_width: int = 512,
    mlp_epochs: int = 15,
    seed: int = 0,
    progress=None,
    shares_by_length: bool = False,
    shares_target: str = "kvzip",
    positions: bool = False,
) -> tuple[KVzapModel, dict]:
    """The predictors of every layer and the shares (one table, or one per calibration length with
    ``shares_by_length``), plus the held-out fit report ``{"layers": [{layer, r2, spearman,
    top20_overlap}], "mean": {...}, "per_kind": {...}, "shares_error": {...}, "kept_top": {...}}``
    (:func:`kept_report`). ``shares_target``:
    ``kvzip`` (each head's count in KVzip's global top-k of the true scores) or ``predicted`` (the
    counts that keep the most true score when each head keeps its predicted top entries,
    :mod:`pipeline.eval.kvzap_shares`; computed with the fitted predictors). ``positions``: the
    predictors add a term in the entry's position and the row's length (``position_weight``)."""
    if shares_target not in ("kvzip", "predicted"):
        raise ValueError(f"shares_target must be 'kvzip' or 'predicted', got {shares_target!r}")
    layers = train[0].hidden.shape[0]
    tensors = _fit_predictors(train, kind, alpha, (mlp_width, mlp_epochs), seed, progress, positions)
    sizes = torch.tensor(share_sizes, dtype=torch.float32)
    model = KVzapModel(kind, tensors, train[0].shares, sizes)  # predictors only, for the predicted targets
    if shares_target == "predicted":
        train = [_predicted_targets(model, t, share_sizes) for t in train]
        held_out = [_predicted_targets(model, t, share_sizes) for t in held_out]
    if shares_by_length:
        tables, lengths = length_shares(train + held_out)
        model = KVzapModel(kind, tensors, tables, sizes, lengths)
    else:
        model = KVzapModel(kind, tensors, torch.stack([t.shares for t in train + held_out]).mean(0), sizes)
    report = [{"layer": layer, **_quality(model, held_out, layer)} for layer in range(layers)]
    kinds = sorted({t.kind for t in held_out})
    per_kind = {k: _mean_quality(model, [t for t in held_out if t.kind == k]) for k in kinds}
    fit_report = {"layers": report, "mean": _mean_of(report), "per_kind": per_kind}
    shares_report = {"shares_error": shares_error(train, held_out), "kept_top": kept_report(model, held_out)}
    return model, {**fit_report, **shares_report, "shares_target": shares_target}


def _fit_predictors(train, kind, alpha, mlp, seed, progress, positions) -> dict[str, torch.Tensor]:
    """One predictor per layer on the training documents' pairs: the stacked tensors of KVzapModel.
    mlp: (width, epochs). With ``positions`` the ridge fits h and the position features jointly; an
    MLP then learns what the position term leaves."""
    per_layer: dict[str, list[torch.Tensor]] = {}
    features = _position_data(train) if positions else None
    for layer in range(train[0].hidden.shape[0]):
        x, y = _layer_data(train, layer)
        position = {}
        if features is not None:
            weight, bias = ridge(torch.cat([x, features], dim=1), y, alpha)
            linear = {"weight": weight[:, : x.shape[1]], "bias": bias}
            position = {"position_weight": weight[:, x.shape[1] :]}
            y = y - features @ position["position_weight"].T
        elif kind == "linear":
            linear = dict(zip(("weight", "bias"), ridge(x, y, alpha)))
        params = linear if kind == "linear" else train_mlp(x, y, mlp[0], mlp[1], seed + layer)
        params = {**params, **position}
        for name, tensor in params.items():
            per_layer.setdefault(name, []).append(tensor)
        if progress is not None:
            progress(f"layer {layer}: fitted on {x.shape[0]} entries")
    return {name: torch.stack(ts) for name, ts in per_layer.items()}


def _predicted_targets(model: KVzapModel, doc: DocumentTargets, sizes: list[float]) -> DocumentTargets:
    """``doc`` with its predictor-aware shares in place of KVzip's (every head also keeps the default
    sinks and window, as the ``shares`` allocation's heads do)."""
    n, fixed = doc.tokens or doc.length, _fixed_entries()
    shares = predicted_shares(model, doc.hidden, doc.log_scores, sizes, n, fixed, doc.positions)
    return replace(doc, shares=shares)


def _fixed_entries() -> int:
    """Entries every head keeps whatever its count (the default window and sinks)."""
    return CompressionConfig.model_fields["window"].default + SinkOptions.model_fields["sink_tokens"].default


def kept_report(model: KVzapModel, held_out: list[DocumentTargets], fractions=REPORT_FRACTIONS) -> dict:
    """Per held-out length and kept fraction, the mean over documents of (kept true score / the
    global top's, share of KVzip's global top entries kept) with this file's predictors and shares
    (:func:`pipeline.eval.kvzap_shares.kept_of_global_top`): ``{n: {f: {"score", "entries"}}}``."""
    out: dict[str, dict] = {}
    for n in sorted({t.length for t in held_out}):
        docs = [t for t in held_out if t.length == n]
        fixed = _fixed_entries()
        rows = [
            kept_of_global_top(model, t.hidden, t.log_scores, fractions, t.tokens or t.length, fixed, t.positions)
            for t in docs
        ]
        per = {
            str(f): {k: round(sum(r[j][i] for r in rows) / len(rows), 4) for i, k in enumerate(("score", "entries"))}
            for j, f in enumerate(fractions)
        }
        out[str(n)] = per
    return out


def length_shares(docs: list[DocumentTargets]) -> tuple[torch.Tensor, torch.Tensor]:
    """One shares table per calibration length, the mean over that length's documents:
    (N, S, L, H_kv) and the lengths (N,) ascending."""
    lengths = sorted({t.length for t in docs})
    tables = [torch.stack([t.shares for t in docs if t.length == n]).mean(0) for n in lengths]
    return torch.stack(tables), torch.tensor(lengths, dtype=torch.float32)


def _relative_l1(shares: torch.Tensor, table: torch.Tensor) -> float:
    """Mean over kept fractions of sum |shares - table| / sum shares; both (S, L, H_kv)."""
    return float(((shares - table).abs().sum((1, 2)) / shares.sum((1, 2))).mean())


def shares_error(train: list[DocumentTargets], held_out: list[DocumentTargets]) -> dict:
    """How far each held-out document's own global top-k shares lie from the tables fitted on the
    training documents, as the share of its budget that would go to other heads (relative L1, mean
    over kept fractions and documents), per length: ``{"per_length": {n: e}, "pooled": {n: e}}``
    (one table per length, ``shares_by_length``, against one table over every length)."""
    pooled = torch.stack([t.shares for t in train]).mean(0)
    tables, lengths = length_shares(train)
    by_length = dict(zip(lengths.int().tolist(), tables))
    out: dict[str, dict[str, float]] = {"per_length": {}, "pooled": {}}
    for n in sorted({t.length for t in held_out} & by_length.keys()):
        docs, table = [t for t in held_out if t.length == n], by_length[n]
        out["per_length"][str(n)] = round(sum(_relative_l1(t.shares, table) for t in docs) / len(docs), 4)
        out["pooled"][str(n)] = round(sum(_relative_l1(t.shares, pooled) for t in docs) / len(docs), 4)
    return out


def _quality(model: KVzapModel, docs: list[DocumentTargets], layer: int) -> dict:
    """:func:`fit_quality` over every held-out entry pooled, plus ``spearman_in_document``: the mean over
    documents of the Spearman correlation inside each (the ranking a head's selection starts from)."""
    _, y = _layer_data(docs, layer)
    per_doc = [_doc_prediction(model, t, layer) for t in docs]
    inside = [fit_quality(p, t.log_scores[layer])["spearman"] for p, t in zip(per_doc, docs)]
    return {**fit_quality(torch.cat(per_doc, dim=-1), y.T), "spearman_in_document": round(sum(inside) / len(inside), 4)}


def _doc_prediction(model: KVzapModel, t: DocumentTargets, layer: int) -> torch.Tensor:
    """(H_kv, m) the file's predicted log-scores of one document's sampled entries at one layer."""
    lengths = torch.tensor([t.tokens or t.length])
    return model.predict(layer, t.hidden[layer][None], t.positions[None].to(torch.long), lengths)[0]


def _mean_of(rows: list[dict]) -> dict:
    keys = ("r2", "spearman", "top20_overlap", "spearman_in_document")
    return {k: round(sum(r[k] for r in rows) / len(rows), 4) for k in keys}


def _mean_quality(model: KVzapModel, docs: list[DocumentTargets]) -> dict:
    return _mean_of([_quality(model, docs, layer) for layer in range(model.num_layers)])
