#!/usr/bin/env bash
# README.md's runs, from a worktree of 2192ef1, the revision that holds the per-size file format (removed after
# the verdicts); outputs under /tmp/perlen and /tmp/sizeswitch. Usage: run.sh STEP
# STEP calibrate: the 2K-only file (../kvzap-per-length/run.sh calibrate's second file);
# STEP seed1: H2 (Z's reading at 0.1) on the fresh 2K set (seed 1), 0.1 only;
# STEP seed2 / 3k: Z and the shipped file at 0.1 and 0.15 on 60 new 2K documents (seed 2) / the 3K set;
# Round 2: STEP calibrate3k: the 3K-only file; STEP round2: Z3 and the shipped file at 0.1 and 0.15 on 3K seed 1,
# 2.5K, 3.5K (seed 0) and 2K seed 2.
PY=/work/main/.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD
T2=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
T4=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
O=/tmp/sizeswitch; mkdir -p $O /tmp/perlen; HERE=docs/results/kvzap-size-switch
Z="criticalkv-shares-kvzap[kvzap_model=$O/kvzap-z.safetensors]"
sweep() {  # length seed tasks methods sizes output
  $PY jobs/eval_compression.py --tasks $3 --length $1 --samples 10 --seed $2 --methods "$4" --cache-sizes $5 \
    --max-new-tokens 48 --settings-per-decode 16 --output $6 > $6.log 2>&1; echo "$6 rc=$?"; date
}
date
case "$1" in
  calibrate) $PY jobs/calibrate_kvzap.py --lengths 2048 --documents 16 --sample-tokens 384 \
      --output /tmp/perlen/kvzap-2048.safetensors > /tmp/perlen/calibrate-2048.log 2>&1; echo "calibrate rc=$?" ;;
  seed1) $PY $HERE/make_files.py h2 /tmp/perlen/kvzap-2048.safetensors $O/kvzap-h2.safetensors
      sweep 2048 1 $T2 "criticalkv-shares-kvzap[kvzap_model=$O/kvzap-h2.safetensors]" 0.1 $O/seed1-2k ;;
  seed2) $PY $HERE/make_files.py z /tmp/perlen/kvzap-2048.safetensors $O/kvzap-z.safetensors
      sweep 2048 2 $T2 "$Z,criticalkv-shares-kvzap" 0.1,0.15 $O/seed2-2k ;;
  3k) sweep 3072 0 $T4 "$Z,criticalkv-shares-kvzap" 0.1,0.15 $O/z-3k ;;
  calibrate3k) $PY jobs/calibrate_kvzap.py --lengths 3072 --documents 16 --sample-tokens 384 \
      --output /tmp/perlen/kvzap-3072.safetensors > /tmp/perlen/calibrate-3072.log 2>&1; echo "calibrate3k rc=$?" ;;
  round2) Z3="criticalkv-shares-kvzap[kvzap_model=$O/kvzap-z3.safetensors]"
      $PY $HERE/make_files.py z3 /tmp/perlen/kvzap-2048.safetensors /tmp/perlen/kvzap-3072.safetensors $O/kvzap-z3.safetensors
      sweep 3072 1 $T4 "$Z3,criticalkv-shares-kvzap" 0.1,0.15 $O/z3-3k-seed1
      sweep 2560 0 $T4 "$Z3,criticalkv-shares-kvzap" 0.1,0.15 $O/z3-2560
      sweep 3584 0 $T4 "$Z3,criticalkv-shares-kvzap" 0.1,0.15 $O/z3-3584
      sweep 2048 2 $T2 "$Z3,criticalkv-shares-kvzap" 0.1,0.15 $O/z3-2k-seed2 ;;
esac
echo ALLDONE
