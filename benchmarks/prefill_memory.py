"""Peak resident memory of one document, ours vs transformers' DynamicCache, with where it peaks.

    python -m benchmarks.prefill_memory [--lengths 2048,4096] [--methods none,kvzap[prefill_chunk=1024]]
                                        [--repeats 3 | 3,3,1] [--plot peaks.png]

For each length and side, a fresh Python process loads SmolLM2 (fp32, CPU), answers one short and
one full-size document as warm-up, then answers the measured document while a thread samples the
process' resident set (``/proc/self/statm``) every 0.2 ms. Forward pre-hooks on the decoder layers
and the LM head mark the timeline, so the report says in which layer (or stage) the peak fell.

* **ours**: ``Engine.generate`` with ``--methods`` (``none`` = the full cache; ``NAME[knob=value,...]``
  overrides knobs, e.g. a chunked prefill, or the engine's ``layerwise_prefill``): context prefill into
  the variable-length cache, question, greedy answer of ``--new-tokens`` tokens;
* **transformers**: the same model with SDPA attention and a ``DynamicCache``: ``model.model`` over
  the context, then the question and the same number of greedy steps. This is what kvpress's
  pipeline runs for a document without a press (its context prefill calls ``model.model`` with a
  ``DynamicCache``), in this venv so that both sides use the same torch and allocator. It is fed
  the very token ids ours prefills (the chat template around the context, then the question with
  the template's tail), so both caches hold the same number of tokens.

Peak = highest sampled RSS minus the RSS just before the document; the table shows the median over
``--repeats`` processes per side, sides alternating, and the range. Sampling (not ``VmHWM`` after a
warm-up) is used because glibc keeps freed small blocks in its heap: a high-water mark taken after
a warm-up mostly measures which side happened to reuse more of it. Even sampled, glibc's adaptive
mmap threshold makes single runs vary by tens of MiB; ``--mmap-threshold 65536`` fixes it, so the
figures follow the live tensors and repeat within about 1 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.roofline import header, parse_ints, table
from pipeline.engine.config import ModelConfig
from pipeline.options import split_top_level

HERE = Path(__file__).resolve().parent

QUESTION = "What is the special magic number mentioned in the text?"


PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident bytes of this process from ``/proc/self/statm`` (cheaper to read every 0.2 ms than
    the text of ``/proc/self/status`` that ``roofline.proc_status_bytes`` parses)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


def sampled_peak(model, fn) -> tuple[int, str]:
    """Run ``fn()`` while sampling RSS; returns (peak bytes above the start, the mark it fell in):
    "start", "layer i" (decoder layer ``i`` had begun) or "lm_head"."""
    start = rss_bytes()
    # only the highest sample is kept: a list of every 0.2 ms sample would itself grow the resident set
    # (about 100 bytes each, over 10 MiB in a minute) and inflate the longer runs' peaks
    highest = [time.perf_counter(), start]
    marks: list[tuple[float, str]] = [(highest[0], "start")]

    def marker(name: str):
        return lambda module, args: marks.append((time.perf_counter(), name))

    hooks = [layer.register_forward_pre_hook(marker(f"layer {i}")) for i, layer in enumerate(model.model.layers)]
    hooks.append(model.lm_head.register_forward_pre_hook(marker("lm_head")))
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss = rss_bytes()
            if rss > highest[1]:
                highest[:] = [time.perf_counter(), rss]
            time.sleep(0.0002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        stop.set()
        thread.join()
        for handle in hooks:
            handle.remove()
    when, peak = highest
    where = [name for t, name in marks if t <= when][-1]
    return max(0, peak - start), where


def ours(engine, text: str, new_tokens: int):
    from pipeline.engine.types import Request

    return lambda: engine.generate([Request("bench", text, [QUESTION], max_new_tokens=new_tokens)])


def transformers_side(engine, text: str, new_tokens: int):
    import torch
    from transformers import DynamicCache

    from pipeline.kv.attention.registered import cache_keyword

    model = engine.model
    prompt = engine.prompts.encode(text, [QUESTION])  # the token ids ours prefills and asks

    @torch.inference_mode()
    def run() -> None:
        ctx = torch.tensor([prompt.context_ids])
        cache = DynamicCache()
        model.model(input_ids=ctx, **{cache_keyword(model.model): cache})
        ids = torch.tensor([prompt.question_ids[0]])
        pos = torch.arange(ctx.shape[1], ctx.shape[1] + ids.shape[1])[None]
        for _ in range(new_tokens):
            out = model(input_ids=ids, position_ids=pos, logits_to_keep=1, **{cache_keyword(model): cache})
            ids, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos[:, -1:] + 1

    return run


def measure(engine, side: str, n_tokens: int, new_tokens: int) -> dict:
    """Warm up, then measure one ``n_tokens`` document on ``side`` ('ours' or 'transformers')."""
    from benchmarks.common import context_ids

    tokenizer, model = engine.tokenizer, engine.model
    ids = context_ids(tokenizer, n_tokens)[0].tolist()
    if side == "transformers":
        model.set_attn_implementation("sdpa")
        build = lambda text: transformers_side(engine, text, new_tokens)  # noqa: E731
    else:
        build = lambda text: ours(engine, text, new_tokens)  # noqa: E731
    build(tokenizer.decode(ids[: max(16, n_tokens // 8)]))()
    text = tokenizer.decode(ids)
    build(text)()
    peak, where = sampled_peak(model, build(text))
    return {"side": side, "tokens": n_tokens, "peak": peak, "where": where}


def worker(args) -> None:
    import torch

    from benchmarks.common import split_engine_knobs
    from pipeline.engine.config import GenerationConfig, ModelConfig
    from pipeline.engine.engine import Engine
    from pipeline.eval.sweep import parse_variant
    from pipeline.kv.config import CompressionConfig

    torch.set_num_threads(args.threads)
    method, overrides = parse_variant("none" if args.side == "transformers" else args.side)
    engine_knobs, overrides = split_engine_knobs(overrides)
    sliced = 0 if args.side == "transformers" else args.feed_forward_chunk  # transformers: as it ships
    engine = Engine.from_config(
        ModelConfig(name=args.model, feed_forward_chunk=sliced, **engine_knobs),
        CompressionConfig.model_validate({"method": method, "cache_size": args.cache_size, **overrides}),
        GenerationConfig(max_new_tokens=args.new_tokens, continuous=False),  # the path of the recorded figures
    )
    result = measure(engine, "transformers" if args.side == "transformers" else "ours", args.length, args.new_tokens)
    print("RESULT " + json.dumps({**result, "side": args.side}), flush=True)


def run_worker(args, side: str, n_tokens: int) -> dict:
    """One measurement in a fresh process (its own heap, so earlier documents cannot lend it memory)."""
    cmd = [sys.executable, "-m", "benchmarks.prefill_memory", "--worker", "--side", side, "--length", str(n_tokens)]
    cmd += ["--new-tokens", str(args.new_tokens), "--model", args.model, "--threads", str(args.threads)]
    cmd += ["--cache-size", str(args.cache_size), "--feed-forward-chunk", str(args.feed_forward_chunk)]
    env = dict(os.environ)
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} at {n_tokens} tokens failed:\n{proc.stderr[-2000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=parse_ints, default=[2048, 4096])
    p.add_argument("--methods", default="none", help="our methods, comma-separated (none = full cache)")
    p.add_argument("--cache-size", type=float, default=0.2, help="for compressed methods")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument(
        "--repeats", type=parse_ints, default=[3], help="fresh processes per side and length (or per length)"
    )
    p.add_argument("--plot", default=None, help="PNG of each side's peak against the context length")
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--feed-forward-chunk",
        type=int,
        default=ModelConfig.model_fields["feed_forward_chunk"].default,
        help="ours: tokens per MLP slice (0: whole sequence; default: the engine's, %(default)s); "
        "the transformers side always runs its MLPs whole",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        help="run the workers with MALLOC_MMAP_THRESHOLD_ set to this many bytes (glibc then returns every "
        "larger block at once, so RSS follows live tensors; default: glibc's adaptive threshold, as users run)",
    )
    p.add_argument("--out", default=None, help="also write the report here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    sides = ["transformers", *(m.strip() for m in split_top_level(args.methods) if m.strip())]
    repeats = args.repeats * len(args.lengths) if len(args.repeats) == 1 else args.repeats
    if len(repeats) != len(args.lengths):
        p.error("--repeats: give one count or one per length")
    curves: dict[str, list[tuple[int, float]]] = {side: [] for side in sides}
    for n, reps in zip(args.lengths, repeats):
        results: dict[str, list[dict]] = {side: [] for side in sides}
        for _ in range(reps):
            for side in sides:
                results[side].append(run_worker(args, side, n))
                print(f"{side} @ {n}: {mib(results[side][-1]['peak'])}", file=sys.stderr, flush=True)
        base = statistics.median(r["peak"] for r in results["transformers"])
        full = statistics.median(r["peak"] for r in results["none"]) if "none" in results else None
        for side, runs in results.items():
            label = "transformers DynamicCache" if side == "transformers" else f"ours {side}"
            peaks = [r["peak"] for r in runs]
            peak = statistics.median(peaks)
            curves[side].append((n, peak / 2**20))
            where = sorted({r["where"] for r in runs})
            ratio = f"{peak / base:.3f}" if base else "n/a"
            vs_full = f"{peak / full:.3f}" if full else "n/a"
            spread = f"{mib(min(peaks))} – {mib(max(peaks))}"
            rows.append([label, n, mib(peak), spread, ", ".join(where), ratio, vs_full])
    report = "\n".join(
        [
            header("Peak RSS of one document: ours vs transformers' DynamicCache"),
            f"- ours: MLP slices of {args.feed_forward_chunk or 'the whole sequence'} tokens",
            f"- allocator: MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"
            if args.mmap_threshold is not None
            else "- allocator: glibc defaults (adaptive mmap threshold)",
            "",
            table(
                ["side", "tokens", "peak above start (median)", "range", "peak in", "÷ transformers", "÷ ours none"],
                rows,
            ),
            "",
        ]
    )
    print(report)
    if args.out is not None:
        Path(args.out or HERE / "results" / "prefill_memory.md").write_text(report)
    if args.plot:
        plot_curves(curves, args.cache_size, args.plot)
    return 0


def plot_curves(curves: dict[str, list[tuple[int, float]]], cache_size: float, path: str) -> None:
    """Peak memory above the start (MiB) against the context length, one line per side."""
    import matplotlib  # benchmark-only: the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for side, points in curves.items():
        xs, ys = zip(*points)
        label = "transformers DynamicCache (full)" if side == "transformers" else side
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("peak memory above the start (MiB)")
    ax.set_title(f"One document's peak memory (SmolLM2 fp32, CPU, fresh process; cache size {cache_size:g})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
