"""A bounded KVzap target (issue #52, "scores comparable across layers"), one script for README.md.

    python bounded.py targets OUT.pt       # the shipped pooled calibration's 56 documents -> KVzip+ targets
    python bounded.py fit OUT.pt DIR       # ridge on log scores (check: equals kvzap-pooled) and the bounded fit
    python bounded.py targets4k OUT.pt 4K.pt   # the 4K file's 16 documents (reusing OUT.pt's first 8)
    python bounded.py fit4k 4K.pt DIR      # the same two fits on them (check: equals kvzap-4096)

The bounded fit (after Fast KVzip, arXiv 2601.17668, which trains a gate on KVzip's raw score in [0, 1]
with binary cross-entropy): per (document, layer, KV head) the sampled KVzip+ scores are divided by
their maximum, t = s / max s in (0, 1]; one logistic regression per layer, logit = h @ W.T + b
(H_kv outputs), minimises the mean binary cross-entropy against t plus lam/2 ||W||^2 on standardised
features (L-BFGS, float64). Against the shipped ridge on log s, the loss weighs an entry by how close it
is to its document's top instead of fitting the tail's log scores as hard as the top. The file stores
the logit as the predicted log score: exp(logit) = t / (1 - t) is monotone in t (a head's ranking is t's)
and about t below 0.5. lam is chosen from LAMBDAS by the held-out documents' mean in-document Spearman.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.apps.calibrate_kvzap import _split
from pipeline.engine.config import ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.kvzap_file import model_fingerprint, read_metadata, write_kvzap
from pipeline.engine.loading import load_model
from pipeline.eval.kvzap_calibration import _layer_data, _mean_quality, document_targets, kept_report, ridge
from pipeline.eval.kvzap_data import calibration_documents
from pipeline.kv.kvzap_model import KVzapModel

HERE = Path(__file__).resolve().parent
POOLED = HERE.parent / "kvzap-per-length" / "kvzap-pooled.safetensors"
FOUR_K = HERE.parent / "kvzap-per-length" / "kvzap-4096.safetensors"  # 16 documents of 4,096 tokens
LENGTHS, DOCUMENTS, SAMPLE, SIZES = (
    [512, 1024, 2048, 4096],
    [16, 16, 16, 8],
    384,
    [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9],
)
LAMBDAS = (1e-4, 1e-3, 1e-2)


def targets(out: str, lengths=LENGTHS, documents=DOCUMENTS, reuse: str | None = None) -> None:
    loaded = load_model(ModelConfig(name="smollm2", layerwise_prefill=0))
    engine = Engine(loaded)
    count = lambda text: len(loaded.tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    docs = [d for n, k in zip(lengths, documents) for d in calibration_documents([n], k, count, 0)]
    done = {t.doc_id: t for t in torch.load(reuse, weights_only=False)["targets"]} if reuse else {}
    t0, result = time.time(), []
    for i, doc in enumerate(docs):
        result.append(done.get(doc["doc_id"]) or document_targets(engine, doc, SAMPLE, SIZES, 0))
        print(f"[{time.time() - t0:6.0f}s] {i + 1}/{len(docs)} {doc['doc_id']}", flush=True)
    torch.save({"targets": result, "fingerprint": model_fingerprint(loaded.model)}, out)


def bounded_targets(docs, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, D) and t (N, H_kv): scores over their document's (layer, head) maximum."""
    x = torch.cat([d.hidden[layer] for d in docs]).double()
    t = torch.cat([(d.log_scores[layer] - d.log_scores[layer].amax(-1, keepdim=True)).exp().T for d in docs])
    return x, t.double()


def logistic(x: torch.Tensor, t: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft-target logistic regression: x (N, D), t (N, H) in [0, 1] -> weight (H, D), bias (H,) float32."""
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    z = (x - mean) / std
    w = torch.zeros(t.shape[1], x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.logit(t.mean(0).clamp(1e-4, 1 - 1e-4)).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=300, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w.T + b, t) + 0.5 * lam * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad(), torch.inference_mode(False):
        opt.step(closure)
    weight = (w.detach() / std).float()
    return weight, (b.detach() - (w.detach() / std) @ mean).float()


def fit_model(train, fitter, shares, sizes) -> KVzapModel:
    weights, biases = [], []
    for layer in range(train[0].hidden.shape[0]):
        weight, bias = fitter(layer)
        weights.append(weight)
        biases.append(bias)
    return KVzapModel("linear", {"weight": torch.stack(weights), "bias": torch.stack(biases)}, shares, sizes)


def fit(path: str, out_dir: str, reference: Path = POOLED, name: str = "kvzap-bounded") -> None:
    data = torch.load(path, weights_only=False)
    train, held = _split(data["targets"], 0.25, 0)  # the calibration job's split
    meta = read_metadata(reference)
    with safe_open(str(reference), "pt") as f:
        shipped = {k: f.get_tensor(k) for k in f.keys()}
    shares, sizes = shipped["shares"], shipped["share_sizes"]
    log_model = fit_model(train, lambda layer: ridge(*_layer_data(train, layer), 1e-3), shares, sizes)
    diff = (log_model.tensors["weight"] - shipped["weight"]).abs().max().item()
    print(f"ridge on log scores vs {reference.name}: max |weight difference| {diff:.2e}")
    report = {"log-ridge": _report(log_model, held)}
    best = None
    for lam in LAMBDAS:
        model = fit_model(train, lambda layer, lam=lam: logistic(*bounded_targets(train, layer), lam), shares, sizes)
        report[f"bounded lam={lam}"] = _report(model, held)
        score = report[f"bounded lam={lam}"]["fit"]["spearman_in_document"]
        print(f"lam {lam}: {json.dumps(report[f'bounded lam={lam}'])}", flush=True)
        if best is None or score > best[0]:
            best = (score, lam, model)
    print(json.dumps(report, indent=1))
    _, lam, model = best
    settings = {"bounded": True, "lam": lam, "targets": Path(path).name, **meta["settings"]}
    out = Path(out_dir) / f"{name}.safetensors"
    write_kvzap(out, model, "smollm2", data["fingerprint"], report[f"bounded lam={lam}"], settings)
    report_path = Path(out_dir) / f"{name.replace('kvzap-bounded', 'fit-report')}.json"
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"chose lam {lam}; wrote {out}")


def _report(model: KVzapModel, held) -> dict:
    """Held-out fit (Spearman over log scores: a monotone target keeps it comparable) and kept score."""
    return {"fit": _mean_quality(model, held), "kept_top": kept_report(model, held)}


if __name__ == "__main__":
    steps = {
        "targets": lambda: targets(sys.argv[2]),
        "fit": lambda: fit(sys.argv[2], sys.argv[3]),
        "targets4k": lambda: targets(sys.argv[3], [4096], [16], reuse=sys.argv[2]),
        "fit4k": lambda: fit(sys.argv[2], sys.argv[3], FOUR_K, "kvzap-bounded-4k"),
    }
    steps[sys.argv[1]]()
