"""Does ``torch.compile`` speed up SmolLM2's decode step on this machine? Measured on transformers' own
compile-ready path, so that the answer does not depend on this project's cache.

    python -m benchmarks.compile_probe [--length 2048] [--steps 12] [--mode default]
                                       [--model smollm2] [--dtype float32] [--backend inductor]
                                       [--weight-layout auto] [--inductor-flags freezing,cpp_wrapper]
                                       [--out benchmarks/results/compile_probe.md]

The model (fp32, SDPA attention) prefills ``--length`` random token ids into a ``StaticCache``
(fixed shapes: what CUDA graphs and inductor need), then decodes one token per step through the same
forward, eager and ``torch.compile(mode=--mode)``-d, alternating eager / compiled blocks of
``--steps`` steps twice. Printed: the compile time (first call), median ms per step of each and the
ratio eager / compiled (> 1: compiling wins). On CPU inductor generates C++ kernels with the system
compiler; ``--inductor-flags`` turns on boolean ``torch._inductor.config`` options for the run
(``freezing`` folds the weights into the graph as constants and prepacks them for oneDNN,
``cpp_wrapper`` drops the Python wrapper around the kernels). On CUDA ``--mode reduce-overhead``
adds CUDA graphs. ``benchmarks/gpu_check.sh`` runs it on a random Llama-3.1-8B-shaped model
(``--model random-llama-8b --dtype bfloat16``), since GPU machines have no model files.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import StaticCache

from benchmarks.roofline import RESULTS_DIR, header, table, write_report
from pipeline.engine.config import ModelConfig
from pipeline.engine.loading import load_model
from pipeline.kv.attention.registered import cache_keyword

HERE = Path(__file__).resolve().parent


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


MODELS = ("smollm2", "random-llama-8b", "random-tiny")


def load(name: str, dtype: str, weight_layout: str):
    """(model, device): the bundled SmolLM2, or a random Llama of gpu_check's 8B / smoke shape (GPU
    machines need no model files)."""
    if name == "smollm2":
        loaded = load_model(ModelConfig(name="smollm2", dtype=dtype, weight_layout=weight_layout))
        return loaded.model, loaded.device
    from benchmarks import gpu_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = gpu_model.LLAMA_31_8B if name == "random-llama-8b" else gpu_model.SMOKE
    return gpu_model.build_model(shape, device, getattr(torch, dtype)), device


def measure(model, device, n: int, steps: int, mode: str, backend: str = "inductor") -> dict:
    """Compile time and median eager / compiled ms per decode step after ``n`` cached tokens."""
    model.set_attn_implementation("sdpa")
    cache = StaticCache(config=model.config, max_cache_len=n + 4 * steps + 8)
    vocab = model.config.vocab_size
    ids = torch.randint(min(100, vocab - 1), vocab, (1, n), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        cache_arg = {cache_keyword(model): cache}
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_arg)

        def step(token, pos):
            return model(input_ids=token, position_ids=pos, use_cache=True, logits_to_keep=1, **cache_arg).logits

        compiled = torch.compile(step, mode=None if backend != "inductor" else mode, backend=backend)
        t0 = time.perf_counter()
        timed_steps(compiled, n, 2, device)  # compiles (and warms up)
        compile_s = time.perf_counter() - t0
        eager, fast = [], []
        start = n + 2
        for _ in range(2):
            eager += timed_steps(step, start, steps, device)
            fast += timed_steps(compiled, start + steps, steps, device)
            start += 2 * steps
    return {
        "compile_s": compile_s,
        "eager_ms": 1e3 * statistics.median(eager),
        "compiled_ms": 1e3 * statistics.median(fast),
    }


def set_inductor_flags(spec: str) -> list[str]:
    """Turn on the named boolean ``torch._inductor.config`` options; an unknown or non-boolean name fails."""
    import torch._inductor.config as inductor_config

    flags = [name.strip() for name in spec.split(",") if name.strip()]
    for name in flags:
        if not isinstance(getattr(inductor_config, name, None), bool):
            raise SystemExit(f"--inductor-flags: {name!r} is not a boolean torch._inductor.config option")
        setattr(inductor_config, name, True)
    return flags


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--mode", default="default", help="torch.compile mode (default, reduce-overhead, max-autotune)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (eager: tracing only, for smoke runs)")
    p.add_argument("--model", default="smollm2", choices=MODELS, help="random-*: gpu_check's random Llama shapes")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--weight-layout", default="auto", choices=["auto", "row", "column"], help="as the model option")
    p.add_argument(
        "--inductor-flags",
        default="",
        help="comma-separated boolean torch._inductor.config options to turn on, e.g. freezing,cpp_wrapper",
    )
    p.add_argument("--out", default=str(RESULTS_DIR / "compile_probe.md"))
    args = p.parse_args(argv)
    flags = set_inductor_flags(args.inductor_flags)
    model, device = load(args.model, args.dtype, args.weight_layout)
    r = measure(model, device, args.length, args.steps, args.mode, args.backend)
    e_ms, c_ms = r["eager_ms"], r["compiled_ms"]
    title = f"torch.compile of the decode step ({args.model} {args.dtype}, {device.type}, {args.length} cached tokens)"
    rows = [
        [
            args.mode,
            args.backend,
            args.weight_layout,
            ",".join(flags) or "-",
            f"{r['compile_s']:.1f}",
            f"{e_ms:.2f}",
            f"{c_ms:.2f}",
            f"**{e_ms / c_ms:.2f}**",
        ]
    ]
    columns = ["mode", "backend", "weights", "inductor flags", "compile s (first 2 steps)"]
    columns += ["eager ms/step", "compiled ms/step"]
    body = table([*columns, "eager ÷ compiled"], rows)
    write_report("\n".join([header(title), "", body]) + "\n", args.out)


if __name__ == "__main__":
    main()
