#!/usr/bin/env bash
# self-calibration measurement: 2K then 4K (see docs/results/self-calibration/README.md)
set -x
cd /tmp/selfcal/wt; export PYTHONPATH=/tmp/selfcal/wt
PY=/work/main/.venv/bin/python
R=docs/results/self-calibration
$PY - <<'PYEOF'
import shutil
from pathlib import Path
from pipeline.engine.config import ModelConfig
from pipeline.engine.loading import resolve_model_path
src, _ = resolve_model_path(ModelConfig(name="smollm2"))
dst = Path("/tmp/selfcal/smollm2-own")
if not dst.exists():
    shutil.copytree(src, dst)
import pyarrow as pa, pyarrow.parquet as pq
from transformers import AutoTokenizer
from pipeline.eval.sweep import sweep_documents, token_counter
tok = AutoTokenizer.from_pretrained(dst)
sets = {2048: "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery",
        4096: "niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1"}
for length, tasks in sets.items():
    docs = sweep_documents(tasks.split(","), length, 10, token_counter(tok), seed=0, max_new_tokens=48, summary_tokens=256)
    for d in docs:
        d.pop("metric")
    pq.write_table(pa.Table.from_pylist(docs), f"/tmp/selfcal/docs-{length}.parquet")
    print(length, len(docs))
PYEOF
for L in 2048 4096; do
  if [ "$L" = 2048 ]; then T=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery; else T=niah_multikey_1,niah_multivalue,niah_single_3,niah_single_2,niah_single_1; fi
  /usr/bin/time -v $PY jobs/longdoc_qa.py --input /tmp/selfcal/docs-$L.parquet --model /tmp/selfcal/smollm2-own \
    --method criticalkv-shares-kvzap --cache-size 0.2 --max-new-tokens 48 --output /tmp/selfcal/job-$L \
    > /tmp/selfcal/job-$L.log 2>&1
  echo "job $L rc=$?"
  F=$(ls /tmp/selfcal/job-$L/calibration/*.safetensors)
  $PY jobs/eval_compression.py --model /tmp/selfcal/smollm2-own --tasks $T --length $L --samples 10 \
    --methods criticalkv-shares-kvzap --kvzap-model "$F" --cache-sizes 0.1,0.2,0.4 --max-new-tokens 48 \
    --settings-per-decode 16 --output /tmp/selfcal/sweep-$L > /tmp/selfcal/sweep-$L.log 2>&1
  echo "sweep $L rc=$?"
done
echo ALLDONE
