"""The files of README.md (``z`` and ``z3`` need the per-size file format, removed after the verdicts:
run from a worktree of 2192ef1, as run.sh does).

``h2 TWO_K OUT``: the shipped file's construction (``../kvzap-per-length/make_h.py``) with the 2K-only
file TWO_K in the pooled file's place (Z's reading at kept fractions <= 0.1).
``z TWO_K OUT``: candidate Z, H2 at kept fractions <= 0.1 and the shipped file's construction (H) from
0.2 up (``per_size_model``).
``z3 TWO_K THREE_K OUT``: candidate Z3, the files fitted at 2,048, 3,072 and 4,096 tokens alone at kept
fractions <= 0.1, H (written with a third point at 3,072 tokens, its own reading there) from 0.2 up.

python make_files.py h2|z /tmp/perlen/kvzap-2048.safetensors OUT.safetensors
python make_files.py z3 /tmp/perlen/kvzap-2048.safetensors /tmp/perlen/kvzap-3072.safetensors OUT.safetensors
"""

import math
import sys
from pathlib import Path

from pipeline.engine.kvzap_file import per_length_file, read_metadata, write_kvzap
from pipeline.engine.kvzap_file import read_kvzap as read
from pipeline.kv.kvzap_model import KVzapModel, per_length_model

PER_LENGTH = Path(__file__).parent.parent / "kvzap-per-length"
POOLED, FOUR_K = PER_LENGTH / "kvzap-pooled.safetensors", PER_LENGTH / "kvzap-4096.safetensors"


def with_four_k(short: Path) -> tuple[KVzapModel, dict, dict]:
    """``short`` read at 2,048 tokens and the 4K file at 4,096 (``../kvzap-per-length/make_h.py``'s construction)."""
    return per_length_file([short, FOUR_K], [2048, 4096])


def write(out: str, model: KVzapModel, fit: dict, settings: dict) -> None:
    meta = read_metadata(POOLED)
    print(write_kvzap(out, model, meta["model"], meta["fingerprint"], fit, settings))


def h2(two_k: Path, out: str) -> None:
    write(out, *with_four_k(two_k))


def z(two_k: Path, out: str) -> None:
    from pipeline.kv.kvzap_model import per_size_model  # the per-size format: at 2192ef1, removed since

    (small, small_fit, small_settings), (large, large_fit, large_settings) = with_four_k(two_k), with_four_k(POOLED)
    fit = {"per_size": {"0.1": small_fit, "0.2": large_fit}}
    settings = {"per_size": {"0.1": small_settings, "0.2": large_settings}}
    write(out, per_size_model([small, large], [0.1, 0.2]), fit, settings)


def mixed(a: KVzapModel, b: KVzapModel, t: float) -> KVzapModel:
    """(1 - t) a + t b, weights, biases and tables: a per-length file's reading between its two lengths."""
    tensors = {name: (1 - t) * a.tensors[name] + t * b.tensors[name] for name in ("weight", "bias")}
    return KVzapModel("linear", tensors, (1 - t) * a.shares + t * b.shares, a.share_sizes)


def z3(two_k: Path, three_k: Path, out: str) -> None:
    from pipeline.kv.kvzap_model import per_size_model  # the per-size format: at 2192ef1, removed since

    lengths = [2048, 3072, 4096]
    small, small_fit, small_settings = per_length_file([two_k, three_k, FOUR_K], lengths)
    pooled, four_k = read(POOLED), read(FOUR_K)
    large = per_length_model([pooled, mixed(pooled, four_k, math.log(1.5) / math.log(2)), four_k], lengths)
    fit = {"per_size": {"0.1": small_fit, "0.2": "shipped (H)"}}
    settings = {"per_size": {"0.1": small_settings, "0.2": "shipped (H)"}}
    write(out, per_size_model([small, large], [0.1, 0.2]), fit, settings)


if __name__ == "__main__":
    if sys.argv[1] in ("h2", "z"):
        {"h2": h2, "z": z}[sys.argv[1]](Path(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "z3":
        z3(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(__doc__)
