"""Decode ms per step of a full and compressed caches, interleaved step by step: the per-token
comparison that survives a host whose speed drifts.

Why: on the lent H200 every batch-1 decode step is host bound (the forward returns only when the
step is done: ``host ms`` equals ``ms`` in ``benchmarks/gpu_check.py``'s table), and the host's speed
drifts within a run; the full cache at 8K took 96.9 ms per step when measured first and 26.2 ms
when measured again after the other methods (``docs/results/gpu/README.md``). Methods measured one
after the other then compare moments, not caches. Here every round times one step of each cache in
turn (the order rotating each round), so drift falls on all of them alike, and the ratio is the
median of the per-round ratios.

    python -m benchmarks.gpu_decode_ab                       # CUDA: 32K tokens, batches 1, 4, 9
    python -m benchmarks.gpu_decode_ab --smoke --device cpu  # tiny model: the plumbing

Each method's cache is prefilled once (one row; :func:`benchmarks.gpu_check.prefill`), then copied
to each batch size (:func:`benchmarks.gpu_batch.batch_of`; the largest default, 9, is the most
full 32K caches of the 8B shape that fit 40 GiB). ``criticalkv-adakv-snapkv`` stands for a ragged
cache (per-head budgets) without KVzip's 37 s of passes at 32K; its decode reads the store as the
default's does.

A method may force kernels after ``@``: ``criticalkv-snapkv@dense=grouped`` reads the uniform cache
with grouped matmuls instead of SDPA, ``none@varlen=blocked,...`` (fields of
:class:`pipeline.kv.attention.varlen_kernels.KernelChoice`, joined by ``+``: ``@dense=grouped+varlen=sdpa``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.gpu_batch import batch_of, timed_step
from benchmarks.gpu_check import free, prefill
from benchmarks.gpu_model import LLAMA_31_8B, SMOKE, build_model, compressor
from pipeline.kv.attention.varlen_kernels import KernelChoice
from pipeline.kv.storage.cache import VarLenCache

DEFAULT_METHODS = "none,criticalkv-snapkv,criticalkv-adakv-snapkv"


def interleaved_steps(model, caches: dict[str, VarLenCache], start: int, rounds: int, warmup: int) -> dict:
    """``warmup + rounds`` rounds; each round one decode step (:func:`benchmarks.gpu_batch.timed_step`)
    of every cache in ``caches``, the order rotated by one each round. Returns per method the timed
    steps' seconds (lists of ``rounds``)."""
    names = list(caches)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + rounds):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            seconds, _ = timed_step(model, caches[name], start + i)
            if i >= warmup:
                times[name].append(seconds)
    return times


def summarise(times: dict[str, list[float]], reference: str) -> dict[str, dict]:
    """Per method: median ms per step, and the median over rounds of (reference step ÷ its step)."""
    out = {}
    for name, steps in times.items():
        ratios = [ref / own for ref, own in zip(times[reference], steps)]
        out[name] = {"ms": 1000.0 * statistics.median(steps), "speedup": statistics.median(ratios)}
    return out


def parse_method(spec: str) -> tuple[str, KernelChoice | None]:
    """``method[@field=kernel+field=kernel]`` -> the method and the kernels it is read with."""
    method, _, forced = spec.partition("@")
    if not forced:
        return method, None
    fields = dict(item.split("=", 1) for item in forced.split("+"))
    return method, KernelChoice(**fields)


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(SMOKE if args.smoke else LLAMA_31_8B, device, dtype)
    specs = [m for m in args.methods.split(",") if m]
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), device=device)
    singles, forced = {}, {}
    for spec in specs:
        method, forced[spec] = parse_method(spec)
        if method not in singles:
            _, singles[method] = prefill(model, compressor(method, args.cache_size, model), ids)
            singles[method].reserve(args.rounds + args.warmup + 1)
    rows = []
    for b in [int(x) for x in args.batches.split(",") if x]:
        # copies: every batch starts alike
        caches = {s: batch_of(singles[parse_method(s)[0]], b, forced[s]) for s in specs}
        stats = summarise(interleaved_steps(model, caches, args.length, args.rounds, args.warmup), specs[0])
        for m, s in stats.items():
            kernel = ",".join(sorted(caches[m].kernels_used))
            rows.append({"batch": b, "method": m, "kv_bytes": int(caches[m].nbytes()), "kernel": kernel, **s})
        del caches
        free(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "length": args.length, "rounds": args.rounds, "cache_size": args.cache_size, "rows": rows}


def markdown(result: dict) -> str:
    lines = [
        f"Interleaved decode on {result['device']}, {result['length']} tokens, {result['rounds']} rounds "
        f"(one step of each cache per round); speedup = median over rounds of the first method's step ÷ this one's.",
        "",
        "| batch | method | KV GiB | kernel | ms/step | speedup |",
        "|---:|---|---:|---|---:|---:|",
    ]
    for r in result["rows"]:
        gib = r["kv_bytes"] / 2**30
        lines.append(
            f"| {r['batch']} | {r['method']} | {gib:.2f} | {r['kernel']} | {r['ms']:.1f} | {r['speedup']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model (CPU-friendly)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda | cuda:N | cpu")
    p.add_argument("--length", type=int, default=None, help="context tokens (default 32768; smoke 256)")
    p.add_argument("--batches", default="1,4,9", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="the first is the reference (default: %(default)s)")
    p.add_argument("--cache-size", type=float, default=0.2, help="kept fraction (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=32, help="timed rounds (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: %(default)s)")
    p.add_argument("--out", default=None, help="directory for gpu_decode_ab.md and .json")
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.smoke:
        print("error: the 8B shape needs a GPU (use --smoke on CPU)", file=sys.stderr)
        return 2
    args.length = args.length or (256 if args.smoke else 32768)
    result = run(args)
    table = markdown(result)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_decode_ab.md").write_text(table + "\n")
        (Path(args.out) / "gpu_decode_ab.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
