#!/usr/bin/env bash
# 24-document self-calibration (docs/results/self-calibration-24/README.md): 2K, then 4K seed 0 and seed 1
# run from a worktree of edabcac (outputs under /tmp/sc24, copied here compacted)
cd /work/wt-sweep; export PYTHONPATH=/work/wt-sweep OMP_WAIT_POLICY=PASSIVE
PY=/work/main/.venv/bin/python
for L in 2048 4096; do
  if [ "$L" = 2048 ]; then T=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery; else T=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1; fi
  date; $PY jobs/longdoc_qa.py --input /tmp/selfcal/docs-$L.parquet --model /tmp/selfcal/smollm2-own \
    --method criticalkv-shares-kvzap --cache-size 0.2 --max-new-tokens 48 --calibration-docs 24 \
    --output /tmp/sc24/job-$L > /tmp/sc24/job-$L.log 2>&1
  echo "job $L rc=$?"; date
  F=$(ls /tmp/sc24/job-$L/calibration/*.safetensors)
  $PY jobs/eval_compression.py --model /tmp/selfcal/smollm2-own --tasks $T --length $L --samples 10 \
    --methods criticalkv-shares-kvzap --kvzap-model "$F" --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 \
    --settings-per-decode 16 --output /tmp/sc24/sweep-$L > /tmp/sc24/sweep-$L.log 2>&1
  echo "sweep $L rc=$?"; date
done
$PY jobs/eval_compression.py --model /tmp/selfcal/smollm2-own \
  --tasks niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1 --length 4096 --samples 10 --seed 1 \
  --methods criticalkv-shares-kvzap --kvzap-model "$F" --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 \
  --settings-per-decode 16 --output /tmp/sc24/sweep-4096-seed1 > /tmp/sc24/sweep-4096-seed1.log 2>&1
echo "seed1 rc=$?"; date
echo ALLDONE
