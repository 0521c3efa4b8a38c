"""The within-document SmolLM2 KVzap file swept in this folder: the predictors ``fit(...,
within_documents=True)`` makes on the shipped file's calibration targets (the documents and split of
``jobs/calibrate_kvzap.py`` at the shipped settings, cached by ``probe.py``), with the shipped file's
shares table kept as it is (this fit's own table equals it to 1e-6 at every size from 0.1 up; only its
0.05 row differs, by up to 0.5, made by older code), so that the predictor is the one thing that differs.

    python docs/results/kvzap-within/make_file.py --cache /tmp/kvw --output FILE
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pipeline.apps.calibrate_kvzap import _split
from pipeline.engine.config import ModelConfig
from pipeline.engine.kvzap_file import load_kvzap, model_fingerprint, read_metadata, shipped_kvzap, write_kvzap
from pipeline.engine.loading import load_model
from pipeline.eval.kvzap_calibration import fit
from pipeline.kv.kvzap_model import KVzapModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="probe.py's --cache (calibration.pt)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    loaded = load_model(ModelConfig(name="smollm2"))
    shipped_path = shipped_kvzap("smollm2")
    shipped = load_kvzap(shipped_path, loaded.model, "smollm2")
    meta = read_metadata(shipped_path)
    targets = torch.load(args.cache / "calibration.pt", weights_only=False)
    train, held = _split(targets, meta["settings"]["validation"], meta["settings"]["seed"])
    fitted, report = fit(train, held, shipped.share_sizes.tolist(), within_documents=True)
    model = KVzapModel("linear", fitted.tensors, shipped.shares, shipped.share_sizes)
    settings = {**meta["settings"], "within_documents": True, "shares": "the previous shipped file's table"}
    path = write_kvzap(args.output, model, "smollm2", model_fingerprint(loaded.model), report, settings)
    print(f"{path}: in-document Spearman {report['mean']['spearman_in_document']:.3f} (held out)")


if __name__ == "__main__":
    main()
