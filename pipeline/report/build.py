"""Build ``report.md`` and its plots from one or more jobs' output directories."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from . import plots, tables


def build_report(inputs: list[Path], out_dir: Path) -> Path:
    """Read every result row under ``inputs``, write ``out_dir/report.md`` and PNGs; return the md path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = tables.read_outputs([Path(p) for p in inputs])
    parts = [f"# Report\n\nGenerated {dt.datetime.now().isoformat(timespec='seconds')} from "
             f"{', '.join(str(p) for p in inputs)} ({table.num_rows} rows).\n"]
    parts += ["## Rows\n", tables.markdown(tables.overview(table))]

    quality, tasks = tables.quality(table)
    if quality:
        cols = ["method", "cache_size"] + [t for t in tasks if t != "all"] + ["average", "n"]
        parts += ["## Score by method and cache size\n", tables.markdown(quality, cols)]
        plots.score_vs_cache_size(quality, tasks, out_dir / "score_vs_cache_size.png")
        parts.append("![score vs cache size](score_vs_cache_size.png)\n")
        loss = tables.compression_loss(quality)
        if loss:
            parts += ["## Compression loss relative to the full cache\n", tables.markdown(loss)]
            plots.compression_loss(loss, out_dir / "compression_loss.png")
            parts.append("![compression loss](compression_loss.png)\n")

    cost = tables.costs(table)
    if cost:
        parts += ["## Cost per method (medians over rows without error)\n", tables.markdown(cost)]
        plots.costs(cost, out_dir / "costs.png")
        parts.append("![costs](costs.png)\n")

    path = out_dir / "report.md"
    path.write_text("\n".join(parts))
    return path
