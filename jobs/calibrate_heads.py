"""HeadKV calibration: per-head retrieval scores from needle copy tests, written as a priors JSON.

    python jobs/calibrate_heads.py --model smollm2 --output priors.json [--lengths 512,1024 --depths 5]

All options: --help. The work is done by pipeline.apps.calibrate (this file only starts it).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without installing

from pipeline.apps.calibrate import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
