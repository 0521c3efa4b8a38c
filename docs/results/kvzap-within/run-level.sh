#!/usr/bin/env bash
# The level diagnostic of README.md: the file of `probe.py --cache /tmp/kvw --write FILE --level`, 4K then 2K.
cd /work/main; PY=/work/main/.venv/bin/python; F=${1:-/tmp/kvw/cand/within-level.safetensors}
export OMP_WAIT_POLICY=PASSIVE
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
date
$PY jobs/eval_compression.py --tasks $T4 --length 4096 --samples 10 --seed 0 --methods criticalkv-shares-kvzap \
  --kvzap-model "$F" --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output /tmp/kvw/level-4k > /tmp/kvw/level-4k.log 2>&1
echo "4k rc=$?"; date
$PY jobs/eval_compression.py --tasks $T2 --length 2048 --samples 10 --seed 0 --methods criticalkv-shares-kvzap \
  --kvzap-model "$F" --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output /tmp/kvw/level-2k > /tmp/kvw/level-2k.log 2>&1
echo "2k rc=$?"; date; echo ALLDONE
