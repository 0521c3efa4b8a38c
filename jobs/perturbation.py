"""Perturbation diagnostics (the CriticalKV paper's analysis) on one model, written to Parquet.

    python jobs/perturbation.py --model smollm2 --length 2048 --cache-sizes 0.2 --output OUT

All options: --help. The work is done by pipeline.apps.perturbation (this file only starts it).
"""

from pipeline.apps.perturbation import main

if __name__ == "__main__":
    raise SystemExit(main())
