#!/usr/bin/env bash
# README.md's runs, from a worktree (outputs under /tmp/more2k). Usage: run.sh STEP
# STEP calibrate: the 2K file from 48 documents; STEP m: candidate M (make_m.py); STEP seed0: M alone on the 2K
# seed-0 set (the shipped file's rows are stored). Round 2: STEP calibrate-p: the pooled calibration with 48 2K
# documents; STEP p: candidate P; STEP p-seed0: P on the same set. (The rules' later steps, on 2K seeds 1 and 3
# and the 3K set, were removed after both candidates were rejected at the first set; they never ran.)
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
O=/tmp/more2k; mkdir -p $O; HERE=docs/results/kvzap-2k-more
M="criticalkv-shares-kvzap[kvzap_model=$O/kvzap-m.safetensors]"
P="criticalkv-shares-kvzap[kvzap_model=$O/kvzap-p.safetensors]"
sweep() {  # length seed tasks methods output
  $PY jobs/eval_compression.py --tasks $3 --length $1 --samples 10 --seed $2 --methods "$4" --cache-sizes 0.1,0.2,0.4 \
    --max-new-tokens 48 --settings-per-decode 16 --output $5 > $5.log 2>&1; echo "$5 rc=$?"; date
}
date
case "$1" in
  calibrate) $PY jobs/calibrate_kvzap.py --lengths 2048 --documents 48 --sample-tokens 384 \
      --output $O/kvzap-2048-48.safetensors > $O/calibrate-2048-48.log 2>&1; echo "calibrate rc=$?" ;;
  m) $PY $HERE/make_m.py $O/kvzap-2048-48.safetensors $O/kvzap-m.safetensors ;;
  seed0) sweep 2048 0 $T2 "$M" $O/m-2k-seed0 ;;
  calibrate-p) $PY jobs/calibrate_kvzap.py --lengths 512,1024,2048,4096 --documents 16,16,48,8 --sample-tokens 384 \
      --output $O/kvzap-pooled-more2k.safetensors > $O/calibrate-pooled-more2k.log 2>&1; echo "calibrate-p rc=$?" ;;
  p) $PY $HERE/make_m.py --pooled $O/kvzap-pooled-more2k.safetensors $O/kvzap-p.safetensors ;;
  p-seed0) sweep 2048 0 $T2 "$P" $O/p-2k-seed0 ;;
esac
echo ALLDONE
