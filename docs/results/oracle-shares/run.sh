#!/usr/bin/env bash
# The sweeps of README.md; from a worktree (outputs under /tmp/oracle). Usage: run.sh STEP
# STEP 4k: exact KVzip+ and KVzip scores through the shipped shares table, 4K set (seed 0);
# STEP 2k: the same on the 2K set (seed 0).
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD  # the driver imports the worktree's pipeline, as its Ray workers do
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
M="criticalkv-shares-kvzip[kvzip_plus=true,first_stage_ratio=0.75],criticalkv-shares-kvzip"
run() {  # length seed tasks output
  mkdir -p /tmp/oracle
  $PY jobs/eval_compression.py --tasks $3 --length $1 --samples 10 --seed $2 --methods "$M" \
    --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output $4 > $4.log 2>&1
  echo "$4 rc=$?"; date
}
date
case "$1" in
  4k) run 4096 0 $T4 /tmp/oracle/sweep-4k ;;
  2k) run 2048 0 $T2 /tmp/oracle/sweep-2k ;;
esac
echo ALLDONE
