"""Training pairs for the Fast-KVzip-style gate (issue #52): KVzip's own scores (max attention, in
[0, 1], no KVzip+ weighting) and every layer's attention input at sampled context positions, for the
shipped file's calibration documents (seed 0, 16 per length at 512 / 1,024 / 2,048 / 4,096 tokens:
the pooled file's 56 plus the 4K file's 8 more).

Needs the pipeline of `fdacbbe` (the gate kind was removed after the verdict; see `run.sh`).
Usage: PYTHONPATH=. python docs/results/kvzap-gate/collect.py OUT.pt [--sample-tokens 1024]
Writes a list of dicts (doc_id, kind, length, tokens, hidden (L, m, D) float16, scores (L, H_kv, m)
float32 KVzip scores, positions (m,)).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pipeline.engine.config import ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.loading import load_model
from pipeline.eval.kvzap_calibration import document_targets
from pipeline.eval.kvzap_data import calibration_documents

LENGTHS = (512, 1024, 2048, 4096)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--sample-tokens", type=int, default=1024)
    parser.add_argument("--documents", type=int, default=16)
    args = parser.parse_args()
    loaded = load_model(ModelConfig(layerwise_prefill=0))
    engine = Engine(loaded)
    count = lambda text: len(loaded.tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    docs = []
    for length in LENGTHS:
        docs += calibration_documents([length], args.documents, count, 0)
    out, t0 = [], time.perf_counter()
    for i, doc in enumerate(docs):
        t = document_targets(engine, doc, args.sample_tokens, [0.1], 0, kvzip_plus=False)
        out.append(
            {
                "doc_id": t.doc_id,
                "kind": t.kind,
                "length": t.length,
                "tokens": t.tokens,
                "hidden": t.hidden.half(),
                "scores": t.log_scores.exp(),
                "positions": t.positions,
            }
        )
        print(f"[{time.perf_counter() - t0:7.1f}s] {i + 1}/{len(docs)} {t.doc_id}", file=sys.stderr, flush=True)
    torch.save(out, args.output)


if __name__ == "__main__":
    main()
