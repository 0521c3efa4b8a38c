"""The held-out diagnostic of README.md for the shipped file too: on the gate's 16 held-out documents,
the rank correlation with KVzip's own score inside each document (per layer and KV head) and the
overlap of the global top-k over every layer and head with KVzip's own, for the gate file and the
shipped predictor (which is fitted to KVzip+ log-scores, not to KVzip's own: a reference point only).

Runs from a worktree of `fdacbbe` (the gate kind was removed from the pipeline after the verdict).
Usage: PYTHONPATH=. python docs/results/kvzap-gate/diagnose.py TARGETS.pt GATE.safetensors
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from pipeline.engine.kvzap_file import read_kvzap, shipped_kvzap

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("train_gate", HERE / "train_gate.py")
train_gate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_gate)


def predictions(model, doc: dict) -> torch.Tensor:
    """(L, H, m) predicted log-scores of one document's sampled entries."""
    h = doc["hidden"].float()
    lengths = torch.tensor([doc["tokens"]])
    return torch.stack([model.predict(layer, h[layer][None], lengths=lengths)[0] for layer in range(h.shape[0])])


@torch.no_grad()
def main() -> None:
    docs = torch.load(sys.argv[1])
    _, held = train_gate.split(docs, 0)
    out = {}
    for name, path in (("gate", sys.argv[2]), ("shipped", shipped_kvzap("smollm2"))):
        model = read_kvzap(path)
        spear, top = [], {f: [] for f in train_gate.FRACTIONS}
        for d in held:
            pred, true = predictions(model, d), d["scores"]
            pairs = zip(pred.flatten(0, 1), true.flatten(0, 1))
            spear.append(sum(train_gate._spearman(p, t) for p, t in pairs) / true[..., 0].numel())
            for f in train_gate.FRACTIONS:
                k = max(1, int(f * true.numel()))
                mine = set(pred.flatten().topk(k).indices.tolist())
                theirs = set(true.flatten().topk(k).indices.tolist())
                top[f].append(len(mine & theirs) / k)
        out[name] = {
            "spearman_in_document": round(sum(spear) / len(spear), 4),
            "global_top_overlap": {str(f): round(sum(v) / len(v), 4) for f, v in top.items()},
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
