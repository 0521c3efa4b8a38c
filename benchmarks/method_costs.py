"""What each compression method costs at prefill: time (scoring and compression included) over the
plain prefill, peak memory above the process' level before the prefill, and kept bytes.

    python -m benchmarks.method_costs [--lengths 2048,4096] [--repeats 3] [--cache-size 0.2]
                                      [--methods none,snapkv,kvzap[prefill_chunk=1024],...]
                                      [--feed-forward-chunks 512,0]
                                      [--out benchmarks/results/method_costs.md]

``--repeats`` takes one count or one per length (``3,3,1``); a method may carry knob overrides as in
the sweeps (``NAME[knob=value,...]``, e.g. a chunked prefill, or the engine's ``layerwise_prefill``).
The peak column reuses one process' heap (methods run one after another): for each method's own peak
in a fresh process, use ``benchmarks/prefill_memory.py``.

SmolLM2 fp32 on CPU, the Engine's own path (``Engine.compress_context``: prefill, KVzip's
reconstruction passes where the method needs them, compression into the variable-length cache).
Methods are timed interleaved (round r runs them in order, round r+1 in reverse) and every figure
is a median over ``--repeats``; only ratios measured in the same run are claims. With several
``--feed-forward-chunks`` every method runs at each MLP slicing (``METHOD@TOKENS``; 0: the whole
sequence), interleaved with the rest; ratios are over the first slicing's ``none``. Peak memory
(``/proc/self/status`` VmHWM after a reset) is the process' growth during the prefill, model weights
excluded: per-layer methods hold one layer's dense K/V at a time, deferred methods (cross-layer
allocation, KVzip) the whole dense cache until they select.

``FLOPs ÷ plain`` is the floor the time ratio cannot beat at equal efficiency: the model's forward
FLOPs of the method's prefill (the context, plus KVzip's reconstruction passes with their token
counts as run) over the plain prefill's, counting the decoder's matmuls (2 per weight per token) and
the attention (4·H_q·D per visible key per query, causal). Scoring work is not counted. A pass of T
tokens over a context of n attends to n + its own keys, so where the model is narrow (SmolLM2: 576
wide, 9 query heads of 64) the passes' attention is as large as their matmuls and the floor exceeds 2.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

from benchmarks.common import context_ids, variant_engine
from benchmarks.roofline import PeakRSS, header, median, parse_ints, table
from pipeline.engine.config import ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.feed_forward import chunk_feed_forward
from pipeline.engine.loading import load_model
from pipeline.engine.types import Request
from pipeline.options import split_top_level

HERE = Path(__file__).resolve().parent

DEFAULT_METHODS = (
    "none,snapkv,criticalkv-snapkv,adakv-snapkv,layer-snapkv,knorm,defensivekv,criticalkv-adakv-defensivekv,"
    "layer-defensivekv,expected_attention,adakv-expected_attention,kvzip,layer-kvzip,criticalkv-layer-kvzip,"
    "kvzap,shares-kvzap,criticalkv-shares-kvzap,criticalkv-shares-kvzap[prefill_chunk=1024]"
)


def forward_tokens(model, fn) -> tuple[object, list[int]]:
    """``fn()``'s result and the tokens of each forward through the decoder while it ran (the
    prefill, then each reconstruction pass); pre-hooks on layers 0 and 1 only, microseconds per
    forward. Layer 0 called again before layer 1 ran is the next slice of the same forward (a
    layer-by-layer prefill), so its tokens add to that forward's."""
    seen: list[int] = []
    state = {"sliced": False}  # layer 0 ran and layer 1 has not yet

    def first(mod, args, kwargs):
        tokens = int(kwargs.get("hidden_states", args[0] if args else None).shape[1])
        if state["sliced"]:
            seen[-1] += tokens
        else:
            seen.append(tokens)
        state["sliced"] = True

    layers = model.base_model.layers
    handles = [
        layers[0].register_forward_pre_hook(first, with_kwargs=True),
        layers[1].register_forward_pre_hook(lambda *_: state.update(sliced=False), with_kwargs=True),
    ]
    try:
        result = fn()
    finally:
        for handle in handles:
            handle.remove()
    return result, seen


def forward_flops(model, tokens: list[int]) -> float:
    """Decoder FLOPs of forwards of ``tokens[0]`` context tokens, then passes of ``tokens[1:]``
    tokens each that attend to the whole context plus their own keys (see the module docstring)."""
    cfg = model.config
    weights = sum(p.numel() for layer in model.base_model.layers for p in layer.parameters() if p.dim() == 2)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_key = 4 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
    n = tokens[0]
    flops = 2 * weights * n + per_key * n * (n + 1) / 2
    for t in tokens[1:]:
        flops += 2 * weights * t + per_key * (n * t + t * (t + 1) / 2)
    return flops


def measure(engine_for, tokenizer, methods: list[str], n: int, repeats: int) -> dict[str, dict]:
    """Per method: prefill seconds, peak RSS growth and kept / full bytes of one ``n``-token document."""
    text = tokenizer.decode(context_ids(tokenizer, n)[0].tolist())
    request = Request("bench", text, ["?"])
    out = {m: {"seconds": [], "peak": [], "kept": None} for m in methods}
    engine_for(methods[0]).compress_context(request)  # warm up
    for r in range(repeats):
        for method in methods if r % 2 == 0 else list(reversed(methods)):
            engine = engine_for(method)
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                cache, out[method]["forwards"] = forward_tokens(engine.model, partial(engine.compress_context, request))
                seconds = time.perf_counter() - t0
            out[method]["seconds"].append(seconds)
            out[method]["peak"].append(mem.delta_bytes)
            tokens = len(engine.prompts.encode(request.context, request.questions).context_ids)
            shape = engine.shape
            full_bytes = tokens * shape.num_layers * shape.num_kv_heads * 2 * shape.head_dim * shape.itemsize
            out[method]["kept"] = cache.nbytes() / full_bytes
            out[method]["tokens"] = tokens
            del cache
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--repeats", default="3", help="one count, or one per length")
    p.add_argument("--cache-size", type=float, default=0.2)
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument(
        "--feed-forward-chunks",
        type=parse_ints,
        default=[ModelConfig.model_fields["feed_forward_chunk"].default],
        help="MLP slices (tokens; 0: whole) to run every method at (default: the engine's, %(default)s)",
    )
    p.add_argument("--out", default=str(HERE / "results" / "method_costs.md"))
    args = p.parse_args()
    methods = [m.strip() for m in split_top_level(args.methods) if m.strip()]
    slicings = args.feed_forward_chunks
    if len(slicings) > 1:
        methods = [f"{m}@{ff}" for ff in slicings for m in methods]
    lengths = parse_ints(args.lengths)
    repeats = parse_ints(args.repeats)
    repeats = repeats * len(lengths) if len(repeats) == 1 else repeats
    if len(repeats) != len(lengths):
        p.error("--repeats: give one count or one per length")
    loaded = load_model(ModelConfig(name="smollm2"))
    engines: dict[str, Engine] = {}

    def engine_for(label: str) -> Engine:
        method, _, sliced = label.partition("@")
        chunk_feed_forward(loaded.model, int(sliced or slicings[0]))  # the shared model, as this label runs
        if label not in engines:
            engines[label] = variant_engine(loaded, method, args.cache_size)
        return engines[label]

    lines = [header(f"Prefill cost per method (SmolLM2 fp32, cache size {args.cache_size:g})")]
    lines.append(f"- MLP slices (tokens, 0: whole): {', '.join(map(str, slicings))}")
    for n, reps in zip(lengths, repeats):
        res = measure(engine_for, loaded.tokenizer, methods, n, reps)
        plain = next((m for m in methods if m.partition("@")[0] == "none"), None)
        base = median(res[plain]["seconds"]) if plain else None
        plain_flops = forward_flops(loaded.model, res[methods[0]]["forwards"][:1])
        rows = []
        for method in methods:
            r = res[method]
            sec = median(r["seconds"])
            peak = [x for x in r["peak"] if x is not None]
            rows.append(
                [
                    method,
                    f"{sec:.2f}",
                    f"{sec / base:.2f}" if base else "-",
                    f"{forward_flops(loaded.model, r['forwards']) / plain_flops:.2f}",
                    f"{median(peak) / 2**20:.0f}" if peak else "-",
                    f"{r['kept']:.3f}",
                ]
            )
        lines.append(f"\n## {res[methods[0]]['tokens']} context tokens (median of {reps})\n")
        lines.append(
            table(
                [
                    "method",
                    "prefill s",
                    "÷ plain prefill",
                    "FLOPs ÷ plain",
                    "peak MiB above start",
                    "kept / full bytes",
                ],
                rows,
                "lrrrrr",
            )
        )
        print("\n".join(lines[-2:]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"\n(written to {args.out})")


if __name__ == "__main__":
    main()
