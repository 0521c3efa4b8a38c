#!/usr/bin/env bash
# One top-k across layers (criticalkv-layer-kvzap) over the shipped per-length file's predictions, at 0.1
# and 0.2, on the three RULER sets of issue #52; from a worktree (outputs under /tmp/layerh). Usage: run.sh
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD  # the driver imports the worktree's pipeline, as its Ray workers do
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
O=/tmp/layerh; mkdir -p $O
sweep() {  # length seed tasks output
  $PY jobs/eval_compression.py --tasks $3 --length $1 --samples 10 --seed $2 --methods criticalkv-layer-kvzap \
    --cache-sizes 0.1,0.2 --max-new-tokens 48 --settings-per-decode 16 --output $4 > $4.log 2>&1
  echo "$4 rc=$?"; date
}
date
sweep 4096 1 $T4 $O/sweep-4k-seed1
sweep 4096 0 $T4 $O/sweep-4k
sweep 2048 0 $T2 $O/sweep-2k
echo ALLDONE
