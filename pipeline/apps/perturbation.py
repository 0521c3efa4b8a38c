"""``jobs/perturbation.py``: the CriticalKV paper's perturbation analysis on one model, to Parquet.

    python jobs/perturbation.py --model smollm2 --length 2048 --cache-sizes 0.2 \\
        --methods snapkv,criticalkv-snapkv,adakv-snapkv,criticalkv-adakv-snapkv --output OUT

Writes ``OUT/perturbation.parquet`` (one row per document x method x cache size x layer x KV head;
columns and formulas in :mod:`pipeline.eval.perturbation`) and ``OUT/headline.json``, and prints
the fraction of (document, layer, KV head) where each ``criticalkv-X`` method has a lower
attention-output perturbation than ``X``. Runs locally (no Ray): one full forward per document.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Literal

import pyarrow.parquet as pq
from pydantic import ConfigDict, Field

from pipeline.engine.config import ModelConfig
from pipeline.engine.loading import load_model
from pipeline.engine.priors import resolve_head_priors
from pipeline.eval.perturbation import method_configs, run_perturbation
from pipeline.eval.perturbation_docs import continuation_documents, question_documents
from pipeline.kv.config import ScoringKnobs
from pipeline.options import CommandLineConfig, OptionParser, fail, first_paragraph
from pipeline.report.perturbation import format_headline, headline

DEFAULT_METHODS = ["snapkv", "criticalkv-snapkv", "adakv-snapkv", "criticalkv-adakv-snapkv"]


class PerturbationJob(CommandLineConfig):
    """Diagnostics"""

    model_config = ConfigDict(extra="forbid")

    output: str = Field(description="output folder")
    length: int = Field(2048, ge=16, description="context tokens (question documents: context + question)")
    cache_sizes: list[float] = Field([0.2], description="kept fractions")
    methods: list[str] = Field(DEFAULT_METHODS, description="methods compared (spellings as --method)")
    queries: Literal["question", "continuation", "both"] = Field(
        "question",
        description="later queries: RULER question + teacher-forced answer, the context's next tokens, or both",
    )
    samples: int = Field(1, ge=1, description="documents per query kind")
    query_tokens: int = Field(64, ge=1, description="continuation: later tokens per document")
    task: str = Field("niah_single_2", description="RULER task of the question documents")
    seed: int = Field(0, description="seed of the documents")
    window_queries: int | None = Field(
        None, ge=0, description="last context queries of the in-sample 'window' probe (default: the window; 0 = off)"
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    compression: ScoringKnobs = Field(
        default_factory=ScoringKnobs, description="the knobs every compared method shares (--methods sets the rest)"
    )


def main(argv: list[str] | None = None) -> int:
    config, _ = OptionParser(PerturbationJob, prog="jobs/perturbation.py", description=first_paragraph(__doc__)).parse(
        argv
    )
    try:
        configs = {
            label: resolve_head_priors(c, config.model.name)
            for label, c in method_configs(config.methods, config.cache_sizes, config.compression).items()
        }
    except ValueError as exc:
        fail(f"invalid {exc}")
    t0 = time.perf_counter()
    loaded = load_model(config.model)
    docs = []
    if config.queries in ("question", "both"):
        docs += question_documents(loaded.tokenizer, config.length, config.samples, config.seed, config.task)
    if config.queries in ("continuation", "both"):
        docs += continuation_documents(
            loaded.tokenizer, config.length, config.samples, config.query_tokens, config.seed
        )

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=sys.stderr, flush=True)

    table = run_perturbation(
        loaded.model, docs, configs, model_name=config.model.name, progress=log, window_queries=config.window_queries
    )
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "perturbation.parquet")
    rows = headline(table)
    (out / "headline.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(format_headline(rows) or "no criticalkv-X / X pair among --methods")
    print(f"wrote {out / 'perturbation.parquet'} ({table.num_rows} rows) in {time.perf_counter() - t0:.0f}s")
    return 0
