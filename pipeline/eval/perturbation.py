"""Perturbation diagnostics: how much does each method's kept set change the attention output?

This is the analysis of the CriticalKV paper (arXiv 2502.03805, section 3) run on a real model:
for one context and a set of *later query positions* (question tokens, or the next tokens of the
context itself), every method compresses the same prefill, and we measure, per layer and KV head,
how far the attention output of the later queries moves when the context part of the cache is
reduced to that method's kept entries.

How it is computed (no monkey-patching; transformers' public extension points only):

1. One full forward over ``context + later`` with the recording attention
   (:func:`pipeline.kv.attention.registered.register_recording`): it computes the ordinary causal attention
   (SDPA) and hands the layer's post-RoPE ``q, k, v`` to a recorder, which analyses the layer on
   the spot and keeps only small results (memory: one layer's attention maps of the later queries,
   plus each method's compressed K/V).
2. Per layer, every method's :class:`~pipeline.kv.compress.Compressor` runs
   ``compress_layer(layer, module, q[:n], k[:n], v[:n], positions, scaling)`` on the context part
   of the captured tensors -- exactly the call :class:`~pipeline.kv.storage.cache.VarLenCache` makes after
   a prefill -- and its keep mask (H_kv, n) defines the kept set S of every KV head. Later tokens
   are never evicted (they arrive after compression), so S always contains them.
3. :class:`LayerProbe` evaluates the kept sets against the full-cache attention of two sets of
   queries (fp32, with the queries of the *full* forward, so each layer's perturbation is measured in
   isolation, as in the paper): ``probe="later"``, the later tokens (what compression is for: queries
   the selection never saw), and ``probe="window"``, the last ``window`` context queries (the SnapKV
   observation window whose attention the selection estimates A from: the in-sample view).
4. Hidden-state deviation (end to end): the kept entries are copied into a
   :class:`~pipeline.kv.storage.cache.VarLenCache` (``VarLenLayer.from_dense``, as the cache does), the later
   tokens are run through the model with the registered ``criticalkv_varlen`` attention, and the
   final (post-norm) hidden states are compared with the same run on a keep-everything cache.

Formulas (per layer, per query head h of KV head k, per later query t; A = full-cache softmax
attention of t over every key it can see, m_{h,i} = ||V_i W_O^h||_1 with W_O^h the (D x hidden)
slice of ``o_proj`` that multiplies head h, Â = softmax restricted to the kept set S):

* ``perturbation``        mean_{h in group, t} || (o_{h,t} - ô_{h,t}) W_O^h ||_1,
                          with o - ô = (A - Â) V computed directly (exactly 0 when S keeps all).
* ``group_perturbation``  mean_t || sum_{h in group} (o_{h,t} - ô_{h,t}) W_O^h ||_1: the change this
                          KV head's group really writes into the residual stream.
* ``bound``               the paper's upper bound, in its exact form. With a = sum_{i in S} A_i,
                          Â_i = A_i / a on S, so  o - ô = sum_{i not in S} A_i V_i - (1-a)/a sum_{i in S} A_i V_i
                          and by the triangle inequality, per (h, t),

                              ||(o - ô) W_O^h||_1 <= E + (1 - a)/a * K
                                                   =  C - (2 - 1/a) K,

                          E = sum_{i not in S} A_i m_i (evicted term), K = sum_{i in S} A_i m_i,
                          C = E + K. This is a rigorous bound (>= perturbation up to float rounding),
                          averaged over (h, t) like ``perturbation``.
* ``evicted_term``        mean_{h,t} E: the first-order term the method tries to make small; for
                          S with most of the attention mass (a -> 1) the bound is E (1 + O(1 - a)).
* ``evicted_mass``        mean_{h,t} (1 - a).
* ``proxy_objective``     sum_{i in context, not in S} (s_i + eps) * mbar_i with s the SnapKV window
                          score and mbar_i the group mean of m_{h,i}: the estimate of E that CriticalKV's
                          stage 2 actually minimises (NaN for non-SnapKV scorers).
* ``hidden_deviation``    mean_t ||ĥ_t - h_t||_2 / ||h_t||_2 over the later queries, h = final
                          (post-norm) hidden state with the full cache; ``top1_agreement``: fraction of t
                          where lm_head(ĥ_t) and lm_head(h_t) have the same argmax. Both are per
                          (document, method) and repeated on that method's rows.

Output: a long-format :class:`pyarrow.Table` (:data:`SCHEMA`), one row per
(doc_id, probe, method, cache_size, layer, kv_head); ``hidden_deviation`` / ``top1_agreement``
are null on ``window`` rows and ``query_tokens`` is the probe's query count;
``base_method`` is the method with its selection replaced by ``topk`` (so ``snapkv`` and
``criticalkv-snapkv`` share ``base_method="snapkv"``), which makes "CriticalKV vs its base" a
self-join. :func:`pipeline.report.perturbation.headline` computes, per probe, the fraction of
(document, layer, KV head) where a ``criticalkv-X`` method has a strictly lower ``perturbation``
than ``X``.

Limits: batch 1 (one document per forward), full causal attention (models whose config sets a
sliding window shorter than the sequence are refused), no decode-time cap (``max_cache_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import pyarrow as pa
import torch

from ..engine.priors import load_head_priors
from ..kv.allocation import row_budgets
from ..kv.attention.registered import register as register_varlen_attention
from ..kv.attention.registered import register_recording
from ..kv.compress import Compressor
from ..kv.config import CompressionConfig, ScoringKnobs, method_name
from ..kv.phases import Phase
from ..kv.rope import model_rotary
from ..kv.scorers.snapkv import snapkv_scores
from ..kv.storage.cache import VarLenCache, run_chunk
from ..kv.storage.store import VarLenLayer
from ..kv.value_norms import OutputProjection
from .perturbation_docs import Document
from .perturbation_probe import HeadStats, LayerProbe

_REFERENCE = "__full__"

SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("query_kind", pa.string()),
        ("probe", pa.string()),
        ("model", pa.string()),
        ("method", pa.string()),
        ("base_method", pa.string()),
        ("criticalkv", pa.bool_()),
        ("cache_size", pa.float64()),
        ("context_tokens", pa.int32()),
        ("query_tokens", pa.int32()),
        ("layer", pa.int32()),
        ("kv_head", pa.int32()),
        ("kept", pa.int32()),
        ("perturbation", pa.float64()),
        ("group_perturbation", pa.float64()),
        ("bound", pa.float64()),
        ("evicted_term", pa.float64()),
        ("evicted_mass", pa.float64()),
        ("proxy_objective", pa.float64()),
        ("hidden_deviation", pa.float64()),
        ("top1_agreement", pa.float64()),
    ]
)


# --------------------------------------------------------------------------- per-document analysis


def base_method(config: CompressionConfig) -> str:
    """The method with plain top-k selection: ``criticalkv-adakv-snapkv`` -> ``adakv-snapkv``."""
    return method_name(config.scorer, config.allocation)


def method_configs(
    methods: Sequence[str], cache_sizes: float | Sequence[float], knobs: ScoringKnobs | None = None
) -> dict[str, CompressionConfig]:
    """One validated :class:`CompressionConfig` per (method, cache size), keyed ``"method@size"``,
    with ``knobs`` (window, pooling, epsilon, priors ...; of a whole config, its scoring knobs only:
    the diagnostics take no decode-time cap, question or chunked prefill)."""
    sizes = [cache_sizes] if isinstance(cache_sizes, (int, float)) else list(cache_sizes)
    knobs = knobs or ScoringKnobs()
    scoring = ScoringKnobs.model_validate(knobs.model_dump(include=set(ScoringKnobs.model_fields)))
    return {f"{m}@{cs:g}": scoring.setting(m, cs) for cs in sizes for m in methods}


class _Recorder:
    """Analyses each layer as the capture forward reaches it (see module docstring, steps 2-3)."""

    def __init__(self, compressors: dict[str, Compressor], context_tokens: int, window_queries: int) -> None:
        self.compressors = compressors
        self.n = context_tokens
        self.window_queries = min(window_queries, context_tokens)
        self.results: dict[str, list[tuple[int, torch.Tensor, dict[str, HeadStats], torch.Tensor]]] = {
            m: [] for m in compressors
        }
        self.layers: dict[str, dict[int, VarLenLayer]] = {m: {} for m in [*compressors, _REFERENCE]}

    @torch.no_grad()
    def on_layer(self, module, query, key, value, scaling) -> None:
        idx = module.layer_idx
        n = self.n
        bsz, h_kv, total, dim = key.shape
        if bsz != 1:
            raise ValueError("perturbation diagnostics run one document at a time (batch 1)")
        q_ctx, k_ctx, v_ctx = query[:, :, :n], key[:, :, :n], value[:, :, :n]
        positions = torch.arange(n, device=key.device)[None]
        proj = OutputProjection.from_weight(module.o_proj.weight, h_kv, dim)
        probe = LayerProbe(query[0, :, n:], key[0], value[0], torch.arange(n, total, device=key.device), proj, scaling)
        probes = {"later": probe}
        w = self.window_queries
        if w > 0:
            probes["window"] = LayerProbe(
                query[0, :, n - w : n],
                k_ctx[0],
                v_ctx[0],
                torch.arange(n - w, n, device=key.device),
                proj,
                scaling,
                norms=probe.norms[:, :, :n],
            )
        mean_norms = probe.norms[:, :, :n].mean(1)  # (H_kv, n), group mean as in the method
        later = torch.ones(h_kv, total - n, dtype=torch.bool, device=key.device)
        scores_cache: dict[tuple, torch.Tensor] = {}
        for name, compressor in self.compressors.items():
            cfg = compressor.config
            observed = compressor.observe(q_ctx, positions, idx)
            keep = compressor.compress_observed(idx, module, observed, k_ctx, v_ctx, positions, scaling).keep
            stats = {"later": probe.evaluate(torch.cat([keep[0], later], dim=-1))}
            if "window" in probes:
                stats["window"] = probes["window"].evaluate(keep[0])
            proxy = torch.full((h_kv,), float("nan"), dtype=torch.float64)
            if cfg.scorer == "snapkv":
                skey = (cfg.cache_size, cfg.budget, cfg.window, cfg.kernel, cfg.pooling)
                if skey not in scores_cache:
                    _, row_w = row_budgets(torch.tensor([n], device=key.device), cfg.cache_size, cfg.budget, cfg.window)
                    scores_cache[skey] = snapkv_scores(
                        q_ctx, k_ctx, positions, row_w, cfg.kernel, cfg.pooling, scaling
                    )[0]
                s = scores_cache[skey]
                evicted = ~keep[0]
                weight = torch.where(
                    evicted, s.clamp(min=0).nan_to_num(0.0, posinf=0.0) + cfg.epsilon, torch.zeros_like(s)
                )
                proxy = (weight * mean_norms).sum(-1).double().cpu()
            self.results[name].append((idx, keep[0].sum(-1).cpu(), stats, proxy))
            self.layers[name][idx] = VarLenLayer.from_dense(k_ctx, v_ctx, positions, keep)
        full = torch.ones(1, h_kv, n, dtype=torch.bool, device=key.device)
        self.layers[_REFERENCE][idx] = VarLenLayer.from_dense(k_ctx, v_ctx, positions, full)


def _check_inputs(model, configs: dict[str, CompressionConfig], n: int, t: int) -> None:
    if n == 0 or t == 0:
        raise ValueError("need a non-empty context and at least one later query token")
    _check_model(model, n + t)
    for name, cfg in configs.items():
        if cfg.phase is not Phase.LAYER:
            raise ValueError(
                f"{name}: the diagnostics analyse each layer as the forward reaches it; methods that "
                "decide across layers or need reconstruction passes are not supported"
            )
        if cfg.max_cache_tokens is not None or cfg.query_aware:
            raise ValueError(
                f"{name}: the diagnostics measure prefill compression only (no max_cache_tokens / query_aware)"
            )


def _check_model(model, total: int) -> None:
    window = getattr(model.config, "sliding_window", None)
    if window is not None and getattr(model.config, "use_sliding_window", True) and window < total:
        raise ValueError(
            f"model uses sliding-window attention ({window} tokens) shorter than the sequence ({total}); "
            "the diagnostics assume full causal attention"
        )


def _load_priors(cfg: CompressionConfig, model) -> torch.Tensor | None:
    if cfg.head_priors is None or not cfg.needs_head_priors:
        return None
    c = model.config
    return load_head_priors(
        cfg.head_priors, c.num_hidden_layers, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    )


def _run_later(
    model, layers: dict[int, VarLenLayer], compressor: Compressor, later: torch.Tensor, n: int
) -> torch.Tensor:
    """Final hidden states (T, hidden) of the later tokens over a cache holding ``layers``."""
    cache = VarLenCache.from_layers([layers[i] for i in range(model.config.num_hidden_layers)], compressor)
    pos = torch.arange(n, n + later.shape[-1], device=later.device)[None]
    return run_chunk(model.base_model, cache, later[None], pos).last_hidden_state[0].float()


@torch.inference_mode()
def analyse_document(
    model: torch.nn.Module,
    context_ids: Sequence[int] | torch.Tensor,
    query_ids: Sequence[int] | torch.Tensor,
    configs: dict[str, CompressionConfig],
    doc_id: str = "doc",
    query_kind: str = "question",
    model_name: str = "",
    window_queries: int | None = None,
) -> pa.Table:
    """Perturbation diagnostics of every method in ``configs`` on one document (:data:`SCHEMA` rows).

    context_ids: the context that is prefilled and compressed (n tokens); query_ids: the later
    tokens (T >= 1) whose attention is measured, at positions n .. n+T-1. ``configs`` maps any
    unique label to a :class:`CompressionConfig` (see :func:`method_configs`; the ``method`` and
    ``cache_size`` columns come from the config, so several cache sizes share one capture forward);
    HeadKV priors are read from each config's ``head_priors``. ``window_queries`` (default: the
    largest ``window`` of the configs): how many of the context's last queries form the in-sample
    ``probe="window"`` rows (0 = none). The model's attention implementation is restored afterwards.
    """
    device = next(model.parameters()).device
    ctx = torch.as_tensor(context_ids, dtype=torch.long, device=device).reshape(-1)
    later = torch.as_tensor(query_ids, dtype=torch.long, device=device).reshape(-1)
    n, t = ctx.numel(), later.numel()
    _check_inputs(model, configs, n, t)
    rotary = model_rotary(model)
    compressors = {name: Compressor(cfg, _load_priors(cfg, model), rotary) for name, cfg in configs.items()}
    if window_queries is None:
        window_queries = max((cfg.window for cfg in configs.values()), default=0)
    recorder = _Recorder(compressors, n, window_queries)
    previous = model.config._attn_implementation
    rows: dict[str, list] = {f.name: [] for f in SCHEMA}
    try:
        model.set_attn_implementation(register_recording())
        model.base_model(
            input_ids=torch.cat([ctx, later])[None],
            position_ids=torch.arange(n + t, device=device)[None],
            use_cache=False,
            attention_recorder=recorder,
        )
        model.set_attn_implementation(register_varlen_attention())
        end_to_end = _end_to_end(model, recorder, compressors, later, n)
        for name, cfg in configs.items():
            common = {
                "doc_id": doc_id,
                "query_kind": query_kind,
                "model": model_name,
                "method": cfg.method,
                "base_method": base_method(cfg),
                "criticalkv": cfg.selection == "criticalkv",
                "cache_size": float(cfg.cache_size),
                "context_tokens": n,
            }
            _method_rows(rows, common, recorder.results[name], end_to_end[name], t, recorder.window_queries)
    finally:
        model.set_attn_implementation(previous)
    return pa.Table.from_pydict(rows, schema=SCHEMA)


def _end_to_end(model, recorder, compressors: dict[str, Compressor], later: torch.Tensor, n: int) -> dict:
    """Per method (hidden deviation, top-1 agreement) of the later tokens vs the full cache."""
    h_ref = _run_later(model, recorder.layers[_REFERENCE], Compressor(CompressionConfig()), later, n)
    head = model.get_output_embeddings()
    top_ref = head(h_ref).argmax(-1)
    out = {}
    for name, compressor in compressors.items():
        h_hat = _run_later(model, recorder.layers[name], compressor, later, n)
        out[name] = (
            float(((h_hat - h_ref).norm(dim=-1) / h_ref.norm(dim=-1).clamp(min=1e-12)).mean()),
            float((head(h_hat).argmax(-1) == top_ref).float().mean()),
        )
    return out


def _method_rows(
    rows: dict[str, list],
    common: dict,
    results: list,
    end_to_end: tuple[float, float],
    later_tokens: int,
    window_queries: int,
) -> None:
    """Append one method's rows: per (layer, probe, KV head); ``end_to_end`` = (hidden deviation,
    top-1 agreement) of the later tokens, on the later-probe rows only."""
    for layer, kept, per_probe, proxy in results:
        for probe_name, stats in per_probe.items():
            later_probe = probe_name == "later"
            for k in range(kept.numel()):
                for key, value in common.items():
                    rows[key].append(value)
                rows["probe"].append(probe_name)
                rows["query_tokens"].append(later_tokens if later_probe else window_queries)
                rows["layer"].append(layer)
                rows["kv_head"].append(k)
                rows["kept"].append(int(kept[k]))
                for field in ("perturbation", "group_perturbation", "bound", "evicted_term", "evicted_mass"):
                    rows[field].append(float(getattr(stats, field)[k]))
                rows["proxy_objective"].append(float(proxy[k]))
                rows["hidden_deviation"].append(end_to_end[0] if later_probe else None)
                rows["top1_agreement"].append(end_to_end[1] if later_probe else None)


# --------------------------------------------------------------------------- runs and summaries


def run_perturbation(
    model: torch.nn.Module,
    documents: Iterable[Document],
    configs: dict[str, CompressionConfig],
    model_name: str = "",
    progress: Callable[[str], None] | None = None,
    window_queries: int | None = None,
) -> pa.Table:
    """:func:`analyse_document` over several documents, concatenated."""
    tables = []
    for doc in documents:
        tables.append(
            analyse_document(
                model, doc.context_ids, doc.query_ids, configs, doc.doc_id, doc.query_kind, model_name, window_queries
            )
        )
        if progress is not None:
            progress(f"{doc.doc_id}: {len(doc.context_ids)} context + {len(doc.query_ids)} query tokens done")
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()
