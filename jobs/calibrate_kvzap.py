"""KVzap calibration: the learned one-pass scorer and its cross-layer shares for a model, as safetensors.

    python jobs/calibrate_kvzap.py --model smollm2 --output kvzap.safetensors [--lengths 512,1024,2048]

All options: --help. The work is done by pipeline.apps.calibrate_kvzap (this file only starts it).
"""

from pipeline.apps.calibrate_kvzap import main

if __name__ == "__main__":
    raise SystemExit(main())
