"""The GPU check's two additions to a plain prefill: KVzip's reconstruction passes on a model without a
tokenizer, and decode throughput at a fixed KV memory budget.

* :func:`finish_passes` runs :class:`pipeline.engine.reconstruction.ContextReconstruction` (the
  engine's own passes, KVzip, arXiv 2505.23416) with :class:`RandomPrompts` standing in for the
  tokenizer: the instructions are runs of fixed token ids about as long as the real ones, so a pass
  costs what it costs in a job (random weights make the scores meaningless, not the time).
* :func:`measure_throughput`: tokens/s of greedy decode steps at the largest batch whose caches fit
  ``memory_bytes`` of KV memory (the question of "Throughput from the freed memory": what the freed
  memory buys). One document's compressed cache is given; the batch is its row copied ``B`` times
  (:meth:`pipeline.kv.storage.store.VarLenLayer.concat`), which costs the decode exactly what ``B``
  different documents of the same kept lengths cost. ``B = floor(budget / bytes of one row)``
  with the row's bytes as the cache counts them (entries, positions, segment tables and the slots
  reserved for the decoded tokens).
"""

from __future__ import annotations

import statistics
import subprocess
import time

import torch

from pipeline.engine.reconstruction import ContextReconstruction
from pipeline.kv.attention.varlen_kernels import KernelChoice
from pipeline.kv.prefill.rules import plan_prefill
from pipeline.kv.storage.cache import VarLenCache, run_chunk
from pipeline.kv.storage.store import VarLenLayer

TAIL_TOKENS = 5  # end of the user turn + the assistant header in Llama-3's template
MAX_BATCH = 1024


class RandomPrompts:
    """The two methods of :class:`pipeline.engine.prompts.PromptBuilder` that the passes use, without a
    tokenizer: ``1.3`` ids per word of the text (about what a BPE tokenizer gives English), fixed ids."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def text_ids(self, text: str) -> list[int]:
        count = round(1.3 * len(text.split()))
        return [(1000 + i) % self.vocab_size for i in range(count)]

    def tail_ids(self) -> list[int]:
        return [(2000 + i) % self.vocab_size for i in range(TAIL_TOKENS)]


def finish_passes(model, cache: VarLenCache, ids: torch.Tensor) -> float:
    """KVzip's passes over the prefilled context ``ids`` (1, n) and the compression of every pending
    layer; returns their seconds (also added to ``cache.compress_seconds``)."""
    cfg = cache.compressor.config
    t0 = time.perf_counter()
    passes = ContextReconstruction(model, RandomPrompts(model.config.vocab_size), 0, ids.device)
    held = cache.prefill.awaiting_passes
    scores = passes.scores([ids[0].tolist()], [0], held, cfg.reconstruction_chunk, cfg.kvzip_plus)
    sync(ids.device)
    seconds = time.perf_counter() - t0
    cache.compress_seconds += seconds
    cache.prefill.finish(scores)
    return seconds


def chunked_prefill(model, cache: VarLenCache, ids: torch.Tensor, chunk: int) -> None:
    """The context ``ids`` (1, n) through the model ``chunk`` tokens at a time, the cache compressed
    after each chunk, as the engine's chunked prefill drives it (:mod:`pipeline.kv.prefill.chunk_eviction`)."""
    n, device = ids.shape[1], ids.device
    strategy = cache.begin_prefill(plan_prefill(cache.compressor.config), lengths=torch.tensor([n], device=device))
    for begin in range(0, n, chunk):
        end = min(begin + chunk, n)
        run_chunk(model, cache, ids[:, begin:end], torch.arange(begin, end, device=device)[None], logits_to_keep=1)
        strategy.after_forward(torch.tensor([end], device=device))
    strategy.finish()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sm_clock_mhz(device: torch.device) -> int | None:
    """The GPU's SM clock now (MHz; NVML, else ``nvidia-smi``), None on CPU or where neither answers.
    Read right after a timed decode: a host-bound decode may run on a clocked-down GPU
    (``docs/results/gpu/README.md``)."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - pynvml missing or the query refused: ask nvidia-smi
        pass
    index = device.index if device.index is not None else torch.cuda.current_device()
    query = ["nvidia-smi", f"--id={index}", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"]
    try:
        return int(subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.split()[0])
    except Exception:  # noqa: BLE001 - no nvidia-smi or no figure in its answer
        return None


@torch.inference_mode()
def timed_step(model, cache: VarLenCache, position: int) -> tuple[float, float]:
    """One greedy-shaped decode step (token 42 in every row, at ``position``), the device synchronised
    around it: (seconds, host seconds). The host seconds end when the forward returns, before the final
    synchronisation: close to the step's seconds, the host bounds the step (launches, or a
    synchronisation inside); far below them, the device does."""
    rows, device = cache.store[0].num_rows, cache.store[0].keys.device
    token = torch.full((rows, 1), 42, device=device)
    pos = torch.full((rows, 1), position, device=device)
    sync(device)
    t0 = time.perf_counter()
    run_chunk(model, cache, token, pos, logits_to_keep=1)
    t_host = time.perf_counter()
    sync(device)
    return time.perf_counter() - t0, t_host - t0


def timed_decode_steps(
    model, cache: VarLenCache, start: int, steps: int, warmup: int, host: list[float] | None = None
) -> list[float]:
    """Seconds of ``steps`` decode steps (:func:`timed_step`, positions ``start``, ``start + 1``, ...)
    after ``warmup`` untimed ones; ``host``, when given, receives each timed step's host seconds."""
    times = []
    for i in range(warmup + steps):
        seconds, host_seconds = timed_step(model, cache, start + i)
        if i >= warmup:
            times.append(seconds)
            if host is not None:
                host.append(host_seconds)
    return times


def batch_of(cache: VarLenCache, rows: int, kernels: KernelChoice | None = None) -> VarLenCache:
    """A cache of ``rows`` copies of ``cache``'s single row (its reserved slots included)."""
    layers = [VarLenLayer.concat([layer] * rows) for layer in cache.store]
    return VarLenCache.from_layers(layers, cache.compressor, kernels or cache.kernels)


@torch.inference_mode()
def measure_throughput(
    model, one: VarLenCache, memory_bytes: int, steps: int, warmup: int, kernels: KernelChoice | None = None
) -> dict:
    """Decode tokens/s of the largest batch of copies of ``one`` (a compressed single-row cache) that
    fits ``memory_bytes``, read with ``kernels`` (None: chosen per call).

    Returns batch, row bytes, KV bytes held, median ms per step, tokens/s, the attention kernel and
    the peak memory of the decode (CUDA)."""
    device = one.store[0].keys.device
    start = max(int(layer.positions.max()) for layer in one.store) + 1  # after what the row holds
    one.reserve(steps + warmup + 1)
    row_bytes = int(one.nbytes())
    rows = max(1, min(MAX_BATCH, memory_bytes // row_bytes))
    batch = batch_of(one, rows, kernels)
    held = int(batch.nbytes())  # at most rows x row_bytes (a single row also caches its flat-kernel mask)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    host: list[float] = []
    step_s = statistics.median(timed_decode_steps(model, batch, start, steps, warmup, host))
    return {
        "batch": rows,
        "row_bytes": row_bytes,
        "kv_bytes": held,
        "step_ms": 1000.0 * step_s,
        "host_ms": 1000.0 * statistics.median(host),
        "tokens_per_s": rows / step_s,
        "kernel": ",".join(sorted(batch.kernels_used)),
        "sm_mhz": sm_clock_mhz(device),
        "peak_decode": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
    }
