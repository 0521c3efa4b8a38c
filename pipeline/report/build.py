"""Build ``report.md`` and its plots from one or more jobs' output directories."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.locations import is_uri

from . import comparisons, plots, tables
from .perturbation import headline


def build_report(inputs: list[str | Path], out_dir: Path) -> Path:
    """Read every result row under ``inputs`` (local paths or ``s3://`` / ``gs://`` URIs of job
    outputs), write ``out_dir/report.md`` and PNGs (a local directory); return the md path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    local = [Path(p) for p in inputs if not is_uri(p)]
    perturbation_files = [p / "perturbation.parquet" for p in local if (p / "perturbation.parquet").is_file()]
    perturbation_files += [p for p in local if p.name == "perturbation.parquet"]
    result_inputs = [
        p for p in inputs if (is_uri(p) or Path(p).name != "perturbation.parquet") and tables.result_files(p)
    ]
    table = tables.read_outputs(result_inputs) if result_inputs else None
    parts = [
        f"# Report\n\nGenerated {dt.datetime.now().isoformat(timespec='seconds')} from "
        f"{', '.join(str(p) for p in inputs)}.\n"
    ]
    if perturbation_files:
        parts += _perturbation_section(perturbation_files, out_dir)
    if table is None:
        path = out_dir / "report.md"
        path.write_text("\n".join(parts))
        return path
    parts += [f"## Rows ({table.num_rows})\n", tables.markdown(tables.overview(table))]

    quality, tasks = tables.quality(table)
    loss = tables.compression_loss(quality)  # empty without scored full-cache rows
    if quality:
        cols = ["method", "cache_size"] + [t for t in tasks if t != "all"] + ["average", "n"]
        parts += ["## Score by method and cache size\n", tables.markdown(quality, cols)]
        plots.score_vs_cache_size(quality, tasks, out_dir / "score_vs_cache_size.png")
        parts.append("![score vs cache size](score_vs_cache_size.png)\n")
        if loss:
            parts += ["## Compression loss relative to the full cache\n", tables.markdown(loss)]
            plots.compression_loss(loss, out_dir / "compression_loss.png")
            parts.append("![compression loss](compression_loss.png)\n")

    fid = tables.fidelity(table)
    if fid:
        parts += [
            "## Answer fidelity (NLL of the full cache's answer under each cache, minus the full cache's)\n",
            "Mean over answered questions, nats per token; 0 = the compressed cache finds the full cache's answer as "
            "likely as the full cache does. Lower noise than accuracy on few documents.\n",
            tables.markdown(sorted(fid, key=lambda r: (r["cache_size"], r["nll_delta"]))),
        ]
        plots.fidelity(fid, out_dir / "fidelity.png")
        parts.append("![answer fidelity](fidelity.png)\n")

    if fid:  # without scored rows (no references) the methods rank by answer fidelity alone
        parts += _comparison_sections(loss, fid)

    cost = tables.costs(table)
    if cost:
        parts += ["## Cost per method (medians over rows without error)\n", tables.markdown(cost)]
        plots.costs(cost, out_dir / "costs.png")
        parts.append("![costs](costs.png)\n")

    path = out_dir / "report.md"
    path.write_text("\n".join(parts))
    return path


def _comparison_sections(loss: list[dict], fid: list[dict]) -> list[str]:
    """The best methods per cache size and CriticalKV against top-k on the same base method."""
    title = "by average score; ties by the lower NLL increase" if loss else "by the NLL increase: no scored rows"
    parts = [f"## Best methods per cache size ({title})\n"]
    parts.append(tables.markdown(comparisons.best_methods(loss, fid)))
    effect = comparisons.criticalkv_effect(loss, fid)
    if effect:
        parts += [
            "## CriticalKV against top-k on the same scorer and allocation\n",
            "Ratios CriticalKV / top-k of the relative score loss and of the NLL increase (< 1: CriticalKV "
            "lowers it); the summary averages over cache sizes.\n",
            tables.markdown(comparisons.criticalkv_summary(effect)),
            tables.markdown(effect),
        ]
    return parts


def _perturbation_section(files: list[Path], out_dir: Path) -> list[str]:
    table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
    rows = headline(table)
    cols = [
        "probe",
        "method",
        "base_method",
        "cache_size",
        "heads",
        "fraction_lower",
        "median_ratio",
        "mean_perturbation",
        "base_mean_perturbation",
        "hidden_deviation",
        "base_hidden_deviation",
    ]
    parts = [
        "## Perturbation: CriticalKV vs its base method\n",
        "`fraction_lower`: share of (document, layer, KV head) where CriticalKV's measured attention-output "
        "perturbation ‖(o − ô) W_O‖₁ is lower than its base method's at the same budget.\n",
        tables.markdown(rows, [c for c in cols if rows and c in rows[0]]),
    ]
    if plots.perturbation_heatmaps(table, out_dir / "perturbation_heatmap.png") is not None:
        parts.append("![perturbation heatmap](perturbation_heatmap.png)\n")
    return parts
