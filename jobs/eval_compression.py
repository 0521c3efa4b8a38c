"""Compression sweep on Ray: RULER-style tasks x methods x cache sizes, scored, with a report.

    python jobs/eval_compression.py --tasks niah_single_1,vt --length 2048 --samples 5 \
        --methods snapkv,criticalkv-snapkv --cache-sizes 0.2,0.4,1.0 [--query-aware] --output OUT

All options: --help. The work is done by pipeline.eval.sweep_job (this file only starts it).
"""

from pipeline.apps.eval_sweep import main

if __name__ == "__main__":
    raise SystemExit(main())
