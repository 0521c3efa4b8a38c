#!/usr/bin/env bash
# KVzip (criticalkv-layer-kvzip) on the fresh 4K set (seed 1), for the per-cell pairing of issue #52; from a worktree
# (outputs under /tmp/kvzip1). Usage: run.sh
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
O=/tmp/kvzip1; mkdir -p $O; date
$PY jobs/eval_compression.py --tasks $T4 --length 4096 --samples 10 --seed 1 --methods criticalkv-layer-kvzip \
  --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output $O/sweep-4k-seed1 \
  > $O/sweep-4k-seed1.log 2>&1; echo "kvzip seed1 rc=$?"; date
echo ALLDONE
