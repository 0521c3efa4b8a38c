#!/usr/bin/env bash
# The calibrations and sweeps of README.md; from a worktree (outputs under /tmp/perlen). Usage: run.sh STEP
# STEP calibrate: one file per length (4K, then 2K), the shipped calibration's settings at one length each;
# STEP sweep: each file on the RULER set of its length (2K seed 0, 4K seed 0, 4K seed 1);
# STEP round2: candidate H (make_h.py) against the shipped file at 3K, then H at 2K;
# STEP summaries: the shipped file (H, after the switch) on six 4K essays.
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD  # the driver imports the worktree's pipeline, as its Ray workers do
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
O=/tmp/perlen; mkdir -p $O
calibrate() {  # length
  $PY jobs/calibrate_kvzap.py --lengths $1 --documents 16 --sample-tokens 384 --output $O/kvzap-$1.safetensors \
    > $O/calibrate-$1.log 2>&1; echo "calibrate $1 rc=$?"; date
}
sweep() {  # length seed tasks output
  $PY jobs/eval_compression.py --tasks $3 --length $1 --samples 10 --seed $2 --methods criticalkv-shares-kvzap \
    --kvzap-model $O/kvzap-$1.safetensors --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 \
    --output $4 > $4.log 2>&1; echo "$4 rc=$?"; date
}
date
case "$1" in
  calibrate) calibrate 4096; calibrate 2048 ;;
  sweep) sweep 2048 0 $T2 $O/sweep-2k; sweep 4096 0 $T4 $O/sweep-4k; sweep 4096 1 $T4 $O/sweep-4k-seed1 ;;
  round2)  # candidate H (make_h.py) and the shipped file side by side on a 3K set, then H on the 2K set
    $PY docs/results/kvzap-per-length/make_h.py $O/kvzap-h.safetensors
    H="criticalkv-shares-kvzap[kvzap_model=$O/kvzap-h.safetensors]"
    $PY jobs/eval_compression.py --tasks $T4 --length 3072 --samples 10 --seed 0 --methods "$H,criticalkv-shares-kvzap" \
      --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output $O/round2-3k > $O/round2-3k.log 2>&1
    echo "round2-3k rc=$?"; date
    $PY jobs/eval_compression.py --tasks $T2 --length 2048 --samples 10 --seed 0 --methods "$H" \
      --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output $O/round2-2k > $O/round2-2k.log 2>&1
    echo "round2-2k rc=$?"; date ;;
  summaries)  # six 4K essays as ../summaries-4k/, with the shipped file (H since 2026-12-06)
    $PY jobs/eval_compression.py --tasks summary_essay --length 4096 --samples 6 --methods criticalkv-shares-kvzap \
      --cache-sizes 0.2,0.4 --max-new-tokens 256 --settings-per-decode 16 --output $O/summaries-4k \
      > $O/summaries-4k.log 2>&1; echo "summaries rc=$?"; date ;;
esac
echo ALLDONE
