#!/usr/bin/env bash
# README.md's runs (outputs under /tmp/gate). The gate kind was removed after the verdict: run this folder's scripts
# from a worktree of fdacbbe (git worktree add W fdacbbe; copy this folder over W's). Usage: run.sh STEP
# STEP collect: training pairs (KVzip's own scores); STEP train: the gate file; STEP seed0: both candidates on
# the 2K seed-0 set (the shipped file's rows are stored in ../kvzap-per-length/round2-2k); STEP seed1 / 3k METHODS:
# the candidates still standing on the next two sets of the rule; STEP 4k / 4k1 / summaries METHODS: #52's 4K sets.
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
O=/tmp/gate; mkdir -p $O; HERE=docs/results/kvzap-gate
GL="criticalkv-layer-kvzap[kvzap_model=$O/gate.safetensors,first_stage_ratio=0.5]"
GS="criticalkv-shares-kvzap[kvzap_model=$O/gate.safetensors,first_stage_ratio=0.5]"
sweep() {  # length seed tasks methods output
  $PY jobs/eval_compression.py --tasks $3 --length $1 --samples 10 --seed $2 --methods "$4" --cache-sizes 0.1,0.2,0.4 \
    --max-new-tokens 48 --settings-per-decode 16 --output $5 > $5.log 2>&1; echo "$5 rc=$?"; date
}
date
case "$1" in
  collect) $PY $HERE/collect.py $O/targets.pt > $O/collect.log 2>&1; echo "collect rc=$?" ;;
  train) $PY $HERE/train_gate.py $O/targets.pt $O/gate.safetensors > $O/train.log 2>&1; echo "train rc=$?" ;;
  seed0) sweep 2048 0 $T2 "$GL,$GS" $O/g-2k-seed0 ;;
  seed1) sweep 2048 1 $T2 "$2" $O/g-2k-seed1 ;;  # $2: the candidates still standing (shipped rows: ../kvzap-bounded/round2-2k-seed1)
  3k) sweep 3072 0 $T4 "$2" $O/g-3k-seed0 ;;  # shipped rows: ../kvzap-per-length/round2-3k
  4k) sweep 4096 0 $T4 "$2" $O/g-4k-seed0 ;;  # shipped rows: ../kvzap-per-length/sweep-4k (the 4K file, what H reads)
  4k1) sweep 4096 1 $T4 "$2" $O/g-4k-seed1 ;;  # shipped rows: ../kvzap-per-length/sweep-4k-seed1
  summaries) $PY jobs/eval_compression.py --tasks summary_essay --length 4096 --samples 14 --methods "$2" \
      --cache-sizes 0.2,0.4 --max-new-tokens 256 --settings-per-decode 16 --output $O/g-summaries \
      > $O/g-summaries.log 2>&1; echo "summaries rc=$?"; date ;;
  summaries-ridge) $PY jobs/eval_compression.py --tasks summary_essay --length 4096 --samples 14 \
      --methods criticalkv-layer-kvzap --cache-sizes 0.2 --max-new-tokens 256 --settings-per-decode 16 \
      --output $O/ridge-layer-summaries > $O/ridge-layer-summaries.log 2>&1; echo "summaries-ridge rc=$?"; date ;;
esac
echo ALLDONE
