"""Why do compressed 4K summaries run to the token limit? Length, ending and repetition per setting.

python docs/results/summaries-4k/analyse.py docs/results/summaries-4k/sweep-a [DOC_ID]
"""

import re
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.dataset as ds

from pipeline.eval.metrics import rouge_l

root = Path(sys.argv[1])
files = [p for p in root.rglob("*.parquet") if "part" in p.name or p.parent.name != "_tmp"]
table = ds.dataset([str(p) for p in files], format="parquet").to_table().to_pylist()
rows = [r for r in table if r.get("error") is None]
full = {r["doc_id"]: r for r in rows if r["method"] == "none"}


def sentences(text):
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) > 10]


def repeats(text):
    """(repeated sentences, longest run of an 8-word window seen before)"""
    sents = sentences(text)
    dup = len(sents) - len(set(sents))
    words = text.split()
    seen, again = set(), 0
    for i in range(len(words) - 7):
        gram = tuple(words[i : i + 8])
        if gram in seen:
            again += 1
        seen.add(gram)
    return dup, again


by = defaultdict(list)
for r in rows:
    by[(r["method"], r["cache_size"])].append(r)
HEAD = "| setting | docs | mean tokens | ÷ full | ended by EOS | summaries with a repeated sentence"
print(HEAD + " | 8-word windows repeated (mean) | ROUGE-L vs full |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for key in sorted(by, key=lambda k: (k[0] != "none", k[0], k[1])):
    group = by[key]
    toks = [r["generated_tokens"] for r in group]
    ref = [full[r["doc_id"]]["generated_tokens"] for r in group]
    stops = sum(r["finish_reason"] == "stop" for r in group)
    reps = [repeats(r["prediction"]) for r in group]
    rl = [rouge_l(r["prediction"], [full[r["doc_id"]]["prediction"]]) for r in group]
    print(
        f"| {key[0]} @ {key[1]:g} | {len(group)} | {sum(toks) / len(toks):.0f} | {sum(toks) / sum(ref):.2f} | "
        f"{stops}/{len(group)} | {sum(d > 0 for d, _ in reps)} | {sum(a for _, a in reps) / len(reps):.0f} | "
        f"{sum(rl) / len(rl):.3f} |"
    )
if len(sys.argv) > 2:
    for r in rows:
        if r["doc_id"] == sys.argv[2]:
            head = f"{r['method']} @ {r['cache_size']} ({r['generated_tokens']} tokens, {r['finish_reason']})"
            print(f"\n--- {head}\n{r['prediction']}")
