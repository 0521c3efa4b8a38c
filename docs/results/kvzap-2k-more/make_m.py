"""Candidate M of README.md: the shipped file's construction (``../kvzap-per-length/make_h.py``) with a
2K fit from 48 documents between the pooled file and the 4K file: the pooled file read at 1,024 tokens and
below, the 48-document 2K file at 2,048, the 4K file at 4,096 and above, linear in log length between.

python make_m.py KVZAP_2048_48.safetensors OUT.safetensors

Candidate P of round 2 (``--pooled``): the given file in the pooled file's place, read at 2,048 tokens and
below, the 4K file at 4,096 and above (as ``../kvzap-per-length/make_h.py`` makes the shipped file).

python make_m.py --pooled KVZAP_POOLED_MORE_2K.safetensors OUT.safetensors
"""

import sys
from pathlib import Path

from pipeline.engine.kvzap_file import per_length_file, read_metadata, write_kvzap

PER_LENGTH = Path(__file__).parent.parent / "kvzap-per-length"
POOLED, FOUR_K = PER_LENGTH / "kvzap-pooled.safetensors", PER_LENGTH / "kvzap-4096.safetensors"

if __name__ == "__main__":
    if sys.argv[1] == "--pooled":
        model, fit, settings = per_length_file([Path(sys.argv[2]), FOUR_K], [2048, 4096])
    else:
        model, fit, settings = per_length_file([POOLED, Path(sys.argv[1]), FOUR_K], [1024, 2048, 4096])
    meta = read_metadata(POOLED)
    print(write_kvzap(sys.argv[-1], model, meta["model"], meta["fingerprint"], fit, settings))
