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
    step = min(0.024, 0.05 / max(1, len(ordered) - 1))  # offsets stay within +-0.025 of the true x
    return {
        m: {
            "color": colours[m],
            "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": _LINES[(i // 20) % len(_LINES)],
            "offset": (i - (len(ordered) - 1) / 2) * step,
        }
        for i, m in enumerate(ordered)
    }


def _line(ax, points: list[tuple[float, float]], method: str, style: dict) -> None:
    if points:
        xs = [x + style["offset"] for x, _ in points]
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
    legend_rows = (len(methods) + 1 + 3) // 4  # 4 columns, the full cache's line included
    legend_in = 0.2 + 0.17 * legend_rows
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows + legend_in), squeeze=False)
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
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=7, frameon=False)
    fig.suptitle("Score vs cache size per method (markers offset slightly in x so equal scores stay visible)")
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compression_loss(loss_rows: list[dict], path: Path) -> Path:
    """Relative loss vs the full cache (%), one panel per cache size, a bar per method."""
    values = {
        (r["method"], r["cache_size"]): 100.0 * r["relative_loss"] for r in loss_rows if r["relative_loss"] is not None
    }
    return _ranked_bars(
        values,
        path,
        xlabel="loss vs full cache (%, lower is better)",
        title="Compression loss relative to the full cache (average over tasks)",
    )


def _ranked_bars(values: dict[tuple[str, float], float], path: Path, xlabel: str, title: str) -> Path:
    """values: (method, cache_size) -> value. One panel per cache size; every method has its own row
    (ordered by its mean over sizes, best at the top, the same in every panel), so methods with equal
    values never hide each other, however many there are."""
    sizes = sorted({size for _, size in values})
    methods = sorted({m for m, _ in values})
    mean = {
        m: sum(v for (mm, _), v in values.items() if mm == m) / sum(1 for mm, _ in values if mm == m) for m in methods
    }
    order = sorted(methods, key=lambda m: (-mean[m], m))  # worst first: barh draws bottom-up
    colours = _colours(methods)
    height = max(2.5, 0.2 * len(order) + 1.2)
    fig, axes = plt.subplots(1, len(sizes), figsize=(3.4 * len(sizes) + 2.8, height), sharey=True, squeeze=False)
    for ax, size in zip(axes.flat, sizes):
        ys = [i for i, m in enumerate(order) if (m, size) in values]
        xs = [values[(order[i], size)] for i in ys]
        ax.barh(ys, xs, color=[colours[order[i]] for i in ys], height=0.7)
        ax.plot(xs, ys, linestyle="none", marker="|", color="black", markersize=7)  # zero stays visible
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(f"cache size {size:g}", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes.flat[0].set_yticks(range(len(order)), order, fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def costs(cost_rows: list[dict], path: Path) -> Path:
    """Four panels: TTFT, compression time, decode ms/token, kept KV MiB; a row per (method, cache size)
    so that any number of settings stays legible."""
    metrics = [
        ("ttft_s", "TTFT (s)"),
        ("compress_s", "compression (s)"),
        ("decode_ms_per_token", "decode (ms/token)"),
        ("kv_kept_MiB", "kept KV (MiB)"),
    ]
    ordered = sorted(cost_rows, key=lambda r: (r["method"], r["cache_size"]), reverse=True)  # top: a..z
    labels = [f"{r['method']} @{r['cache_size']:g}" for r in ordered]
    colours = _colours(sorted({r["method"] for r in cost_rows}))
    fig, axes = plt.subplots(1, 4, figsize=(15, max(3.0, 0.16 * len(labels) + 1.2)), sharey=True)
    for ax, (key, title) in zip(axes, metrics):
        ax.barh(range(len(labels)), [r.get(key) or 0 for r in ordered], color=[colours[r["method"]] for r in ordered])
        ax.set_title(title + " — median", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(labels)), labels, fontsize=6)
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
    """Answer fidelity: mean NLL increase of the full cache's answer, one panel per cache size,
    a bar per method (the full cache is 0)."""
    values = {(r["method"], r["cache_size"]): r["nll_delta"] for r in rows if r["nll_delta"] is not None}
    return _ranked_bars(
        values,
        path,
        xlabel="NLL increase of the full-cache answer (nats/token, lower is better)",
        title="Answer fidelity: NLL of the full cache's answer under each cache, minus the full cache's",
    )
