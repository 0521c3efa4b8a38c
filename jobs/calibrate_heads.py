"""HeadKV calibration: per-head retrieval scores from needle copy tests, written as a priors JSON.

    python jobs/calibrate_heads.py --model smollm2 --output priors.json [--lengths 512,1024 --depths 5]

All options: --help. The work is done by pipeline.apps.calibrate (this file only starts it).
"""

from pipeline.apps.calibrate import main

if __name__ == "__main__":
    raise SystemExit(main())
