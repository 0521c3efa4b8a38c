#!/usr/bin/env bash
# README.md's runs, from a worktree (outputs under /tmp/bounded). Usage: run.sh STEP
# STEP fit: targets of the pooled calibration's 56 documents, then the fits (writes kvzap-bounded.safetensors);
# STEP fit4k (after fit): the 4K file's 16 documents, then the fits (writes kvzap-bounded-4k.safetensors);
# STEP screen: B on the 2K set; STEP diag4k: B on the 4K set (seed 0); STEP round2: B and the shipped file on 2K seed 1;
# STEP round3 (after fit4k): B4 on the 4K set (seed 0).
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
O=/tmp/bounded; mkdir -p $O; B="criticalkv-shares-kvzap[kvzap_model=$O/kvzap-bounded.safetensors]"
sweep() {  # length tasks output
  $PY jobs/eval_compression.py --tasks $2 --length $1 --samples 10 --seed 0 --methods "$B" \
    --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output $3 > $3.log 2>&1
  echo "$3 rc=$?"; date
}
date
case "$1" in
  fit) $PY docs/results/kvzap-bounded/bounded.py targets $O/targets.pt > $O/targets.log 2>&1 && \
       $PY docs/results/kvzap-bounded/bounded.py fit $O/targets.pt $O > $O/fit.log 2>&1; echo "fit rc=$?" ;;
  fit4k) $PY docs/results/kvzap-bounded/bounded.py targets4k $O/targets.pt $O/targets-4k.pt > $O/targets-4k.log 2>&1 && \
       $PY docs/results/kvzap-bounded/bounded.py fit4k $O/targets-4k.pt $O > $O/fit4k.log 2>&1; echo "fit4k rc=$?" ;;
  screen) sweep 2048 $T2 $O/screen-2k ;;
  diag4k) sweep 4096 $T4 $O/diag-4k ;;
  round3) $PY jobs/eval_compression.py --tasks $T4 --length 4096 --samples 10 --seed 0 \
      --methods "criticalkv-shares-kvzap[kvzap_model=$O/kvzap-bounded-4k.safetensors]" --cache-sizes 0.1,0.2,0.4 \
      --max-new-tokens 48 --settings-per-decode 16 --output $O/round3-4k > $O/round3-4k.log 2>&1; echo "round3 rc=$?"; date ;;
  round2) $PY jobs/eval_compression.py --tasks $T2 --length 2048 --samples 10 --seed 1 --methods "$B,criticalkv-shares-kvzap" \
      --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output $O/round2-2k-seed1 \
      > $O/round2-2k-seed1.log 2>&1; echo "round2 rc=$?"; date ;;
esac
echo ALLDONE
