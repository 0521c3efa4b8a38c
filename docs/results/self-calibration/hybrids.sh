#!/usr/bin/env bash
while ! grep -q ALLDONE /tmp/selfcal/run.log; do sleep 10; done
cd /tmp/selfcal/wt; export PYTHONPATH=/tmp/selfcal/wt
T=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery
for H in selfpred-shipshares shippred-selfshares; do
  /work/main/.venv/bin/python jobs/eval_compression.py --model /tmp/selfcal/smollm2-own --tasks $T --length 2048 --samples 10 \
    --methods criticalkv-shares-kvzap --kvzap-model /tmp/selfcal/hybrid-$H.safetensors --cache-sizes 0.2,0.4 --max-new-tokens 48 \
    --settings-per-decode 16 --output /tmp/selfcal/hybrid-$H > /tmp/selfcal/hybrid-$H.log 2>&1
  echo "$H rc=$?"
done
echo HYBRIDSDONE
