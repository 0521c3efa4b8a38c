"""Perturbation diagnostics (the CriticalKV paper's analysis) on one model, written to Parquet.

    python jobs/perturbation.py --model smollm2 --length 2048 --cache-sizes 0.2 --output OUT

All options: --help. The work is done by pipeline.apps.perturbation (this file only starts it).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from pipeline.apps.perturbation import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
