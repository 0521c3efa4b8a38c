#!/usr/bin/env bash
while ! grep -q HYBRIDSDONE /tmp/selfcal/hybrids.log; do sleep 10; done
cd /tmp/selfcal/wt; export PYTHONPATH=/tmp/selfcal/wt
/work/main/.venv/bin/python jobs/eval_compression.py --model /tmp/selfcal/smollm2-own \
  --tasks niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1 --length 4096 --samples 10 --seed 1 \
  --methods criticalkv-shares-kvzap --kvzap-model /tmp/selfcal/job-4096/calibration/kvzap-tmp--selfcal--smollm2-own.safetensors \
  --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output /tmp/selfcal/sweep-4096-seed1 > /tmp/selfcal/sweep-4096-seed1.log 2>&1
echo "seed1 rc=$?"
echo SEED1DONE
