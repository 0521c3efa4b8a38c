"""Offline probe: does fitting the KVzap predictor *within documents* (each document's hidden states and
log-scores centred per layer and KV head before the ridge) rank a document's entries better than the
shipped fit on raw log-scores? Only the ranking inside each (layer, KV head) matters to the ``shares``
allocation; a raw fit must also explain each document's offset (KVzip's scores fall with the context's
length) from h alone.

    python docs/results/kvzap-within/probe.py --cache /tmp/kvw [--ruler-docs N]
    python docs/results/kvzap-within/probe.py --cache /tmp/kvw --write FILE [--level]   # the files swept

1. KVzip+ targets (``pipeline.eval.kvzap_calibration.document_targets``, in this process, no Ray) of the
   shipped file's calibration documents (its settings: lengths 512-4,096, 16/16/16/8 documents, 384
   sampled entries, seed 0, 25 % held out per length) and of N seed-0 RULER documents at 2K and 4K
   (``--ruler`` parquet files, never fitted on); cached under ``--cache``.
2. Two fits on the same training documents: ``raw`` (the shipped fit; its weights are compared with
   the shipped file's as a control) and ``within``.
3. Per evaluation set: mean over documents, layers and heads of the Spearman correlation and the top-20 %
   overlap inside each document, and ``kept_of_global_top`` with the shipped table (kept true score
   / the global top's) at 0.1 / 0.2 / 0.4.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow.parquet as pq
import torch

from pipeline.apps.calibrate_kvzap import _split
from pipeline.engine.config import ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.kvzap_file import load_kvzap, model_fingerprint, read_metadata, shipped_kvzap, write_kvzap
from pipeline.engine.loading import load_model
from pipeline.eval import kvzap_calibration as cal
from pipeline.eval.kvzap_data import calibration_documents
from pipeline.eval.kvzap_shares import kept_of_global_top
from pipeline.kv.kvzap_model import KVzapModel

SIZES = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9]


def targets(cache: Path, name: str, docs: list[dict], engine_factory) -> list:
    path = cache / f"{name}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    engine, out = engine_factory(), []
    for i, doc in enumerate(docs):
        out.append(cal.document_targets(engine, doc, 384, SIZES, 0))
        print(f"{name} {i + 1}/{len(docs)} {doc['doc_id']}", flush=True)
    torch.save(out, path)
    return out


def centred(t: cal.DocumentTargets) -> cal.DocumentTargets:
    """Hidden states and log-scores less their means over the document's sampled entries."""
    h = t.hidden - t.hidden.mean(1, keepdim=True)
    y = t.log_scores - t.log_scores.mean(-1, keepdim=True)
    return cal.replace(t, hidden=h, log_scores=y)


def within_fit(train: list, alpha: float) -> dict:
    """Ridge on centred documents; the intercept then puts back the pooled means (same as raw's scale)."""
    fitted = cal._fit_predictors([centred(t) for t in train], "linear", alpha, (0, 0), 0, None, False)
    for layer in range(fitted["weight"].shape[0]):
        x, y = cal._layer_data(train, layer)
        fitted["bias"][layer] = y.mean(0) - fitted["weight"][layer] @ x.mean(0)
    return fitted


def inside(model: KVzapModel, docs: list) -> dict:
    rho, top = [], []
    for t in docs:
        for layer in range(model.num_layers):
            q = cal.fit_quality(cal._doc_prediction(model, t, layer), t.log_scores[layer])
            rho.append(q["spearman"])
            top.append(q["top20_overlap"])
    fixed = cal._fixed_entries()
    kept = [kept_of_global_top(model, t.hidden, t.log_scores, (0.1, 0.2, 0.4), t.tokens or t.length, fixed, t.positions)
            for t in docs]  # fmt: skip
    score = [sum(r[j][0] for r in kept) / len(kept) for j in range(3)]
    return {"spearman": sum(rho) / len(rho), "top20": sum(top) / len(top), "kept": score}


def length_level(tensors: dict, train: list) -> dict:
    """``tensors`` (a within fit) plus a per-document level ``a + b log n`` per layer and KV head: each
    training document's mean log-score less ``W`` times its mean h, regressed on the log of its length by
    least squares; ``a`` becomes the bias and ``b`` the file's ``position_weight[..., 2]`` (the log-length
    feature of :func:`pipeline.kv.kvzap_model.position_features`; the two position features are 0)."""
    weight = tensors["weight"].double()  # (L, H_kv, hidden)
    logn = torch.tensor([float(t.tokens or t.length) for t in train], dtype=torch.float64).log()
    mean_h = [t.hidden.double().mean(1) for t in train]  # (L, hidden) each
    levels = [t.log_scores.double().mean(-1) - torch.einsum("lhd,ld->lh", weight, h) for t, h in zip(train, mean_h)]
    design = torch.stack([torch.ones_like(logn), logn], 1)  # (N, 2)
    coef = torch.linalg.lstsq(design, torch.stack(levels).reshape(len(train), -1)).solution
    coef = coef.reshape(2, *weight.shape[:2]).float()
    position = torch.zeros(*weight.shape[:2], 3)
    position[..., 2] = coef[1]
    return {"weight": tensors["weight"], "bias": coef[0], "position_weight": position}


def write_file(loaded, train: list, held: list, output: Path, level: bool) -> None:
    """The swept file (``--write``): ``within_fit``'s predictors (with ``--level``, plus
    :func:`length_level`) and the shipped file's shares table kept as it is (this fit's own table equals
    it to 1e-6 at every size from 0.1 up; its 0.05 row, made by older code, differs), so that the
    predictor is the one thing that differs from the shipped file."""
    shipped_path = shipped_kvzap("smollm2")
    shipped, meta = load_kvzap(shipped_path, loaded.model, "smollm2"), read_metadata(shipped_path)
    tensors = within_fit(train, meta["settings"]["alpha"])
    tensors = length_level(tensors, train) if level else tensors
    model = KVzapModel("linear", tensors, shipped.shares, shipped.share_sizes)
    layers = [{"layer": i, **cal._quality(model, held, i)} for i in range(model.num_layers)]
    report = {"layers": layers, "mean": cal._mean_of(layers)}
    settings = {**meta["settings"], "within_documents": True, "level": "a + b log n" if level else "pooled"}
    settings["shares"] = "the previous shipped file's table"
    path = write_kvzap(output, model, "smollm2", model_fingerprint(loaded.model), report, settings)
    print(f"{path}: in-document Spearman {report['mean']['spearman_in_document']:.3f} (held out)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--write", type=Path, help="write the swept file here and stop (after step 1's calibration)")
    parser.add_argument("--level", action="store_true", help="with --write: add the per-document level in log length")
    ruler = ["/tmp/selfcal/docs-2048.parquet", "/tmp/selfcal/docs-4096.parquet"]  # ../self-calibration/run.sh
    parser.add_argument("--ruler", nargs=2, default=ruler, help="the seed-0 RULER documents at 2K and 4K")
    parser.add_argument("--ruler-docs", type=int, default=10)
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    loaded = load_model(ModelConfig(name="smollm2"))
    count = lambda text: len(loaded.tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    factory = lambda: Engine(loaded)  # noqa: E731
    docs = []
    for length, n in zip([512, 1024, 2048, 4096], [16, 16, 16, 8]):
        docs += calibration_documents([length], n, count, 0)
    train, held = _split(targets(args.cache, "calibration", docs, factory), 0.25, 0)
    if args.write is not None:
        return write_file(loaded, train, held, args.write, args.level)
    shipped = load_kvzap(shipped_kvzap("smollm2"), loaded.model, "smollm2")
    raw_fit = cal._fit_predictors(train, "linear", 1e-3, (0, 0), 0, None, False)
    raw = KVzapModel("linear", raw_fit, shipped.shares, shipped.share_sizes)
    gap = float((raw.tensors["weight"] - shipped.tensors["weight"]).abs().max())
    print(f"control, raw refit against the shipped weights: max |difference| {gap:.2e}")
    within = KVzapModel("linear", within_fit(train, 1e-3), shipped.shares, shipped.share_sizes)
    sets = {f"held-out calibration {n}": [t for t in held if t.length == n] for n in (512, 1024, 2048, 4096)}
    for path, n in zip(args.ruler, (2048, 4096)):
        rows = pq.read_table(path).to_pylist()
        picked = random.Random(0).sample(rows, args.ruler_docs)
        ruler = [{"doc_id": r["doc_id"], "kind": "ruler", "length": n, "context": r["context"]} for r in picked]
        sets[f"RULER {n}"] = targets(args.cache, f"ruler-{n}", ruler, factory)
    print("set | fit | Spearman in document | top-20 % overlap | kept score 0.1 / 0.2 / 0.4")
    for name, docs_ in sets.items():
        for label, model in (("raw", raw), ("within", within)):
            r = inside(model, docs_)
            kept = " / ".join(f"{v:.4f}" for v in r["kept"])
            print(f"{name} ({len(docs_)}) | {label} | {r['spearman']:.4f} | {r['top20']:.4f} | {kept}", flush=True)


if __name__ == "__main__":
    main()
