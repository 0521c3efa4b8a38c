"""Does ``torch.compile`` speed up SmolLM2's decode step on this machine? Measured on transformers' own
compile-ready path, so that the answer does not depend on this project's cache.

    python benchmarks/compile_probe.py [--length 2048] [--steps 12] [--mode default]
                                       [--weight-layout auto] [--out benchmarks/results/compile_probe.md]

The model (fp32, SDPA attention) prefills ``--length`` random token ids into a ``StaticCache``
(fixed shapes: what CUDA graphs and inductor need), then decodes one token per step through the same
forward, eager and ``torch.compile(mode=--mode)``-d, alternating eager / compiled blocks of
``--steps`` steps twice. Printed: the compile time (first call), median ms per step of each and the
ratio eager / compiled (> 1: compiling wins). On CPU inductor generates C++ kernels with the system
compiler; on CUDA ``--mode reduce-overhead`` adds CUDA graphs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from roofline import RESULTS_DIR, header, table, write_report  # noqa: E402
from transformers import StaticCache  # noqa: E402

from pipeline.engine.config import ModelConfig  # noqa: E402
from pipeline.engine.loading import load_model  # noqa: E402


def timed_steps(step, start: int, steps: int, device) -> list[float]:
    """Seconds of ``steps`` decode steps at positions start, start + 1, ..."""
    token = torch.tensor([[42]], device=device)
    out = []
    for i in range(steps):
        pos = torch.tensor([[start + i]], device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(token, pos)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--mode", default="default", help="torch.compile mode (default, reduce-overhead, max-autotune)")
    p.add_argument("--weight-layout", default="auto", choices=["auto", "row", "column"], help="as the model option")
    p.add_argument("--out", default=str(RESULTS_DIR / "compile_probe.md"))
    args = p.parse_args()
    loaded = load_model(ModelConfig(name="smollm2", dtype="float32", weight_layout=args.weight_layout))
    model, device = loaded.model, loaded.device
    model.set_attn_implementation("sdpa")
    n = args.length
    cache = StaticCache(config=model.config, max_cache_len=n + 4 * args.steps + 8)
    ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

        def step(token, pos):
            return model(input_ids=token, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1).logits

        compiled = torch.compile(step, mode=args.mode)
        t0 = time.perf_counter()
        timed_steps(compiled, n, 2, device)  # compiles (and warms up)
        compile_s = time.perf_counter() - t0
        eager, fast = [], []
        start = n + 2
        for _ in range(2):
            eager += timed_steps(step, start, args.steps, device)
            fast += timed_steps(compiled, start + args.steps, args.steps, device)
            start += 2 * args.steps
    e_ms, c_ms = 1e3 * statistics.median(eager), 1e3 * statistics.median(fast)
    lines = [header(f"torch.compile of the decode step (SmolLM2 fp32, {device.type}, {n} cached tokens)")]
    rows = [[args.mode, args.weight_layout, f"{compile_s:.1f}", f"{e_ms:.1f}", f"{c_ms:.1f}", f"**{e_ms / c_ms:.2f}**"]]
    lines.append("")
    lines.append(
        table(
            ["mode", "weights", "compile s (first 2 steps)", "eager ms/step", "compiled ms/step", "eager ÷ compiled"],
            rows,
        )
    )
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
