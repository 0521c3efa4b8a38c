"""Candidate H of README.md, round 2: the pooled SmolLM2 file (shipped until 2026-12-06, kept here as
``kvzap-pooled.safetensors``) read at 2,048 tokens and below, the 4K file of this folder at 4,096 and above,
linear in log length between (one file, two predictors and tables).

python make_h.py OUT.safetensors
"""

import sys
from pathlib import Path

from pipeline.engine.kvzap_file import per_length_file, read_metadata, write_kvzap

HERE = Path(__file__).parent
POOLED, FOUR_K = HERE / "kvzap-pooled.safetensors", HERE / "kvzap-4096.safetensors"

if __name__ == "__main__":
    model, fit, settings = per_length_file([POOLED, FOUR_K], [2048, 4096])
    meta = read_metadata(POOLED)
    print(write_kvzap(sys.argv[1], model, meta["model"], meta["fingerprint"], fit, settings))
