"""Helpers of ``benchmarks/kvpress/side.py`` (runs INSIDE the kvpress virtual environment): presses
from a spec, score recording, timing wrappers around kvpress's hooks, process memory, cache bytes.
Nothing from the project is imported here."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from kvpress import AdaKVPress, CriticalAdaKVPress, CriticalKVPress, SnapKVPress

HEADWISE = ("adakv-snapkv", "criticalkv-adakv-snapkv")


def make_press(spec: dict | None):
    """Press from a spec.

    The spec: {"name", "cache_size", "window", "kernel", "epsilon", "first_stage_ratio", "alpha_safeguard"}.
    """
    if spec is None or spec.get("name") in (None, "none"):
        return None
    ratio = 1.0 - float(spec["cache_size"])
    base = SnapKVPress(
        compression_ratio=ratio, window_size=int(spec.get("window", 64)), kernel_size=int(spec.get("kernel", 5))
    )
    name = spec["name"]
    eps, fsr, alpha = (
        float(spec.get("epsilon", 1e-4)),
        float(spec.get("first_stage_ratio", 0.5)),
        float(spec.get("alpha_safeguard", 0.2)),
    )
    if name == "snapkv":
        return base
    if name == "criticalkv-snapkv":
        return CriticalKVPress(base, epsilon=eps, first_stage_ratio=fsr)
    if name == "adakv-snapkv":
        return AdaKVPress(base, alpha_safeguard=alpha)
    if name == "criticalkv-adakv-snapkv":
        return CriticalAdaKVPress(base, alpha_safeguard=alpha, epsilon=eps, first_stage_ratio=fsr)
    raise ValueError(f"unknown press {name!r}")


def base_press(press):
    return getattr(press, "press", press)


def recording(score_fn, into: dict):
    """``score_fn`` that also keeps a float copy of each layer's scores in ``into[layer_idx]``."""

    def wrapped(module, *args, **kwargs):
        scores = score_fn(module, *args, **kwargs)
        into[module.layer_idx] = scores.detach().float().clone()
        return scores

    return wrapped


def status_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak() -> int | None:
    start = status_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    return start


def cache_bytes(cache) -> int:
    """Bytes of the K/V tensors the DynamicCache holds (storage actually allocated)."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.untyped_storage().nbytes()
    return total


def timed_press(press, hook_s: dict) -> list:
    """Time ``press``'s forward hook into ``hook_s["compress"]`` and ``CriticalKVPress.vwl1norm`` into
    ``hook_s["norm"]``; returns the callables that undo the class-level wrapper."""
    original_hook = press.forward_hook

    def timed_hook(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original_hook(*args, **kwargs)
        finally:
            hook_s["compress"] += time.perf_counter() - t

    press.forward_hook = timed_hook  # looked up by BasePress.__call__ when registering hooks
    original_norm = CriticalKVPress.vwl1norm

    def timed_norm(values, module):
        t = time.perf_counter()
        try:
            return original_norm(values, module)
        finally:
            hook_s["norm"] += time.perf_counter() - t

    CriticalKVPress.vwl1norm = staticmethod(timed_norm)
    return [lambda: setattr(CriticalKVPress, "vwl1norm", staticmethod(original_norm))]


def capture_pruning(press, pruned: dict) -> None:
    """Keep each layer's input keys and the keys ``press.compress`` returned in ``pruned[layer]``."""
    compress = press.compress

    def capture_compress(module, hidden_states, keys, values, attentions, kwargs):
        k_out, v_out = compress(module, hidden_states, keys, values, attentions, kwargs)
        pruned[module.layer_idx] = (keys.detach().clone(), k_out.detach().clone())
        return k_out, v_out

    press.compress = capture_compress


def masked_to_kept(masked_per_layer, row: int, k_len: int, heads: int):
    kept = []
    for masked in masked_per_layer:
        b_idx, h_idx, s_idx = masked
        mask = torch.ones(int(b_idx.max()) + 1 if len(b_idx) else row + 1, heads, k_len, dtype=torch.bool)
        mask[b_idx, h_idx, s_idx] = False
        kept.append([torch.nonzero(mask[row, h]).flatten().tolist() for h in range(heads)])
    return kept


class null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None
