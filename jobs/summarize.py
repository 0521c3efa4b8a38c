"""Summarise long documents on Ray with CriticalKV-compressed KV caches.

    python jobs/summarize.py                                    # built-in sample reports, SmolLM2, CPU
    python jobs/summarize.py --input reports.jsonl --output OUT --context-column text --max-new-tokens 200
    ray job submit --working-dir . -- python jobs/summarize.py --input ... --output /shared/OUT

Every document gets one question, the instruction (--instruction, default "Summarize the document in
a few sentences."); question columns of the input are ignored. Rerunning into the same --output
resumes. All options: --help. The work is done by pipeline.distributed (this file only starts it).
"""

from pipeline.apps.batch_jobs import main

if __name__ == "__main__":
    raise SystemExit(main("summarize"))
