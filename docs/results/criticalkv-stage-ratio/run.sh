#!/usr/bin/env bash
# The sweeps of README.md; from a worktree (outputs under /tmp/csr). Usage: run.sh STEP
# STEP screen: the three stage-1 ratios on the 4K set (seed 0); STEP confirm RATIOS: those on 2K and 4K seed 1;
# STEP round2: 0.75 on 2K, 0.75 and 0.9 on 4K seed 1 (round2-4k: the latter alone); STEP summaries: 0.75 on 4K essays;
# STEP selfcal: 0.75 with the job's self-calibrated files.
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD  # the driver imports the worktree's pipeline, as its Ray workers do
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
methods() { local out=""; for r in ${1//,/ }; do out="$out${out:+,}criticalkv-shares-kvzap[first_stage_ratio=$r]"; done; echo "$out"; }
run() {  # length seed tasks methods output
  $PY jobs/eval_compression.py --tasks $3 --length $1 --samples 10 --seed $2 --methods "$4" \
    --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output $5 > $5.log 2>&1
  echo "$5 rc=$?"; date
}
date
case "$1" in
  screen) run 4096 0 $T4 "$(methods 0.25,0.75,0.9)" /tmp/csr/screen-4k ;;
  confirm) run 2048 0 $T2 "$(methods $2)" /tmp/csr/confirm-2k; run 4096 1 $T4 "$(methods $2)" /tmp/csr/confirm-4k-seed1 ;;
  # round 2 (README): the runner-up on 2K, then both ratios on the fresh 4K documents in one sweep
  round2) run 2048 0 $T2 "$(methods 0.75)" /tmp/csr/round2-2k; run 4096 1 $T4 "$(methods 0.75,0.9)" /tmp/csr/round2-4k-seed1 ;;
  round2-4k) run 4096 1 $T4 "$(methods 0.75,0.9)" /tmp/csr/round2-4k-seed1 ;;
  summaries)  # six 4K essays as ../summaries-4k/ (its sweep-a: the full cache and 0.5)
    $PY jobs/eval_compression.py --tasks summary_essay --length 4096 --samples 6 --methods "$(methods 0.75)" \
      --cache-sizes 0.2,0.4 --max-new-tokens 256 --settings-per-decode 16 --output /tmp/csr/summaries-4k \
      > /tmp/csr/summaries-4k.log 2>&1; echo "summaries rc=$?"; date ;;
  selfcal)  # the job's own 8-document files (../self-calibration/) at 0.75, on the model copy they were made for
    for L in 4096 2048; do T=$T4; [ $L = 2048 ] && T=$T2; K=$((L / 1024))k
      $PY jobs/eval_compression.py --model /tmp/selfcal/smollm2-own --tasks $T --length $L --samples 10 \
        --methods "$(methods 0.75)" --kvzap-model $PWD/docs/results/self-calibration/kvzap-self-$K.safetensors \
        --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 --settings-per-decode 16 --output /tmp/csr/selfcal-$K \
        > /tmp/csr/selfcal-$K.log 2>&1; echo "selfcal $K rc=$?"; date
    done ;;
esac
echo ALLDONE
