"""When a call's documents are handed on (and a job commits them), by ``--decode-between-prefills``.

    python -m benchmarks.commit_times [--docs qa|mixed] [--pauses 0,0.25,0.5] [--repeats 2]
                                      [--out benchmarks/results/commit_times.md]

One engine call of 8 documents, as one actor call of a job with default settings: the built-in QA
samples (``--docs qa``: ``pipeline.data.synthetic.sample_qa_documents(8, 800)``, answers of 16-48
tokens) or 4 of them beside 4 generated reports to summarise (``mixed``: answers of at most 16 and 96
tokens). ``Engine.generate(requests, on_document=...)`` is what the actor streams from: the seconds
at which each document is handed on, counted from the call's start, are when a job commits it (plus
the driver's write). Pauses run interleaved (round r in order, round r+1 in reverse) after one
warm-up call; medians over ``--repeats``. Only ratios within one run are claims.

"first ÷ call" is the share of the call gone when its first document is handed on: below 0.5 the
first commit comes at least half of the call's time before the last one (issue #50's acceptance).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from benchmarks.roofline import header, median, table, write_report
from pipeline.data.synthetic import sample_qa_documents, sample_summarization_documents
from pipeline.engine.config import GenerationConfig, ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.types import Request
from pipeline.kv.config import DEFAULT_METHOD, CompressionConfig


def documents(kind: str) -> list[Request]:
    """The 8 documents of one call (module docstring)."""
    if kind == "qa":
        docs = sample_qa_documents(8, 800, 0)
    else:
        docs = sample_qa_documents(4, 800, 0) + sample_summarization_documents(4, 800, 0)
        for doc in docs:
            doc["max_new_tokens"] = 16 if doc["doc_id"].startswith("qa") else 96
    keys = ("doc_id", "context", "questions", "question_ids", "answer_prefix", "max_new_tokens")
    return [Request(*(doc[k] for k in keys)) for doc in docs]


def one_call(engine: Engine, requests: list[Request], pause: float) -> tuple[list[float], float]:
    """Seconds from the call's start at which each document was handed on (in that order), and the wall."""
    engine.runner = dataclasses.replace(
        engine.runner, generation=engine.runner.generation.model_copy(update={"decode_between_prefills": pause})
    )
    start, handed = time.perf_counter(), []
    engine.generate(requests, on_document=lambda i, answers: handed.append(time.perf_counter() - start))
    return handed, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", choices=["qa", "mixed"], default="qa")
    p.add_argument("--pauses", default="0,0.25,0.5", help="decode_between_prefills values, comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--method", default=DEFAULT_METHOD)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    pauses = [float(v) for v in args.pauses.split(",")]
    engine = Engine.from_config(ModelConfig(name="smollm2"), CompressionConfig(method=args.method), GenerationConfig())
    requests = documents(args.docs)
    engine.generate(requests[:2])  # warm-up
    runs: dict[float, list[tuple[list[float], float]]] = {v: [] for v in pauses}
    for r in range(args.repeats):
        for pause in pauses if r % 2 == 0 else pauses[::-1]:
            runs[pause].append(one_call(engine, requests, pause))
    base = median([wall for _, wall in runs[pauses[0]]])
    rows = []
    for pause in pauses:
        firsts, lasts = [h[0] for h, _ in runs[pause]], [h[-1] for h, _ in runs[pause]]
        wall = median([w for _, w in runs[pause]])
        spread = " · ".join(f"{t:.1f}" for t in runs[pause][0][0])
        rows.append(
            [pause, f"{median(firsts):.1f}", f"{median(lasts):.1f}", f"{wall:.1f}", f"{median(firsts) / wall:.2f}",
             f"{wall / base:.3f}", spread]
        )  # fmt: skip
    cols = ["pause", "first s", "last s", "call s", "first ÷ call", f"call ÷ pause {pauses[0]}", "handed on (run 1)"]
    text = header(f"Documents handed on within one call of 8 ({args.docs}), by decode_between_prefills")
    text += f"\n- method: {args.method}, repeats: {args.repeats}\n\n" + table(cols, rows)
    write_report(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
