"""Answer questions about long documents on Ray with CriticalKV-compressed KV caches.

    python jobs/longdoc_qa.py                                   # built-in samples, SmolLM2, CPU
    python jobs/longdoc_qa.py --input docs.parquet --output OUT --method criticalkv-shares-kvzap --cache-size 0.4
    ray job submit --working-dir . -- python jobs/longdoc_qa.py --input ... --output /shared/OUT

Rerunning into the same --output resumes: only documents without committed rows are processed.
All options: --help. The work is done by pipeline.distributed (this file only starts it).
"""

from pipeline.apps.batch_jobs import main

if __name__ == "__main__":
    raise SystemExit(main("longdoc_qa"))
