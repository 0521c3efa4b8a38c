"""GPU check benchmark: a randomly initialised Llama-3.1-8B-shaped model through the library's cache.

Run by ``benchmarks/gpu_check.sh`` (which first runs the compression tests on CUDA); usable alone:

    python -m benchmarks.gpu_check                  # CUDA: 8K and 32K tokens, bf16, ~2-4 min on one big GPU
    python -m benchmarks.gpu_check --smoke          # tiny model and lengths; runs on CPU too

What it measures, with CUDA-synchronised timing (``torch.cuda.synchronize`` before every clock
read) and methods interleaved within each repeat (medians):

- prefill time (context prefill + compression) of ``none`` / ``snapkv`` / ``criticalkv-snapkv`` /
  ``criticalkv-adakv-snapkv`` (ragged per-head budgets: its decode reads the variable-length store
  through the varlen kernel, the uniform ones through a zero-copy dense view) / the jobs' default
  ``criticalkv-layer-kvzip`` and ``kvzip`` (both with KVzip's reconstruction passes,
  :func:`benchmarks.gpu_batch.finish_passes`; ragged) / the learned one-pass scorer
  ``criticalkv-shares-kvzap`` (a random predictor of the model's shape) in one pass and with the
  chunked prefill (``[chunked]``: ``--prefill-chunk`` tokens a chunk, default 4,096;
  :func:`benchmarks.gpu_batch.chunked_prefill`) and layer by layer (``[layerwise]``, 1024-token slices,
  the CPU default; this row decides whether it becomes the GPU default too),
  driven exactly like ``benchmarks/common.py`` drives it: ``VarLenCache`` + ``Compressor`` + the
  attention function from ``pipeline.kv.attention.registered.register``; one ``Compressor`` per method reused
  across repeats, as an engine does;
- decode ms/token after that prefill (fixed input token, after warm-up steps): the full cache
  (``none``) against the 20 % caches, and which attention path the decode took
  (``VarLenCache.kernels_used``: ``dense-sdpa`` (``dense-grouped`` on CPU), ``flash``, ``sdpa``,
  ``blocked``, ``flat`` (CPU, one ragged row) or ``reference``; force one with
  ``CRITICALKV_VARLEN_KERNEL``), and the SM clock right after it (NVML: a host-bound decode may run
  on a clocked-down GPU);
- kept KV bytes (``VarLenCache.nbytes()``, entries plus positions and segment tables) against the
  bytes of a full bf16 cache, and peak memory (``torch.cuda.max_memory_allocated``) during prefill
  and during decode, weights included;
- decode throughput at a fixed KV memory budget (``--kv-budget-gib``, default 40): the largest batch
  of copies of the full / 20 % uniform (``snapkv``) / 20 % ragged (the default, with the kernel
  chosen per call and with ``sdpa`` forced) cache that fits it, tokens/s
  (:func:`benchmarks.gpu_batch.measure_throughput`), built from the cache the first repeat's decode
  used (no extra prefill).

The model: ``LlamaConfig`` hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336,
vocab 128256 (Llama-3.1-8B's shapes; default RoPE, which does not change timing), built on the meta
device, materialised with ``to_empty`` and filled with N(0, 0.02) in place on the GPU: no weights are
downloaded and initialisation takes seconds. Random weights make the numbers about cost, not
quality. Prints one Markdown table (and writes it with a JSON copy under ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_batch import (
    chunked_prefill,
    finish_passes,
    measure_throughput,
    sm_clock_mhz,
    sync,
    timed_decode_steps,
)
from benchmarks.gpu_check_report import markdown
from benchmarks.gpu_model import LLAMA_31_8B, SMOKE, build_model, compressor
from pipeline.engine.layerwise import AUTO_LAYERWISE_SLICE, layerwise_prefill
from pipeline.kv.attention.varlen_kernels import KernelChoice
from pipeline.kv.compress import Compressor
from pipeline.kv.prefill.rules import plan_prefill
from pipeline.kv.storage.cache import VarLenCache, run_chunk

CHUNKED = "criticalkv-shares-kvzap[chunked]"  # the learned scorer, chunked prefill (--prefill-chunk) with eviction
LAYERWISE = "criticalkv-shares-kvzap[layerwise]"  # the same, layer by layer in 1024-token slices (the CPU default)
METHODS = (
    "none",
    "snapkv",
    "criticalkv-snapkv",
    "criticalkv-adakv-snapkv",
    "criticalkv-layer-kvzip",
    "criticalkv-shares-kvzap",
    CHUNKED,
    LAYERWISE,
    "kvzip",  # last: the default without CriticalKV, as slow; the first a short time budget skips
)
THROUGHPUT = {"none": (None,), "snapkv": (None,), "criticalkv-layer-kvzip": (None, "sdpa")}  # method: forced kernels


# ------------------------------------------------------------------ timing and memory
def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    sync(device)
    return int(torch.cuda.max_memory_allocated(device))


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def chunk_of(method: str, prefill_chunk: int) -> int | None:
    """``prefill_chunk`` for a ``[chunked]`` entry of ``METHODS``, else None (one pass)."""
    return prefill_chunk if method.endswith("[chunked]") else None


# ------------------------------------------------------------------ prefill / decode (as benchmarks/common.py)
@torch.inference_mode()
def prefill(model, compressor: Compressor, ids: torch.Tensor, layer_slice: int = 0) -> tuple[float, VarLenCache]:
    device = ids.device
    cache = VarLenCache(model.config.num_hidden_layers, compressor)
    pos = torch.arange(ids.shape[1], device=device)[None]
    plan = plan_prefill(compressor.config, layer_slice, ids.shape[1])
    sync(device)
    t0 = time.perf_counter()
    if compressor.config.chunked:
        chunked_prefill(model, cache, ids, compressor.config.prefill_chunk)
    elif plan.forward == "layer-by-layer":
        layerwise_prefill(model, cache, ids, pos, plan)
    else:
        run_chunk(model, cache, ids, pos, logits_to_keep=1)
    if cache.prefill is not None and cache.prefill.awaiting_passes is not None:  # KVzip: the passes, then compression
        finish_passes(model, cache, ids)
    sync(device)
    return time.perf_counter() - t0, cache


@torch.inference_mode()
def decode_ms_per_token(model, cache: VarLenCache, start: int, steps: int, warmup: int) -> tuple[float, float]:
    """Median ms per decode step and median host ms per step (see :func:`timed_decode_steps`)."""
    cache.reserve(steps + warmup + 1)
    host: list[float] = []
    step = statistics.median(timed_decode_steps(model, cache, start, steps, warmup, host))
    return 1000.0 * step, 1000.0 * statistics.median(host)


def full_kv_bytes(config, n: int, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elem = torch.tensor([], dtype=dtype).element_size()
    return n * config.num_hidden_layers * config.num_key_value_heads * 2 * head_dim * elem


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)) or "out of memory" in str(
        exc
    )


# ------------------------------------------------------------------ the run
class Check:
    """One run: the model, the per-method compressors, the time budget and the warnings."""

    def __init__(self, args) -> None:
        self.args, self.t_start = args, time.monotonic()
        self.device = torch.device(args.device)
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
        self.shape = SMOKE if args.smoke else LLAMA_31_8B
        torch.manual_seed(0)
        t0 = time.monotonic()
        self.model = build_model(self.shape, self.device, self.dtype)
        sync(self.device)
        self.init_s = time.monotonic() - t0
        self.compressors = {
            m: compressor(m.split("[")[0], args.cache_size, self.model, chunk_of(m, args.prefill_chunk))
            for m in METHODS
        }
        self.slices = {m: AUTO_LAYERWISE_SLICE if m == LAYERWISE else 0 for m in METHODS}
        self.gen = torch.Generator(device=self.device).manual_seed(1)
        self.warnings: list[str] = []
        self.throughput: list[dict] = []  # rows of the batch table, filled by measure_cell
        self.batch_lengths = {int(x) for x in args.batch_lengths.split(",") if x}

    def over_budget(self) -> bool:
        return time.monotonic() - self.t_start > self.args.budget_s

    def warm_up(self, what: str, fn) -> None:
        """Untimed runs that pay one-off costs; a failure here is noted, the timed cells report it."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            self.warnings.append(f"warm-up {what}: {type(exc).__name__}: {str(exc)[:160]}")
        finally:
            free(self.device)

    def random_ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.model.config.vocab_size, (1, n), device=self.device, generator=self.gen)

    def warm_up_methods(self, n: int) -> None:
        """Kernels, cuBLAS handles, the projection caches of the compressors."""
        warm = self.random_ids(n)
        for m in METHODS:

            def short_run(m=m):
                _, cache = prefill(self.model, self.compressors[m], warm, self.slices[m])
                decode_ms_per_token(self.model, cache, warm.shape[1], 1, 1)

            self.warm_up(f"{m} at {warm.shape[1]} tokens", short_run)

    def measure_length(self, n: int) -> list[dict]:
        """Every method at ``n`` tokens, interleaved over the repeats; one cell (row) per method."""
        ids = self.random_ids(n)
        if not self.over_budget():  # first prefill at a new length pays one-off costs (allocator, kernel choice)
            self.warm_up(f"snapkv at {n} tokens", lambda ids=ids: prefill(self.model, self.compressors["snapkv"], ids))
        label = f"{self.args.cache_size:.0%}"

        def cell(method: str, runs: str) -> dict:  # one table row: ``runs``' prefill (and decode) at n tokens
            cache = "full" if runs == "none" else label
            return {
                "tokens": n,
                "method": method,
                "runs": runs,
                "cache": cache,
                "prefill_s": [],
                "compress_s": [],
                "status": "ok",
            }

        cells = {m: cell(m, m) for m in METHODS}
        for r in range(self.args.repeats):
            for m in METHODS:
                if cells[m]["status"] != "ok":
                    continue
                if self.over_budget():
                    cells[m]["status"] = "skipped (time budget)"
                    continue
                self.measure_cell(cells[m], ids, decode=r == 0)
        if not self.over_budget():  # the first method once more, after all the others: does order matter?
            again = cell(f"{METHODS[0]} (again, last)", METHODS[0])
            self.measure_cell(again, ids, decode=True)
            cells[again["method"]] = again
        for c in cells.values():
            if c["status"].startswith("skipped") and c["prefill_s"]:  # cut short after its first repeats
                c["status"] = f"ok ({len(c['prefill_s'])} of {self.args.repeats} repeats)"
            c["prefill_median_s"] = statistics.median(c["prefill_s"]) if c["prefill_s"] else None
            c["compress_median_s"] = statistics.median(c["compress_s"]) if c["compress_s"] else None
        del ids
        free(self.device)
        return list(cells.values())

    def measure_cell(self, c: dict, ids: torch.Tensor, decode: bool) -> None:
        """One prefill of ``c``'s method (and its decode when ``decode``: the first repeat, so a run cut short by
        its time budget still has every decode figure); failures set its status."""
        device, cache = self.device, None
        try:
            free(device)
            reset_peak(device)
            seconds, cache = prefill(self.model, self.compressors[c["runs"]], ids, self.slices[c["runs"]])
            c["prefill_s"].append(seconds)
            c["compress_s"].append(cache.compress_seconds)
            c["peak_prefill"] = max(c.get("peak_prefill") or 0, peak_bytes(device) or 0) or None
            c["kept_bytes"] = int(cache.nbytes())
            c["full_bytes"] = full_kv_bytes(self.model.config, ids.shape[1], self.dtype)
            if decode and not self.over_budget():
                reset_peak(device)
                args = self.args
                c["decode_ms"], c["host_ms"] = decode_ms_per_token(
                    self.model, cache, ids.shape[1], args.decode_steps, args.decode_warmup
                )
                c["sm_mhz"] = sm_clock_mhz(device)
                c["peak_decode"] = peak_bytes(device)
                c["kernel"] = ",".join(sorted(cache.kernels_used))
                if ids.shape[1] in self.batch_lengths and c["method"] in THROUGHPUT:
                    self.measure_throughput(c["method"], cache, ids.shape[1])
        except Exception as exc:
            self.fail(c, exc)
        finally:
            del cache
            free(device)

    def fail(self, cell: dict, exc: Exception) -> None:
        """A measurement's failure in its table row (``OOM`` or the error); re-raised with --raise-errors."""
        cell["status"] = "OOM" if _is_oom(exc) else f"error: {type(exc).__name__}: {str(exc)[:120]}"
        if not _is_oom(exc) and self.args.raise_errors:
            raise exc

    def measure_throughput(self, method: str, cache: VarLenCache, n: int) -> None:
        """Decode tokens/s of the largest batch of copies of ``cache`` (one row) in ``--kv-budget-gib``
        of KV (``n``: its context length), with each kernel ``THROUGHPUT`` names for ``method``; one row
        each in ``self.throughput``."""
        for kernel in THROUGHPUT[method]:
            row = {"tokens": n, "method": method, "forced": kernel or "—", "budget_gib": self.args.kv_budget_gib}
            try:
                if self.over_budget():
                    row["status"] = "skipped (time budget)"
                    continue
                kernels = KernelChoice(varlen=kernel) if kernel else None
                args = self.args
                budget = int(args.kv_budget_gib * 2**30)
                row.update(
                    measure_throughput(self.model, cache, budget, args.decode_steps, args.decode_warmup, kernels),
                    status="ok",
                )
            except Exception as exc:  # noqa: BLE001 - reported in the table
                self.fail(row, exc)
            finally:
                free(self.device)
                self.throughput.append(row)

    def info(self) -> dict:
        args, device = self.args, self.device
        info = {
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "dtype": args.dtype,
            "smoke": args.smoke,
            "model": "random Llama-3.1-8B shape" if not args.smoke else "random tiny Llama (smoke)",
            "shape": self.shape,
            "weights_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "init_s": self.init_s,
            "repeats": args.repeats,
            "decode_steps": args.decode_steps,
            "prefill_chunk": args.prefill_chunk,
            "cache_size": args.cache_size,
            "elapsed_s": time.monotonic() - self.t_start,
            "flash_attn": _flash_attn_version(),
            "warnings": self.warnings,
        }
        with contextlib.suppress(Exception):
            import transformers

            info["transformers"] = transformers.__version__
        return info


def run(args) -> dict:
    check = Check(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    check.warm_up_methods(min(512, min(lengths)))
    result = {"rows": [], "throughput": check.throughput}
    for n in lengths:  # written after each length: a run killed at its hard limit keeps what it measured
        result["rows"] += check.measure_length(n)
        write(args.out, {**result, "info": check.info()})
    return {**result, "info": check.info()}


def write(out: str | None, result: dict) -> str:
    """The Markdown tables of ``result``, also written with a JSON copy under ``out`` when given."""
    table = markdown(result)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_check.md").write_text(table + "\n")
        (Path(out) / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return table


def _flash_attn_version() -> str | None:
    try:
        import flash_attn

        return getattr(flash_attn, "__version__", "installed")
    except Exception:  # noqa: BLE001
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model and lengths (CPU-friendly)")
    p.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument(
        "--lengths", default=None, help="comma-separated context lengths (default 8192,32768; smoke 256,512)"
    )
    p.add_argument("--cache-size", type=float, default=0.2, help="kept fraction of every compressed method")
    p.add_argument(
        "--prefill-chunk", type=int, default=None, help="tokens per chunk of [chunked] (default 4096; smoke 128)"
    )
    p.add_argument("--batch-lengths", default=None, help="lengths of --lengths with a throughput batch (default: all)")
    p.add_argument(
        "--kv-budget-gib", type=float, default=None, help="KV memory of the throughput batch (default 40; smoke 0.002)"
    )
    p.add_argument("--repeats", type=int, default=None, help="prefill repeats per method (default 2; smoke 1)")
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 32; smoke 4)")
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=360.0, help="start no new measurement after this many seconds")
    p.add_argument("--out", default=None, help="directory for gpu_check.md and gpu_check.json")
    p.add_argument("--allow-cpu-full", action="store_true", help="run the 8B shape on CPU (very slow)")
    p.add_argument("--raise-errors", action="store_true", help="stop on the first non-OOM error (debugging)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.device == "cpu" and not args.smoke and not args.allow_cpu_full:
        print("error: no CUDA device; the 8B-shaped run needs a GPU (use --smoke on CPU)", file=sys.stderr)
        return 2
    args.lengths = args.lengths or ("256,512" if args.smoke else "8192,32768")
    args.batch_lengths = args.lengths if args.batch_lengths is None else args.batch_lengths
    args.kv_budget_gib = args.kv_budget_gib or (0.002 if args.smoke else 40.0)
    args.repeats = args.repeats or (1 if args.smoke else 2)
    args.decode_steps = args.decode_steps or (4 if args.smoke else 32)
    args.prefill_chunk = args.prefill_chunk or (128 if args.smoke else 4096)
    result = run(args)
    print(write(args.out, result), flush=True)
    bad = [r for r in result["rows"] if r["status"].startswith("error")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
