"""PNG plots for the report (matplotlib, non-interactive backend). Titles, axis labels and units
on every panel; one colour per method, consistent across figures."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
_LINES = ("-", "--", "-.", ":")


def _colours(methods: list[str]) -> dict[str, str]:
    cmap = plt.get_cmap("tab20")
    return {m: cmap(i % 20) for i, m in enumerate(sorted(methods))}


def _styles(methods: list[str]) -> dict[str, dict]:
    """A distinct (colour, marker, line style) per method, and a small x offset, so that methods
    with equal values stay visible side by side instead of drawing on top of each other."""
    colours = _colours(methods)
    ordered = sorted(methods)
    spread = 0.012 * (len(ordered) - 1)
    return {
        m: {
            "color": colours[m],
            "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": _LINES[(i // 20) % len(_LINES)],
            "offset": (i * 0.024 - spread) if len(ordered) > 1 else 0.0,
        }
        for i, m in enumerate(ordered)
    }


def _line(ax, points: list[tuple[float, float]], method: str, style: dict) -> None:
    if points:
        xs = [x + style["offset"] * 0.5 for x, _ in points]
        ax.plot(
            xs,
            [y for _, y in points],
            marker=style["marker"],
            linestyle=style["linestyle"],
            color=style["color"],
            markersize=4,
            linewidth=1.1,
            alpha=0.9,
            label=method,
        )


def score_vs_cache_size(quality_rows: list[dict], tasks: list[str], path: Path) -> Path:
    """One panel per task plus the average: mean score vs kept fraction, a line per method."""
    panels = ["average"] + [t for t in tasks if t != "all"] if len(tasks) > 1 else ["average"]
    methods = sorted({r["method"] for r in quality_rows if r["method"] != "none"})
    styles = _styles(methods)
    cols = min(4, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        full = [
            r[panel]
            for r in quality_rows
            if (r["method"] == "none" or r["cache_size"] >= 1.0) and r.get(panel) is not None
        ]
        if full:
            ax.axhline(sum(full) / len(full), color="black", linestyle="--", linewidth=1, label="full cache")
        for method in methods:
            pts = sorted(
                (r["cache_size"], r[panel])
                for r in quality_rows
                if r["method"] == method and r.get(panel) is not None and r["cache_size"] < 1.0
            )
            _line(ax, pts, method, styles[method])
        ax.set_title(panel)
        ax.set_xlim(0, 1.02)
        ax.set_ylim(-0.03, 1.05)
        ax.set_xlabel("cache size (kept fraction)")
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    legend_rows = (len(labels) + 3) // 4
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=7, frameon=False)
    fig.suptitle("Score vs cache size per method (markers offset slightly in x so equal scores stay visible)")
    fig.tight_layout(rect=(0, min(0.5, 0.03 + 0.025 * legend_rows), 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compression_loss(loss_rows: list[dict], path: Path) -> Path:
    """Grouped bars: relative loss vs full cache (%) per cache size, a bar per method."""
    sizes = sorted({r["cache_size"] for r in loss_rows})
    methods = sorted({r["method"] for r in loss_rows})
    colours = _colours(methods)
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(sizes) * max(1, len(methods)) / 3), 4))
    for j, method in enumerate(methods):
        xs, ys = [], []
        for i, size in enumerate(sizes):
            hit = [
                r
                for r in loss_rows
                if r["method"] == method and r["cache_size"] == size and r["relative_loss"] is not None
            ]
            if hit:
                xs.append(i + (j - (len(methods) - 1) / 2) * width)
                ys.append(100.0 * hit[0]["relative_loss"])
        ax.bar(xs, ys, width=width, color=colours[method], label=method)
    ax.set_xticks(range(len(sizes)), [f"{s:g}" for s in sizes])
    ax.set_xlabel("cache size (kept fraction)")
    ax.set_ylabel("loss vs full cache (%, lower is better)")
    ax.set_title("Compression loss relative to the full cache (average over tasks)")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def costs(cost_rows: list[dict], path: Path) -> Path:
    """Four panels: TTFT, compression time, decode ms/token, kept KV MiB, per method and cache size."""
    metrics = [
        ("ttft_s", "TTFT (s)"),
        ("compress_s", "compression (s)"),
        ("decode_ms_per_token", "decode (ms/token)"),
        ("kv_kept_MiB", "kept KV (MiB)"),
    ]
    labels = [f"{r['method']}\n@{r['cache_size']:g}" for r in cost_rows]
    colours = _colours(sorted({r["method"] for r in cost_rows}))
    fig, axes = plt.subplots(1, 4, figsize=(max(12, 0.9 * len(labels) * 2), 4))
    for ax, (key, title) in zip(axes, metrics):
        ax.bar(
            range(len(labels)), [r.get(key) or 0 for r in cost_rows], color=[colours[r["method"]] for r in cost_rows]
        )
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title + " — median")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Cost per method and cache size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def perturbation_heatmaps(table, path: Path, probe: str = "later") -> Path | None:
    """Per (layer, KV head): log2 of CriticalKV's mean perturbation over its base method's
    (blue = CriticalKV perturbs less). One panel per (criticalkv method, cache size)."""

    rows = [
        r
        for r in table.select(
            ["probe", "method", "base_method", "criticalkv", "cache_size", "layer", "kv_head", "perturbation"]
        ).to_pylist()
        if r["probe"] == probe
    ]
    sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for r in rows:
        acc = sums[(r["method"], r["cache_size"], r["layer"], r["kv_head"])]
        acc[0] += r["perturbation"]
        acc[1] += 1
    panels = sorted({(r["method"], r["base_method"], r["cache_size"]) for r in rows if r["criticalkv"]})
    panels = [p for p in panels if any(k[0] == p[1] and k[1] == p[2] for k in sums)]
    if not panels:
        return None
    layers = 1 + max(r["layer"] for r in rows)
    heads = 1 + max(r["kv_head"] for r in rows)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(2.2 + 1.0 * heads * len(panels), 0.18 * layers + 2), squeeze=False
    )
    image = None
    for i, (ax, (method, base, size)) in enumerate(zip(axes.flat, panels)):
        grid = [[float("nan")] * heads for _ in range(layers)]
        for layer in range(layers):
            for head in range(heads):
                c, b = sums.get((method, size, layer, head)), sums.get((base, size, layer, head))
                if c and b and c[1] and b[1] and b[0] > 0 and c[0] > 0:
                    grid[layer][head] = math.log2((c[0] / c[1]) / (b[0] / b[1]))
        image = ax.imshow(grid, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto", origin="lower")
        ax.set_title(f"{method}\nvs {base} @ {size:g}", fontsize=8)
        ax.set_xlabel("KV head")
        if i == 0:
            ax.set_ylabel("layer")
        ax.set_xticks(range(heads))
    fig.colorbar(image, ax=list(axes.flat), label="log2(perturbation ratio); < 0: CriticalKV lower")
    fig.suptitle(f"Attention-output perturbation, CriticalKV vs base ({probe} queries)", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def fidelity(rows: list[dict], path: Path) -> Path:
    """Answer fidelity: mean NLL increase of the full cache's answer vs cache size, a line per method."""
    methods = sorted({r["method"] for r in rows})
    styles = _styles(methods)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for method in methods:
        pts = sorted((r["cache_size"], r["nll_delta"]) for r in rows if r["method"] == method)
        _line(ax, pts, method, styles[method])
    ax.axhline(0, color="black", linestyle="--", linewidth=1, label="full cache")
    ax.set_xlim(0, 1.02)
    ax.set_xlabel("cache size (kept fraction)")
    ax.set_ylabel("NLL of the full-cache answer: compressed - full (nats/token, lower is better)")
    ax.set_title("Answer fidelity per method (x offset slightly per method)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
