"""Candidate H of README.md, round 2: the pooled SmolLM2 file (shipped until 2026-12-06, kept here as
``kvzap-pooled.safetensors``) read at 2,048 tokens and below, the 4K file of this folder at 4,096 and above,
linear in log length between (one file, two predictors and tables).

python make_h.py OUT.safetensors
"""

import sys
from pathlib import Path

from safetensors import safe_open

from pipeline.engine.kvzap_file import read_metadata, write_kvzap
from pipeline.kv.kvzap_model import KVzapModel, per_length_model


def read(path: Path) -> KVzapModel:
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    shares, sizes = tensors.pop("shares"), tensors.pop("share_sizes")
    return KVzapModel(read_metadata(path)["kind"], tensors, shares, sizes, tensors.pop("share_lengths", None))


here = Path(__file__).parent
shipped, four_k = here / "kvzap-pooled.safetensors", here / "kvzap-4096.safetensors"
meta = read_metadata(shipped)
combined = per_length_model([read(shipped), read(four_k)], [2048, 4096])
fit = {"per_length": {"2048": meta["fit"].get("mean"), "4096": read_metadata(four_k)["fit"].get("mean")}}
settings = {"per_length": {"2048": meta["settings"], "4096": read_metadata(four_k)["settings"]}}
print(write_kvzap(sys.argv[1], combined, meta["model"], meta["fingerprint"], fit, settings))
