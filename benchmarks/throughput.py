"""Throughput of one actor at the same KV memory budget: the full cache, compressed caches in the
continuous decode batch, and plain transformers, side by side in one run.

    python -m benchmarks.throughput [--docs 8] [--length 2048] [--new-tokens 64] [--full-caches 4]
                                    [--methods none,criticalkv-shares-kvzap] [--cache-sizes 0.2,0.4]
                                    [--out docs/results/benchmarks/throughput.md]

Every side answers the same ``--docs`` documents of ``--length`` tokens (built-in sample text) with
one instruction each (``--question``, by default "summarize"; at most ``--new-tokens`` greedy tokens).
The KV memory budget is what ``--full-caches`` full caches of these documents need (their question and
answer included):

* **ours continuous**: ``Engine.generate`` with ``kv_memory`` = the budget (documents prefilled one
  at a time, decoded together while they fit, rows leaving as they end;
  :mod:`pipeline.engine.continuous`), for the full cache and each compressed method x cache size;
* **ours batch**: the full cache on the batch path, ``--full-caches`` documents prefilled together
  (left padded), then decoded in the same loop (rows leave as they end; before the one decode loop
  this path decoded until the longest answer ended);
* **transformers**: the same model with SDPA and ``generate``'s ``DynamicCache``, left-padded batches
  of ``--full-caches`` documents (the batch that fits the budget), the same prompt ids, greedy.

Reported per side: wall seconds, generated tokens (EOS counted, as the output's column), tokens/s,
documents/hour, the mean and largest decode batch and the largest KV bytes held (continuous sides),
and memory: the process' peak resident growth over the side's run and, for ours, the growth of one
prefill of the longest document alone (its compressed cache included), measured just before. An
actor's working memory should stay within the KV budget + that one prefill (the model is loaded
before either is measured): the ``within`` column checks it. Run with ``MALLOC_MMAP_THRESHOLD_=65536``
so that freed tensors leave the resident set (glibc otherwise keeps small blocks in its heap).
Sides run one after another in one process; only ratios from one run are claims.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import context_ids
from benchmarks.roofline import PeakRSS, header, table, write_report
from pipeline.engine.config import GenerationConfig, ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.loading import load_model
from pipeline.engine.sequences import DocumentSource
from pipeline.engine.types import Request
from pipeline.kv.attention.registered import register
from pipeline.kv.config import CompressionConfig

HERE = Path(__file__).resolve().parent

INSTRUCTION = "Summarize the document in a few sentences."


def documents(tokenizer, count: int, length: int, question: str = INSTRUCTION) -> list[Request]:
    return [
        Request(f"doc{i}", tokenizer.decode(context_ids(tokenizer, length, seed=101 * i)[0]), [question])
        for i in range(count)
    ]


def full_cache_bytes(engine: Engine, requests: list[Request]) -> int:
    """Bytes the largest document's full cache takes in our layout, room for its question and answer
    included (what the continuous batch reserves for it; transformers' cache needs about as much)."""
    source = DocumentSource(engine.runner, engine.compressor)
    return max(source.estimate(0, row) for request in requests for row in engine._rows_for(request))


def run_ours(engine: Engine, requests: list[Request]) -> dict:
    engine.model.set_attn_implementation(register())
    longest = max(requests, key=lambda r: len(r.context))
    with PeakRSS() as prefill:
        cache = engine.compress_context(longest)
    del cache
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        answers = engine.generate(requests)
        wall = time.perf_counter() - t0
    errors = [a.error for a in answers if a.error]
    if errors:
        raise RuntimeError(f"{len(errors)} answers failed, first: {errors[0]}")
    stats = engine.last_continuous if engine.continuous else None
    return {
        "wall": wall,
        "tokens": sum(a.generated_tokens for a in answers),
        "mean_batch": stats.row_steps / stats.steps if stats and stats.steps else None,
        "largest_batch": stats.largest_batch if stats else engine.generation.batch_size,
        "largest_kv": stats.largest_bytes if stats else None,
        "kept": sum(a.kv_bytes_kept for a in answers) / sum(a.kv_bytes_full for a in answers),
        "peak": mem.delta_bytes,
        "prefill_peak": prefill.delta_bytes,
    }


@torch.inference_mode()
def run_transformers(engine: Engine, requests: list[Request], batch: int, new_tokens: int) -> dict:
    model = engine.model
    model.set_attn_implementation("sdpa")
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        tokens = sum(
            generate_batch(engine, requests[b : b + batch], new_tokens) for b in range(0, len(requests), batch)
        )
        wall = time.perf_counter() - t0
    model.set_attn_implementation(register())
    return {
        "wall": wall,
        "tokens": tokens,
        "mean_batch": None,
        "largest_batch": batch,
        "largest_kv": None,
        "kept": 1.0,
        "peak": mem.delta_bytes,
        "prefill_peak": None,
    }


def generate_batch(engine: Engine, requests: list[Request], new_tokens: int) -> int:
    """transformers' padded ``generate`` of one batch; returns the tokens generated (EOS counted)."""
    pad, eos = engine.decoder.pad_id, sorted(engine.decoder.eos_ids)
    prompts = [engine.prompts.encode(r.context, r.questions) for r in requests]
    seqs = [p.context_ids + p.question_ids[0] for p in prompts]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, seq in enumerate(seqs):
        ids[b, width - len(seq) :], mask[b, width - len(seq) :] = torch.tensor(seq), 1
    out = engine.model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad, eos_token_id=eos
    )
    tokens = 0
    for row in out[:, width:].tolist():
        ended = [i for i, t in enumerate(row) if t in eos]
        tokens += ended[0] + 1 if ended else len(row)
    return tokens


def engine_for(loaded, method: str, size: float, generation: GenerationConfig) -> Engine:
    config = CompressionConfig(method=method, cache_size=1.0 if method == "none" else size)
    return Engine(loaded, config, generation)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--length", type=int, default=2048, help="context tokens per document")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--question",
        default=INSTRUCTION,
        help="what each document is asked (default: the summary instruction; a short question with a small "
        "--new-tokens measures the QA job's case)",
    )
    p.add_argument("--full-caches", type=int, default=4, help="the KV budget: this many full caches")
    p.add_argument("--methods", default="criticalkv-shares-kvzap", help="compressed methods, comma-separated")
    p.add_argument("--cache-sizes", default="0.2,0.4")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="PNG of tokens/s and the mean decode batch per side")
    args = p.parse_args()
    loaded = load_model(ModelConfig(name="smollm2"))
    probe = Engine(loaded, CompressionConfig(), GenerationConfig(max_new_tokens=args.new_tokens))
    requests = documents(loaded.tokenizer, args.docs, args.length, args.question)
    budget = args.full_caches * full_cache_bytes(probe, requests)
    continuous = GenerationConfig(
        max_new_tokens=args.new_tokens, batch_size=args.docs, kv_memory=budget / 2**20, end_at_sentence=False
    )
    batched = GenerationConfig(max_new_tokens=args.new_tokens, batch_size=args.full_caches, continuous=False)
    sides = [("transformers DynamicCache, batch " + str(args.full_caches), None)]
    sides.append((f"ours none, batch path ({args.full_caches} prefilled together)", ("none", 1.0, batched)))
    sides.append(("ours none, continuous", ("none", 1.0, continuous)))
    for method in filter(None, (m.strip() for m in args.methods.split(","))):
        for size in (float(x) for x in args.cache_sizes.split(",")):
            sides.append((f"ours {method} @ {size:g}, continuous", (method, size, continuous)))
    results = {}
    for label, spec in sides:
        if spec is None:
            results[label] = run_transformers(probe, requests, args.full_caches, args.new_tokens)
        else:
            results[label] = run_ours(engine_for(loaded, spec[0], spec[1], spec[2]), requests)
        r = results[label]
        print(f"{label}: {r['wall']:.1f} s, {r['tokens']} tokens", flush=True)
    write_report(report(args, budget, results), args.out)
    if args.plot:
        plot(results, args, budget, args.plot)


def report(args, budget: int, results: dict) -> str:
    base = results["ours none, continuous"]
    hf = next(r for label, r in results.items() if label.startswith("transformers"))
    rows = []
    for label, r in results.items():
        rate = r["tokens"] / r["wall"]
        rows.append(
            [
                label,
                f"{r['wall']:.1f}",
                r["tokens"],
                f"{rate:.2f}",
                f"{rate / (base['tokens'] / base['wall']):.2f}",
                f"{rate / (hf['tokens'] / hf['wall']):.2f}",
                f"{3600 * args.docs / r['wall']:.0f}",
                "-" if r["mean_batch"] is None else f"{r['mean_batch']:.1f}",
                r["largest_batch"],
                "-" if r["largest_kv"] is None else f"{r['largest_kv'] / 2**20:.1f}",
                f"{r['kept']:.2f}",
                *memory_cells(r, budget),
            ]
        )
    columns = ["side", "wall s", "generated tokens", "tokens/s", "÷ ours full", "÷ transformers", "docs/hour"]
    columns += ["mean decode batch", "largest batch", "largest KV MiB", "kept ÷ full"]
    columns += ["peak MiB", "one prefill MiB", "within budget + prefill"]
    title = (
        f"Throughput at one KV budget: {args.docs} documents of {args.length} tokens, "
        f"{args.new_tokens} new tokens, budget {budget / 2**20:.1f} MiB ({args.full_caches} full caches)"
    )
    asked = f"\n- each document is asked: {args.question!r}"
    return header(title) + asked + "\n\n" + table(columns, rows, "l" + "r" * 13) + "\n"


def memory_cells(result: dict, budget: int) -> list[str]:
    """Peak growth, one prefill's growth, and whether the first stays within the budget plus the second."""
    peak, prefill = result["peak"], result["prefill_peak"]
    cells = ["-" if peak is None else f"{peak / 2**20:.0f}", "-" if prefill is None else f"{prefill / 2**20:.0f}"]
    within = "-" if peak is None or prefill is None else ("yes" if peak <= budget + prefill else "**no**")
    return cells + [within]


def plot(results: dict, args, budget: int, path: str) -> None:
    """Bars of generated tokens/s per side, each labelled with its mean decode batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    rates = [results[label]["tokens"] / results[label]["wall"] for label in labels]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(labels) + 1.5))
    compressed = ["@" in label for label in labels]  # "ours METHOD @ SIZE, continuous"
    bars = ax.barh(range(len(labels)), rates, color=["#2a7ab0" if c else "#999999" for c in compressed])
    for bar, label in zip(bars, labels):
        batch = results[label]["mean_batch"] or results[label]["largest_batch"]
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f"  batch {batch:.1f}", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens / s (one actor, whole run: prefill included)")
    ax.set_title(
        f"{args.docs} documents x {args.length} tokens, {args.new_tokens} new tokens, "
        f"KV budget {budget / 2**20:.0f} MiB",
        fontsize=9,
    )
    ax.set_xlim(0, max(rates) * 1.25)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
