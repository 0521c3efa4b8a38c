"""``python -m pipeline.report OUT [OUT2 ...]``: Parquet results -> report.md + PNG plots."""

from .build import build_report

__all__ = ["build_report"]
