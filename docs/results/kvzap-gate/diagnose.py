"""The held-out diagnostic of README.md for the shipped file too: on the gate's 16 held-out documents,
the rank correlation with KVzip's own score inside each document (per layer and KV head) and the
overlap of the global top-k over every layer and head with KVzip's own, for the gate file and the
shipped predictor (which is fitted to KVzip+ log-scores, not to KVzip's own: a reference point only).

Needs the pipeline of `fdacbbe` (the gate kind was removed after the verdict; see `run.sh`).
Usage: PYTHONPATH=. python docs/results/kvzap-gate/diagnose.py TARGETS.pt GATE.safetensors
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from pipeline.engine.kvzap_file import read_kvzap, shipped_kvzap
from pipeline.eval.kvzap_shares import predictions

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("train_gate", HERE / "train_gate.py")
train_gate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_gate)


@torch.no_grad()
def main() -> None:
    docs = torch.load(sys.argv[1])
    _, held = train_gate.split(docs, 0)
    out = {}
    for name, path in (("gate", sys.argv[2]), ("shipped", shipped_kvzap("smollm2"))):
        model = read_kvzap(path)
        spear, top = [], {str(f): [] for f in train_gate.FRACTIONS}
        for d in held:
            spearman, overlap = train_gate.ranking(predictions(model, d["hidden"], tokens=d["tokens"]), d["scores"])
            spear.append(spearman)
            for f, value in overlap.items():
                top[f].append(value)
        out[name] = {
            "spearman_in_document": round(sum(spear) / len(spear), 4),
            "global_top_overlap": {f: round(sum(v) / len(v), 4) for f, v in top.items()},
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
