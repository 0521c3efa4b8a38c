"""``jobs/calibrate_heads.py``: HeadKV priors from needle-copy retrieval scores, written as JSON.

    python jobs/calibrate_heads.py --model smollm2 --output priors.json [--lengths 512,1024 --depths 5]

The file is what ``--head-priors`` (the ``headkv`` allocation) reads; the recipe and the file format
are in :mod:`pipeline.eval.calibration`. Runs locally: one forward per (length, depth, sample).
"""

from __future__ import annotations

import sys
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.engine.config import ModelConfig
from pipeline.engine.loading import load_model
from pipeline.eval.calibration import build_cases, calibrate, priors_document, write_priors
from pipeline.options import OptionParser, fail, first_paragraph


class CalibrationJob(BaseModel):
    """Calibration"""

    model_config = ConfigDict(extra="forbid")

    output: str = Field(description="priors JSON file to write")
    lengths: list[int] = Field([512, 1024], description="context + question tokens of the needle cases")
    depths: int = Field(5, ge=1, description="needle depths, evenly spread over 0-100 %")
    samples: int = Field(2, ge=1, description="needles per (length, depth)")
    kinds: list[str] = Field(["numbers", "words"], description="needle values: numbers, words (alternating)")
    match: Literal["position", "token"] = Field(
        "position", description="a hit: the copied needle token's own position, or any needle position with that token"
    )
    haystack: Literal["essay", "noise"] = Field("essay", description="Paul Graham essays or RULER's noise sentences")
    seed: int = Field(0, description="seed of the needle cases")
    model: ModelConfig = Field(default_factory=ModelConfig)


def main(argv: list[str] | None = None) -> int:
    config, _ = OptionParser(
        CalibrationJob, prog="jobs/calibrate_heads.py", description=first_paragraph(__doc__)
    ).parse(argv)
    if not config.lengths:
        fail("invalid --lengths: give at least one length")
    depths = [round(100.0 * i / (config.depths - 1), 2) if config.depths > 1 else 50.0 for i in range(config.depths)]
    t0 = time.perf_counter()
    loaded = load_model(config.model)
    try:
        cases = build_cases(
            loaded.tokenizer, config.lengths, depths, config.samples, config.seed, config.kinds, config.haystack
        )
    except ValueError as exc:
        fail(str(exc))

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=sys.stderr, flush=True)

    result = calibrate(loaded.model, cases, config.match, progress=log)
    settings = {
        "seed": config.seed,
        "samples": config.samples,
        "haystack": config.haystack,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).replace("torch.", ""),
    }
    doc = priors_document(config.model.name, loaded.model.config, result, settings)
    path = write_priors(config.output, doc)
    scores = result.scores
    order = scores.flatten().argsort(descending=True)[:8].tolist()
    top = ", ".join(f"L{i // scores.shape[1]}H{i % scores.shape[1]}={float(scores.flatten()[i]):.2f}" for i in order)
    print(f"{len(cases)} cases, copy accuracy {doc['settings']['copy_accuracy']:.2f}, top heads: {top}")
    print(f"wrote {path} in {time.perf_counter() - t0:.0f}s")
    return 0
