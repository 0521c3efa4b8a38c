"""Compression sweeps: compressed settings decoded side by side (stacked caches) vs one at a time.

    python -m benchmarks.sweep_decode [--length 2048] [--groups 1,8] [--repeats 2] [--new-tokens 24]
                                      [--methods snapkv,criticalkv-adakv-snapkv,...] [--cache-sizes 0.1,0.2,0.4]

SmolLM2 fp32 on CPU, ``Engine.generate_sweep`` over one document of ``--length`` tokens: every
method at every cache size plus the full cache, decoded with ``settings_per_decode`` = each value
of ``--groups``. Runs alternate between the group sizes (medians over ``--repeats``); the answers
of every group size are compared with those of the first.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import context_ids
from benchmarks.roofline import header, median, parse_ints, table
from pipeline.engine.config import GenerationConfig, ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.loading import load_model
from pipeline.engine.types import Request
from pipeline.kv.config import CompressionConfig

HERE = Path(__file__).resolve().parent

DEFAULT_METHODS = "snapkv,adakv-snapkv,criticalkv-snapkv,criticalkv-adakv-snapkv,layer-knorm,streamingllm"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--groups", default="1,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--cache-sizes", default="0.1,0.2,0.4")
    p.add_argument("--out", default=str(HERE / "results" / "sweep_decode.md"))
    args = p.parse_args()
    loaded = load_model(ModelConfig(name="smollm2"))
    text = loaded.tokenizer.decode(context_ids(loaded.tokenizer, args.length)[0].tolist())
    request = Request("bench", text, ["What is the special magic number mentioned in the text?"])
    sizes = [float(s) for s in args.cache_sizes.split(",")]
    settings = [CompressionConfig(method="none", cache_size=1.0)]
    settings += [CompressionConfig(method=m, cache_size=s) for m in args.methods.split(",") for s in sizes]
    groups = parse_ints(args.groups)
    seconds: dict[int, list[float]] = {g: [] for g in groups}
    answers: dict[int, list] = {}
    for r in range(args.repeats):
        for g in groups if r % 2 == 0 else list(reversed(groups)):
            generation = GenerationConfig(max_new_tokens=args.new_tokens, settings_per_decode=g)
            engine = Engine(loaded, settings[0], generation)
            t0 = time.perf_counter()
            swept = engine.generate_sweep([request], settings)
            seconds[g].append(time.perf_counter() - t0)
            answers[g] = [a[0].prediction for a in swept]
    base = median(seconds[groups[0]])
    rows = []
    for g in groups:
        same = sum(a == b for a, b in zip(answers[g], answers[groups[0]]))
        sec = median(seconds[g])
        rows.append([str(g), f"{sec:.1f}", f"{base / sec:.2f}", f"{same}/{len(settings)}"])
    lines = [
        header(f"Sweep of {len(settings)} settings over one {args.length}-token document (SmolLM2 fp32)"),
        table(["settings per decode", "sweep s", "speed-up", "answers equal to the first"], rows, "rrrr"),
    ]
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
