"""Perturbation diagnostics (pipeline.eval.perturbation) on random tensors and tiny random models.

* keeping everything gives exactly zero perturbation, bound and hidden deviation;
* LayerProbe equals a naive per-(query head, query) recomputation with masked softmax and W_O slices
  taken straight from o_proj;
* the bound is a true upper bound (triangle inequality), and equals the paper's C - (2 - 1/a) K;
* the hidden deviation equals the one measured through the real VarLenCache path (prefill through
  the compressing cache, then the later tokens), so the kept sets are the cache's own;
* the headline pairs criticalkv-X with X per (doc, layer, head).
"""

import pyarrow as pa
import pytest
import torch

from pipeline.eval.perturbation import SCHEMA, analyse_document, base_method, method_configs
from pipeline.eval.perturbation_docs import continuation_documents
from pipeline.eval.perturbation_probe import LayerProbe, group_l1_norms
from pipeline.kv.attention.registered import register
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from pipeline.kv.value_norms import OutputProjection, exact_l1_norms
from pipeline.report.perturbation import headline
from tests.tiny import tiny_model, tiny_tokenizer

METHODS = ["snapkv", "criticalkv-snapkv", "adakv-snapkv", "criticalkv-adakv-snapkv"]
BASE = CompressionConfig(window=4, kernel=3)


def _random_layer(seed, h_q=6, h_kv=2, t=5, n=40, d=8, hidden=24):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(h_q, t, d, generator=g) * 2
    key = torch.randn(h_kv, n, d, generator=g) * 2
    value = torch.randn(h_kv, n, d, generator=g)
    o_weight = torch.randn(hidden, h_q * d, generator=g)
    query_pos = torch.arange(n - t, n)
    keep = torch.rand(h_kv, n, generator=g) < 0.3
    keep[:, n - t :] = True  # later tokens are never evicted
    return query, key, value, o_weight, query_pos, keep


def _naive(query, key, value, o_weight, query_pos, keep, scaling):
    """Per query head and query: masked softmax, outputs, projected L1 difference and the bound."""
    h_q, t, d = query.shape
    h_kv, n, _ = key.shape
    groups = h_q // h_kv
    pert = torch.zeros(h_kv, groups, t, dtype=torch.float64)
    bound = torch.zeros(h_kv, groups, t, dtype=torch.float64)
    group = torch.zeros(h_kv, t, dtype=torch.float64)
    for k in range(h_kv):
        for qi in range(t):
            total = 0.0
            for g in range(groups):
                h = k * groups + g
                w = o_weight[:, h * d : (h + 1) * d].double().T  # W_O^h (D x hidden)
                vis = torch.arange(n) <= query_pos[qi]
                logits = (key[k].double() @ query[h, qi].double()) * scaling
                a = torch.softmax(logits.masked_fill(~vis, float("-inf")), -1)
                kept = vis & keep[k]
                a_hat = torch.softmax(logits.masked_fill(~kept, float("-inf")), -1)
                diff = (a - a_hat) @ value[k].double() @ w
                pert[k, g, qi] = diff.abs().sum()
                total = total + diff
                m = (value[k].double() @ w).abs().sum(-1)
                big_c = (a * m).sum()
                big_k = (a * m * kept).sum()
                mass = (a * kept).sum()
                bound[k, g, qi] = big_c - (2 - 1 / mass) * big_k  # the paper's form
            group[k, qi] = total.abs().sum()
    return pert.mean((1, 2)), group.mean(-1), bound.mean((1, 2))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probe_equals_naive_recomputation(seed):
    query, key, value, o_weight, query_pos, keep = _random_layer(seed)
    proj = OutputProjection.from_weight(o_weight, key.shape[0], key.shape[-1])
    stats = LayerProbe(query, key, value, query_pos, proj, scaling=0.35).evaluate(keep)
    pert, group, bound = _naive(query, key, value, o_weight, query_pos, keep, 0.35)
    assert float(pert.min()) > 0.1  # the kept set really changes the output
    torch.testing.assert_close(stats.perturbation, pert, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.group_perturbation, group, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.bound, bound, rtol=1e-4, atol=1e-4)


def test_keep_everything_is_exactly_zero_on_tensors():
    query, key, value, o_weight, query_pos, _ = _random_layer(4)
    proj = OutputProjection.from_weight(o_weight, key.shape[0], key.shape[-1])
    stats = LayerProbe(query, key, value, query_pos, proj, 0.35).evaluate(torch.ones(2, key.shape[1], dtype=torch.bool))
    for field in ("perturbation", "group_perturbation", "bound", "evicted_term", "evicted_mass"):
        assert torch.equal(getattr(stats, field), torch.zeros(2, dtype=torch.float64)), field


@pytest.mark.parametrize("seed", range(6))
def test_bound_is_an_upper_bound(seed):
    query, key, value, o_weight, query_pos, keep = _random_layer(10 + seed, t=7, n=60)
    keep = keep & (torch.rand(keep.shape, generator=torch.Generator().manual_seed(seed)) < 0.5 + 0.08 * seed)
    keep[:, -7:] = True
    proj = OutputProjection.from_weight(o_weight, key.shape[0], key.shape[-1])
    stats = LayerProbe(query, key, value, query_pos, proj, 0.5).evaluate(keep)
    assert bool((stats.bound >= stats.perturbation * (1 - 1e-5)).all())
    assert bool((stats.bound >= stats.evicted_term * (1 - 1e-6)).all())
    assert bool((stats.evicted_mass > 0).all() & (stats.evicted_mass < 1).all())


def test_probe_rejects_query_without_kept_key():
    query, key, value, o_weight, query_pos, keep = _random_layer(5)
    proj = OutputProjection.from_weight(o_weight, key.shape[0], key.shape[-1])
    keep[:] = False
    with pytest.raises(ValueError, match="no kept key"):
        LayerProbe(query, key, value, query_pos, proj, 0.35).evaluate(keep)


def test_per_head_norms_average_to_library_norms():
    _, _, value, o_weight, _, _ = _random_layer(6)
    proj = OutputProjection.from_weight(o_weight, 2, value.shape[-1])
    per_head = group_l1_norms(value, proj)
    for k in range(2):
        torch.testing.assert_close(per_head[k].mean(0), exact_l1_norms(value[k], proj, k), rtol=1e-5, atol=1e-5)
        h = k * proj.groups + 1
        w = o_weight[:, h * 8 : (h + 1) * 8].T
        torch.testing.assert_close(per_head[k, 1], (value[k] @ w).abs().sum(-1), rtol=1e-5, atol=1e-5)


def _inputs(seed, n=48, t=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g), torch.randint(0, 256, (t,), generator=g)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_keep_everything_gives_zero_on_model(arch):
    model = tiny_model(arch, seed=1)
    ctx, later = _inputs(1)
    configs = method_configs(["none", "snapkv", "criticalkv-adakv-snapkv"], 1.0, BASE)
    table = analyse_document(model, ctx, later, configs, "doc")
    assert table.schema == SCHEMA
    assert table.num_rows == 2 * 3 * model.config.num_hidden_layers * model.config.num_key_value_heads
    assert set(table.column("probe").to_pylist()) == {"later", "window"}
    for field in ("perturbation", "group_perturbation", "bound", "evicted_term", "evicted_mass"):
        assert max(table.column(field).to_pylist()) == 0.0, field
    rows = table.to_pylist()
    assert {r["hidden_deviation"] for r in rows if r["probe"] == "later"} == {0.0}
    assert {r["top1_agreement"] for r in rows if r["probe"] == "later"} == {1.0}
    assert {r["hidden_deviation"] for r in rows if r["probe"] == "window"} == {None}
    assert {r["query_tokens"] for r in rows} == {len(later), BASE.window}
    assert set(table.column("kept").to_pylist()) == {len(ctx)}
    assert model.config._attn_implementation == "sdpa"  # restored


def _real_cache_hidden(model, cfg, ctx, later):
    """Final hidden states of the later tokens: prefill through the compressing VarLenCache, as the engine does."""
    model.set_attn_implementation(register())
    cache = VarLenCache(model.config.num_hidden_layers, Compressor(cfg))
    out = None
    for start, chunk in ((0, ctx), (len(ctx), later)):
        pos = torch.arange(start, start + len(chunk))[None]
        out = run_chunk(model.base_model, cache, chunk[None], pos)
    model.set_attn_implementation("sdpa")
    return out.last_hidden_state[0], cache


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_hidden_deviation_and_kept_counts_match_the_real_cache(arch):
    model = tiny_model(arch, seed=3)
    ctx, later = _inputs(2)
    configs = method_configs(METHODS, [0.25, 0.5], BASE)
    table = analyse_document(model, ctx, later, configs, "doc", model_name="tiny")
    with torch.inference_mode():
        ref, _ = _real_cache_hidden(model, CompressionConfig(method="none"), ctx, later)
        rows = table.to_pylist()
        for cfg in configs.values():
            hidden, cache = _real_cache_hidden(model, cfg, ctx, later)
            expected = float(((hidden - ref).norm(dim=-1) / ref.norm(dim=-1)).mean())
            mine = [r for r in rows if r["method"] == cfg.method and r["cache_size"] == cfg.cache_size]
            assert len(mine) == 2 * model.config.num_hidden_layers * model.config.num_key_value_heads
            window = [r for r in mine if r["probe"] == "window"]
            mine = [r for r in mine if r["probe"] == "later"]
            assert len(window) == len(mine) and all(0 <= r["perturbation"] <= r["bound"] * (1 + 1e-5) for r in window)
            assert mine[0]["hidden_deviation"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
            assert expected > 1e-3  # compression changed the final hidden states
            for r in mine:
                held = cache.kept_positions(r["layer"], 0, r["kv_head"])
                assert r["kept"] == int((held < len(ctx)).sum())
                assert r["base_method"] == base_method(cfg)
                assert r["criticalkv"] == (cfg.selection == "criticalkv")
                assert 0 <= r["perturbation"] <= r["bound"] * (1 + 1e-5)
    # criticalkv changes which entries are kept, never how many
    for r in rows:
        if r["criticalkv"]:
            twin = [
                b
                for b in rows
                if b["method"] == r["base_method"]
                and b["cache_size"] == r["cache_size"]
                and b["layer"] == r["layer"]
                and b["kv_head"] == r["kv_head"]
                and b["probe"] == r["probe"]
            ]
            assert twin[0]["kept"] == r["kept"]


def _row(method, layer, head, pert, doc="d", cache_size=0.2, dev=0.1, probe="later"):
    return {
        "doc_id": doc,
        "query_kind": "question",
        "probe": probe,
        "model": "m",
        "method": method,
        "base_method": method.removeprefix("criticalkv-"),
        "criticalkv": method.startswith("criticalkv-"),
        "cache_size": cache_size,
        "context_tokens": 10,
        "query_tokens": 2,
        "layer": layer,
        "kv_head": head,
        "kept": 2,
        "perturbation": pert,
        "group_perturbation": pert,
        "bound": pert,
        "evicted_term": pert,
        "evicted_mass": 0.1,
        "proxy_objective": pert,
        "hidden_deviation": dev,
        "top1_agreement": 1.0,
    }


def test_headline_pairs_criticalkv_with_its_base():
    rows = [
        _row("snapkv", 0, 0, 1.0),
        _row("criticalkv-snapkv", 0, 0, 0.5, dev=0.05),
        _row("snapkv", 0, 1, 1.0),
        _row("criticalkv-snapkv", 0, 1, 2.0, dev=0.05),
        _row("snapkv", 1, 0, 1.0),
        _row("criticalkv-snapkv", 1, 0, 1.0, dev=0.05),
        _row("snapkv", 1, 1, 4.0),
        _row("criticalkv-snapkv", 1, 1, 1.0, dev=0.05),
        _row("adakv-snapkv", 0, 0, 1.0),  # no criticalkv twin: not reported
        _row("criticalkv-snapkv", 0, 0, 0.1, cache_size=0.4),  # no base at this size: not reported
        _row("snapkv", 0, 0, 1.0, probe="window", dev=None),
        _row("criticalkv-snapkv", 0, 0, 0.9, probe="window", dev=None),
    ]
    result = headline(pa.Table.from_pylist(rows, schema=SCHEMA))
    assert [r["probe"] for r in result] == ["later", "window"]
    r = result[0]
    assert (r["method"], r["base_method"], r["cache_size"], r["heads"]) == ("criticalkv-snapkv", "snapkv", 0.2, 4)
    assert r["fraction_lower"] == 0.5 and r["fraction_equal"] == 0.25
    assert r["median_ratio"] == 1.0  # ratios 0.25, 0.5, 1, 2
    assert r["hidden_deviation"] == 0.05 and r["base_hidden_deviation"] == 0.1
    w = result[1]
    assert (w["heads"], w["fraction_lower"], w["hidden_deviation"]) == (1, 1.0, None)


def test_continuation_documents_are_consecutive_tokens():
    tok = tiny_tokenizer(chat=False)
    docs = continuation_documents(tok, 120, 2, query_tokens=10, seed=3)
    assert len(docs) == 2 and docs[0].context_ids != docs[1].context_ids
    for d in docs:
        assert len(d.context_ids) == 120 and len(d.query_ids) == 10 and d.query_kind == "continuation"
        text = tok.decode(d.context_ids + d.query_ids)
        assert tok(text, add_special_tokens=True)["input_ids"][:130] == d.context_ids + d.query_ids
    assert [d.context_ids for d in continuation_documents(tok, 120, 2, query_tokens=10, seed=3)] == [
        d.context_ids for d in docs
    ]
