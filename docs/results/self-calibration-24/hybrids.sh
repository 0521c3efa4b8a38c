#!/usr/bin/env bash
# "Predictor and table apart" (README.md): the hybrid files, then 2K (60 documents) and 4K (seed 0 and
# seed 1, 50 each) sweeps of criticalkv-shares-kvzap with them. Run from a worktree of ad86f1b (outputs
# under /tmp/sc24h, copied here compacted with `python -m pipeline.compact`); the model copy as in run.sh.
cd /work/wt-sweep; export PYTHONPATH=/work/wt-sweep OMP_WAIT_POLICY=PASSIVE
PY=/work/main/.venv/bin/python
$PY docs/results/self-calibration-24/make_hybrids.py /tmp/sc24h
T=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
for H in shippred-self24shares-2k selfpred24-shipshares-2k shippred-meanshares-2k; do
  $PY jobs/eval_compression.py --model /tmp/selfcal/smollm2-own --tasks $T --length 2048 --samples 10 \
    --methods criticalkv-shares-kvzap --kvzap-model /tmp/sc24h/$H.safetensors --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 \
    --settings-per-decode 16 --output /tmp/sc24h/$H > /tmp/sc24h/$H.log 2>&1
  echo "$H rc=$?"; date
done
T=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1
for S in 0 1; do
  $PY jobs/eval_compression.py --model /tmp/selfcal/smollm2-own --tasks $T --length 4096 --samples 10 --seed $S \
    --methods criticalkv-shares-kvzap --kvzap-model /tmp/sc24h/shippred-self24shares-4k.safetensors --cache-sizes 0.1,0.2,0.4 \
    --max-new-tokens 48 --settings-per-decode 16 --output /tmp/sc24h/shippred-self24shares-4k-s$S > /tmp/sc24h/4k-s$S.log 2>&1
  echo "4k seed $S rc=$?"; date
done
$PY jobs/eval_compression.py --model /tmp/selfcal/smollm2-own --tasks $T --length 4096 --samples 10 --seed 1 \
  --methods criticalkv-shares-kvzap --kvzap-model /tmp/sc24h/shippred-meanshares-4k.safetensors --cache-sizes 0.1,0.2,0.4 \
  --max-new-tokens 48 --settings-per-decode 16 --output /tmp/sc24h/shippred-meanshares-4k-s1 > /tmp/sc24h/mean-4k-s1.log 2>&1
echo "mean 4k seed 1 rc=$?"; date
