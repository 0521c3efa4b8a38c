"""The hybrid KVzap files of this folder's "predictor and table apart" section: one file's predictor
(``weight``, ``bias``) with another's shares table (or the mean of two tables). Metadata is the 24-document
file's (it names the model copy the sweeps load; the engine reads only the tensors and the model check).

    python docs/results/self-calibration-24/make_hybrids.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[2] / "pipeline" / "resources" / "kvzap" / "smollm2-135m-instruct.safetensors"


def load(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ship, _ = load(SHIPPED)
    for length in ("2k", "4k"):
        own, meta = load(HERE / f"kvzap-self24-{length}.safetensors")
        assert bool((own["share_sizes"] == ship["share_sizes"]).all()), "the two tables must be given at the same sizes"
        files = {
            f"shippred-self24shares-{length}": {**ship, "shares": own["shares"]},
            f"shippred-meanshares-{length}": {**ship, "shares": (ship["shares"] + own["shares"]) / 2},
        }
        if length == "2k":
            files["selfpred24-shipshares-2k"] = {**own, "shares": ship["shares"]}
        for name, tensors in files.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{name}.safetensors"), metadata=meta)
            print(out / f"{name}.safetensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
