"""KVzap calibration: documents, targets (the engine's own KVzip+ passes), the fit and its report."""

import subprocess
import sys

import pytest
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.kvzap_file import read_metadata
from pipeline.engine.types import Request
from pipeline.eval.kvzap_calibration import (
    DocumentTargets,
    document_targets,
    fit,
    fit_quality,
    length_shares,
    ridge,
    shares_error,
)
from pipeline.eval.kvzap_data import KINDS, calibration_documents
from pipeline.kv.allocation.layer import layer_head_budgets
from pipeline.kv.attention.registered import recorded_attention_inputs
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig
from pipeline.kv.scorers.common import finalise
from pipeline.kv.storage.cache import VarLenCache
from tests.tiny import tiny_loaded

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "


def test_ridge_recovers_a_linear_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 12, generator=g)
    w, b = torch.randn(3, 12, generator=g), torch.randn(3, generator=g)
    y = x @ w.T + b + 0.01 * torch.randn(2000, 3, generator=g)
    weight, bias = ridge(x, y, 1e-6)
    torch.testing.assert_close(weight, w, atol=5e-3, rtol=0)
    torch.testing.assert_close(bias, b, atol=5e-3, rtol=0)


def test_fit_quality_of_perfect_and_reversed_predictions():
    true = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    assert fit_quality(true, true) == {"r2": 1.0, "spearman": 1.0, "top20_overlap": 1.0}
    worst = fit_quality(-true, true)
    assert worst["spearman"] == -1.0 and worst["top20_overlap"] == 0.0 and worst["r2"] < -1


def test_documents_fit_their_length_in_every_kind():
    count = lambda text: len(text.split())  # noqa: E731
    docs = calibration_documents([300, 600], 4, count, seed=3)
    assert [d["kind"] for d in docs] == list(KINDS) * 2
    for doc in docs:
        assert 0.6 * doc["length"] <= count(doc["context"]) <= doc["length"], doc["doc_id"]
    assert docs == calibration_documents([300, 600], 4, count, seed=3)  # seeded
    assert docs[0]["context"] != calibration_documents([300], 1, count, seed=4)[0]["context"]


def _true_scores(engine, doc):
    """Independently: the engine's KVzip+ passes over a deferred layer-kvzip cache, and the attention inputs."""
    config = CompressionConfig(method="layer-kvzip", cache_size=0.5, kvzip_plus=True)
    rows = engine._rows_for(Request("x", doc["context"], ["?"]))
    cache, hidden = VarLenCache(engine.shape.num_layers, Compressor(config)), {}
    with recorded_attention_inputs(engine.model, hidden):
        engine.prefill(rows, cache, passes=False)
    prompt, held = rows[0].prompt, cache.prefill.awaiting_passes
    scores = engine.reconstruction.scores([prompt.context_ids], [prompt.prefix_tokens], held, 2048, True)
    return scores, hidden, held[0].key_pos, prompt.prefix_tokens


def test_targets_are_the_kvzip_plus_scores_at_sampled_entries():
    engine = Engine(tiny_loaded())
    doc = {"doc_id": "d", "kind": "essay", "length": 100, "context": TEXT * 2}
    got = document_targets(engine, doc, sample_tokens=20, share_sizes=[0.2, 0.5], seed=0)
    scores, hidden, key_pos, prefix = _true_scores(engine, doc)
    assert got.hidden.shape == (2, 20, engine.model.config.hidden_size) and got.log_scores.shape == (2, 2, 20)
    for layer in range(2):
        index = got.positions.tolist()
        assert len(set(index)) == 20 and all(int(key_pos[0, i]) >= prefix for i in index)  # never the sinks
        torch.testing.assert_close(got.hidden[layer], hidden[layer][0, index])
        torch.testing.assert_close(got.log_scores[layer], scores[layer][0][:, index].clamp(min=1e-12).log())
    for s, size in enumerate([0.2, 0.5]):
        n = int((key_pos >= 0).sum())
        budget = round(size * n)
        window = torch.tensor([min(32, budget)])
        final = [finalise(sc, key_pos, window) for sc in scores]
        counts = torch.stack(layer_head_budgets(final, torch.tensor([budget])), dim=1)[0]
        torch.testing.assert_close(got.shares[s], counts.float() / budget)
        assert abs(float(got.shares[s].mean()) - 1.0) < 1e-6


def test_targets_refuse_a_layer_by_layer_prefill():
    """Layer by layer, each layer's input is recorded a slice at a time: the targets would be wrong."""
    from dataclasses import replace

    engine = Engine(replace(tiny_loaded(), layerwise_prefill=16))
    doc = {"doc_id": "d", "kind": "essay", "length": 100, "context": TEXT * 2}
    with pytest.raises(ValueError, match="one-forward prefill"):
        document_targets(engine, doc, sample_tokens=20, share_sizes=[0.2], seed=0)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_fit_predicts_held_out_documents_of_a_tiny_model(kind):
    engine = Engine(tiny_loaded())
    docs = calibration_documents([700], 8, lambda t: len(engine.tokenizer(t).input_ids), seed=0)
    targets = [document_targets(engine, d, 40, [0.2, 0.4], 0) for d in docs]
    model, report = fit(targets[:6], targets[6:], [0.2, 0.4], kind, mlp_epochs=40)
    assert model.kind == kind and len(report["layers"]) == 2
    assert set(report["per_kind"]) == {t.kind for t in targets[6:]}
    assert report["mean"]["spearman"] > 0.3  # far better than chance on held-out documents
    assert 0.3 < report["mean"]["spearman_in_document"] <= 1.0  # and inside each of them
    assert model.share_lengths is None and model.shares.shape == (2, 2, engine.shape.num_kv_heads)
    assert set(report["shares_error"]["per_length"]) == {"700"}
    by_length, _ = fit(targets[:6], targets[6:], [0.2, 0.4], kind, mlp_epochs=1, shares_by_length=True)
    assert by_length.share_lengths.tolist() == [700.0]  # one calibration length: one table
    torch.testing.assert_close(by_length.shares[0], model.shares)
    aware, aware_report = fit(targets[:6], targets[6:], [0.2, 0.4], kind, mlp_epochs=1, shares_target="predicted")
    assert aware.shares.shape == model.shares.shape and not torch.allclose(aware.shares, model.shares)
    torch.testing.assert_close(aware.shares.mean((1, 2)), torch.ones(2))
    assert set(aware_report["shares_error"]["per_length"]) == {"700"}
    with pytest.raises(ValueError, match="shares_target"):
        fit(targets[:6], targets[6:], [0.2], kind, mlp_epochs=1, shares_target="oracle")


def _positional_targets(doc: int, n: int, weight, position_weight) -> DocumentTargets:
    """Synthetic targets whose log-scores are h . w + position_weight . (log(1 + p), log(1 + n - 1 - p), log n)."""
    from tests.kv.reference import kvzap_position_term

    g = torch.Generator().manual_seed(doc)
    positions = torch.randperm(n, generator=g)[:50].sort().values
    hidden = torch.randn(2, 50, 6, generator=g)
    term = torch.tensor(
        [[[kvzap_position_term(pw, int(p), n) for p in positions] for pw in layer] for layer in position_weight]
    )
    log_scores = torch.einsum("lmd,lhd->lhm", hidden, weight) + term
    return DocumentTargets(f"d{doc}", "ruler", n, hidden, log_scores, torch.ones(2, 2, 2), positions, n)


def test_fit_recovers_a_dependence_on_the_distance_to_the_context_end():
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(2, 2, 6, generator=g)
    position_weight = [[[0.0, -1.5, 0.5], [0.3, -0.8, 0.0]], [[0.0, 0.0, 0.0], [0.0, -2.0, 1.0]]]
    docs = [_positional_targets(i, n, weight, position_weight) for i, n in enumerate([100, 300, 900, 2000] * 3)]
    model, report = fit(docs[:9], docs[9:], [0.2, 0.4], alpha=1e-8, positions=True)
    torch.testing.assert_close(model.tensors["position_weight"], torch.tensor(position_weight), atol=1e-3, rtol=0)
    torch.testing.assert_close(model.tensors["weight"], weight, atol=1e-3, rtol=0)
    assert report["mean"]["r2"] > 0.999
    plain, plain_report = fit(docs[:9], docs[9:], [0.2, 0.4], alpha=1e-8)  # the default: h alone
    assert not plain.uses_positions and plain_report["mean"]["r2"] < 0.9
    mlp, _ = fit(docs[:9], docs[9:], [0.2, 0.4], kind="mlp", mlp_epochs=1, alpha=1e-8, positions=True)
    assert set(mlp.tensors) == {"w1", "b1", "w2", "b2", "position_weight"}  # the MLP learns what the term leaves
    torch.testing.assert_close(mlp.tensors["position_weight"], model.tensors["position_weight"])


def _targets(length: int, shares: torch.Tensor) -> DocumentTargets:
    empty = torch.zeros(1, 0)
    return DocumentTargets(f"d{length}-{float(shares.sum())}", "ruler", length, empty, empty, shares, empty)


def test_shares_are_one_mean_table_per_length_and_their_error_is_reported():
    a, b = torch.full((1, 2, 2), 1.0), torch.tensor([[[2.0, 0.0], [1.0, 1.0]]])
    docs = [_targets(512, a), _targets(512, a * 1.5 - 0.5), _targets(4096, b), _targets(4096, b)]
    tables, lengths = length_shares(docs)
    assert lengths.tolist() == [512.0, 4096.0]
    torch.testing.assert_close(tables, torch.stack([a * 1.25 - 0.25, b]))
    error = shares_error(docs[1:3] + docs[:1], [docs[3]])  # held out: one 4K document, its twin in training
    assert error["per_length"] == {"4096": 0.0}
    pooled = (a + a * 1.5 - 0.5 + b) / 3
    assert error["pooled"]["4096"] == round(float((b - pooled).abs().sum() / b.sum()), 4)


@pytest.mark.slow
def test_calibration_job_writes_a_file_the_engine_loads(tmp_path):
    out = tmp_path / "k.safetensors"
    cmd = [sys.executable, "jobs/calibrate_kvzap.py", "--output", str(out), "--lengths", "128"]
    cmd += ["--documents", "8", "--sample-tokens", "16", "--share-sizes", "0.2,0.4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "held-out fit over 2 documents" in done.stdout
    assert "held-out shares error by length, per-length / pooled table (this file: pooled;" in done.stdout
    meta = read_metadata(out)
    assert meta["model"] == "smollm2" and len(meta["fit"]["layers"]) == 30 and meta["settings"]["train_documents"] == 6
    bad = subprocess.run(cmd[:2] + ["--output", str(out), "--lengths", "32"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid --lengths" in bad.stderr
