#!/usr/bin/env bash
# The three sweeps of README.md with the within-document file; from a worktree (outputs under /tmp/kvw).
PY=/work/main/.venv/bin/python; F=${1:-/tmp/kvw/cand/smollm2-within.safetensors}
export OMP_WAIT_POLICY=PASSIVE
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
run() {  # length seed tasks output
  $PY jobs/eval_compression.py --tasks $3 --length $1 --samples 10 --seed $2 --methods criticalkv-shares-kvzap \
    --kvzap-model "$F" --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output $4 > $4.log 2>&1
  echo "$4 rc=$?"; date
}
date
run 2048 0 $T2 /tmp/kvw/sweep-2k
run 4096 0 $T4 /tmp/kvw/sweep-4k
run 4096 1 $T4 /tmp/kvw/sweep-4k-seed1
echo ALLDONE
