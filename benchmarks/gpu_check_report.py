"""The Markdown table of ``benchmarks/gpu_check.py``'s result (one row per length and method)."""

from __future__ import annotations


def _gib(b) -> str:
    return "n/a" if not b else f"{b / 2**30:.2f}"


def _num(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def markdown(result: dict) -> str:
    info, rows = result["info"], result["rows"]
    by = {(r["tokens"], r["method"]): r for r in rows}
    lines = [
        f"GPU check: {info['model']} ({info['weights_bytes'] / 2**30:.1f} GiB {info['dtype']} weights, "
        f"init {info['init_s']:.1f} s) "
        f"on {info['device']}; torch {info['torch']} (CUDA {info['cuda']}), transformers {info.get('transformers')}, "
        f"flash-attn {info['flash_attn'] or 'not installed'}; medians of {info['repeats']} interleaved prefills, "
        f"decode median of {info['decode_steps']} steps; [chunked]: {info.get('prefill_chunk')}-token chunks; "
        f"total {info['elapsed_s']:.0f} s.",
        "",
        "| tokens | method | cache | prefill s | prefill / snapkv | compress s | decode ms/token | decode / full | "
        "host ms/token | decode kernel | SM MHz after decode | kept KV MiB | kept / full KV | peak GiB prefill | "
        "peak GiB decode | status |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        snap = by.get((r["tokens"], "snapkv"), {})
        full = by.get((r["tokens"], "none"), {})
        p = r.get("prefill_median_s")
        ratio = f"{p / snap['prefill_median_s']:.3f}" if p and snap.get("prefill_median_s") else "—"
        d = r.get("decode_ms")
        dratio = f"{d / full['decode_ms']:.3f}" if d and full.get("decode_ms") else "—"
        kept = r.get("kept_bytes")
        kept_ratio = f"{kept / r['full_bytes']:.4f}" if kept and r.get("full_bytes") else "—"
        compress = r.get("compress_median_s")
        cells = [
            str(r["tokens"]),
            r["method"],
            r["cache"],
            _num(p, ".3f"),
            ratio,
            _num(compress, ".3f"),
            _num(d, ".1f"),
            dratio,
            _num(r.get("host_ms"), ".1f"),
            r.get("kernel") or "—",
            _num(r.get("sm_mhz"), "d"),
            _num(kept / 2**20 if kept else None, ".1f"),
            kept_ratio,
            _gib(r.get("peak_prefill")),
            _gib(r.get("peak_decode")),
            r["status"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += throughput_table(result.get("throughput") or [])
    lines += [f"\nwarning: {w}" for w in info.get("warnings") or []]
    return "\n".join(lines)


def throughput_table(rows: list[dict]) -> list[str]:
    """Decode tokens/s at one KV memory budget, each row against the full cache of its length."""
    if not rows:
        return []
    full = {r["tokens"]: r for r in rows if r["method"] == "none" and r["status"] == "ok"}
    lines = [
        "",
        f"Decode throughput in {rows[0]['budget_gib']:g} GiB of KV (the largest batch of copies of one compressed "
        "document that fits; median step):",
        "",
        "| tokens | method | forced kernel | batch | KV GiB held | ms/step | host ms/step | tokens/s | ÷ full | "
        "kernel | SM MHz | peak GiB | status |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        ref = full.get(r["tokens"], {})
        tps = r.get("tokens_per_s")
        ratio = f"{tps / ref['tokens_per_s']:.2f}" if tps and ref.get("tokens_per_s") else "—"
        cells = [
            str(r["tokens"]),
            r["method"],
            r["forced"],
            _num(r.get("batch"), "d"),
            _gib(r.get("kv_bytes")),
            _num(r.get("step_ms"), ".1f"),
            _num(r.get("host_ms"), ".1f"),
            _num(tps, ".0f"),
            ratio,
            r.get("kernel") or "—",
            _num(r.get("sm_mhz"), "d"),
            _gib(r.get("peak_decode")),
            r["status"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
