"""What fits on a GPU, from the byte formula (no GPU needed): per model and GPU, the weights, the KV
bytes per context token, and how many context tokens the continuous decode batch holds in the jobs'
default KV memory with the full cache and with compressed caches.

    python -m benchmarks.sizing [--gpus 24,80]

The formula is the store's (:meth:`pipeline.kv.storage.store.VarLenLayer.bytes_per_row`): per layer, KV head
and kept token, K and V (``head_dim`` values each, bf16) plus an int32 original position. The decode
batch's default KV memory is 70 % of the GPU memory free once the model is loaded
(:func:`pipeline.engine.memory.default_kv_memory`), taken here as the GPU's memory less the weights and
1 GiB for the CUDA context. Not counted: a document's prefill activations (the MLP runs 512 tokens at a
time), each row's question and answer slots, and the window a small cache keeps whole.
"""

from __future__ import annotations

import argparse

from pipeline.engine.memory import GPU_KV_SHARE

GIB = 2**30
CUDA_CONTEXT_GIB = 1.0
#: name: (parameters in billions, layers, KV heads, head_dim) -- the published configs
MODELS = {
    "Llama-3.1-8B": (8.03, 32, 8, 128),
    "Qwen2.5-7B": (7.62, 28, 4, 128),
    "Mistral-7B-v0.3": (7.25, 32, 8, 128),
    "Qwen3-8B": (8.19, 36, 8, 128),
}
FRACTIONS = (1.0, 0.4, 0.2)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, value_bytes: int = 2) -> int:
    """Bytes the cache holds per kept context token: K and V plus an int32 position, every layer and head."""
    return layers * kv_heads * (2 * head_dim * value_bytes + 4)


def rows(gpus: list[float]) -> list[str]:
    out = [
        "| model | GPU | weights GiB | KV KiB / token | decode-batch KV GiB | context tokens held: full / 0.4 / 0.2 |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, (params, layers, heads, head_dim) in MODELS.items():
        weights = params * 1e9 * 2 / GIB
        per_token = kv_bytes_per_token(layers, heads, head_dim)
        for gpu in gpus:
            budget = GPU_KV_SHARE * max(0.0, gpu - weights - CUDA_CONTEXT_GIB) * GIB
            held = " / ".join(f"{budget / (per_token * f) / 1000:,.0f}K" for f in FRACTIONS)
            out.append(
                f"| {name} | {gpu:g} GiB | {weights:.1f} | {per_token / 1024:.1f} | {budget / GIB:.1f} | {held} |"
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="24,80", help="GPU memory sizes in GiB, comma separated (default: 24,80)")
    args = parser.parse_args(argv)
    print("\n".join(rows([float(g) for g in args.gpus.split(",")])))


if __name__ == "__main__":
    main()
