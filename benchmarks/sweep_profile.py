"""Where a compression sweep's time goes: the phases of ``Engine.generate_sweep`` on RULER documents.

    python -m benchmarks.sweep_profile [--length 2048] [--tasks 6] [--cache-sizes 0.2,0.4] [--new-tokens 48]
                                       [--settings-per-decode 8]

SmolLM2 fp32 on CPU, in this process (no Ray): one RULER document per default task of
``jobs/eval_compression.py`` (the first ``--tasks`` of them), each swept alone over the full cache and
the job's default methods at each cache size, as the job's actors do. cProfile's cumulative time of
the functions that make up each phase (a phase's calls do not nest in another's):

- prefill: the shared context prefill (``ModelDecoder.prefill``);
- KVzip passes: the reconstruction passes, once per document (``SweepBatch._reconstructions``);
- compression: every setting's cache built from the captured dense K/V (``CaptureCache.compressed``);
- question prefill: each decode group's first questions over its caches (``Admission.open_together``);
- decode steps: greedy steps of the active rows (``ContinuousBatch._step``);
- answer fidelity: the reference answers' likelihood under each cache (``FidelityMeter.measure``).

Prints a Markdown table of seconds and shares of the wall time.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import time

from pipeline.apps.eval_sweep import DEFAULT_METHODS, DEFAULT_TASKS
from pipeline.engine.config import GenerationConfig, ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.types import Request
from pipeline.eval.sweep import ruler_documents, token_counter
from pipeline.kv.config import CompressionConfig

PHASES = {  # phase: (file suffix, function name)
    "prefill": ("pipeline/engine/prefill.py", "run"),
    "KVzip passes": ("pipeline/engine/sweep.py", "_reconstructions"),
    "compression": ("pipeline/kv/prefill/capture.py", "compressed"),
    "question prefill": ("pipeline/engine/admission.py", "open_together"),
    "decode steps": ("pipeline/engine/continuous.py", "_step"),
    "answer fidelity": ("pipeline/engine/fidelity.py", "measure"),
}


def phase_seconds(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative seconds of each phase's function in ``stats`` (0 where it never ran)."""
    out = dict.fromkeys(PHASES, 0.0)
    for (path, _, name), (_, _, _, cumulative, _) in stats.stats.items():
        for phase, (suffix, function) in PHASES.items():
            if name == function and path.endswith(suffix):
                out[phase] += cumulative
    return out


def profile_sweep(engine: Engine, requests: list[Request], settings: list[CompressionConfig]) -> dict:
    """Every request swept alone over ``settings``; wall seconds, phase seconds, the rows made and a
    digest of every row's prediction and kept entries (equal digests: the same rows)."""
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    answers = [a for req in requests for setting in engine.generate_sweep([req], settings) for a in setting]
    profiler.disable()
    wall = time.perf_counter() - t0
    digest = hashlib.sha256(repr([(a.prediction, a.kv_entries_kept) for a in answers]).encode()).hexdigest()[:16]
    return {"wall_s": wall, "rows": len(answers), "digest": digest, "phases": phase_seconds(pstats.Stats(profiler))}


def markdown(result: dict, documents: int, settings: int) -> str:
    wall, phases = result["wall_s"], result["phases"]
    lines = [
        f"{documents} documents x {settings} settings = {result['rows']} rows in {wall:.1f} s (in-process, profiled); "
        f"rows digest {result['digest']}",
        "",
        "| phase | s | share of wall |",
        "|---|---:|---:|",
    ]
    for phase, seconds in phases.items():
        lines.append(f"| {phase} | {seconds:.1f} | {seconds / wall:.0%} |")
    rest = wall - sum(phases.values())
    lines.append(f"| everything else | {rest:.1f} | {rest / wall:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048, help="context tokens (default: %(default)s)")
    p.add_argument("--tasks", type=int, default=len(DEFAULT_TASKS), help="first N default tasks (default: all)")
    p.add_argument("--cache-sizes", default="0.2,0.4", help="(default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=48, help="answer cap (default: %(default)s)")
    p.add_argument("--settings-per-decode", type=int, default=None, help="decode group size (default: the engine's)")
    args = p.parse_args(argv)
    group = {"settings_per_decode": args.settings_per_decode} if args.settings_per_decode else {}
    generation = GenerationConfig(max_new_tokens=args.new_tokens, **group)
    engine = Engine.from_config(ModelConfig(name="smollm2"), CompressionConfig(method="none"), generation)
    count = token_counter(engine.tokenizer)
    docs = ruler_documents(DEFAULT_TASKS[: args.tasks], args.length, 1, count, max_new_tokens=args.new_tokens)
    requests = [
        Request(
            d["doc_id"],
            d["context"],
            d["questions"],
            answer_prefix=d["answer_prefix"],
            max_new_tokens=d["max_new_tokens"],
        )
        for d in docs
    ]
    sizes = [float(s) for s in args.cache_sizes.split(",")]
    settings = [CompressionConfig(method="none")]
    settings += [CompressionConfig(method=m, cache_size=s) for s in sizes for m in DEFAULT_METHODS]
    print(markdown(profile_sweep(engine, requests, settings), len(requests), len(settings)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
