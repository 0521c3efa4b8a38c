"""Candidate H of README.md, round 2: the pooled SmolLM2 file (shipped until 2026-12-06, kept here as
``kvzap-pooled.safetensors``) read at 2,048 tokens and below, the 4K file of this folder at 4,096 and above,
linear in log length between (one file, two predictors and tables).

python make_h.py OUT.safetensors
"""

import sys
from pathlib import Path

from pipeline.engine.kvzap_file import read_kvzap as read
from pipeline.engine.kvzap_file import read_metadata, write_kvzap
from pipeline.kv.kvzap_model import KVzapModel, per_length_model

HERE = Path(__file__).parent
POOLED, FOUR_K = HERE / "kvzap-pooled.safetensors", HERE / "kvzap-4096.safetensors"


def with_four_k(short: Path) -> tuple[KVzapModel, dict, dict]:
    """``short`` read at 2,048 tokens and the 4K file at 4,096: the model, its fit and its settings."""
    combined = per_length_model([read(short), read(FOUR_K)], [2048, 4096])
    short_meta, long_meta = read_metadata(short), read_metadata(FOUR_K)
    fit = {"per_length": {"2048": short_meta["fit"].get("mean"), "4096": long_meta["fit"].get("mean")}}
    settings = {"per_length": {"2048": short_meta["settings"], "4096": long_meta["settings"]}}
    return combined, fit, settings


def write(out: str, model: KVzapModel, fit: dict, settings: dict) -> None:
    """Write ``model`` under the pooled file's model name and fingerprint; prints the path."""
    meta = read_metadata(POOLED)
    print(write_kvzap(out, model, meta["model"], meta["fingerprint"], fit, settings))


if __name__ == "__main__":
    write(sys.argv[1], *with_four_k(POOLED))
