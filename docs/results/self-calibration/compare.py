"""Pair the self-calibrated rows with the shipped file's rows per document and cell."""
import sys, math
import pyarrow.parquet as pq
from collections import defaultdict

def load(path, method):
    t = pq.read_table(path).to_pylist()
    full = {}
    cells = defaultdict(dict)
    for r in t:
        if r["method"] == "none":
            full[(r["doc_id"], r["question_id"].split("|")[0])] = r
        elif r["method"] == method:
            cells[r["cache_size"]][(r["doc_id"], r["question_id"].split("|")[0])] = r
    return full, cells

def sign_p(wins, losses):
    n = wins + losses
    if n == 0: return 1.0
    k = min(wins, losses)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * p)

def task_mean(rows, full):
    by = defaultdict(list); byf = defaultdict(list)
    for key, r in rows.items():
        by[r["task"]].append(r["score"] or 0.0)
        byf[r["task"]].append(full[key]["score"] or 0.0)
    ratios = []
    s = sum(sum(v)/len(v) for v in by.values())/len(by)
    f = sum(sum(v)/len(v) for v in byf.values())/len(byf)
    return s, f

self_path, ship_path, method = sys.argv[1], sys.argv[2], "criticalkv-shares-kvzap"
fs, cs = load(self_path, method)
fp, cp = load(ship_path, method)
print(f"documents: self {len(fs)}, shipped {len(fp)}")
same_full = sum(1 for k in fs if k in fp and fs[k]["prediction"] == fp[k]["prediction"])
print(f"full-cache rows with the same prediction in both sweeps: {same_full}/{len(fs)}")
for size in sorted(cs):
    a, b = cs[size], cp.get(size, {})
    keys = [k for k in a if k in b]
    sa, f = task_mean({k: a[k] for k in keys}, fs)
    sb, fb = task_mean({k: b[k] for k in keys}, fp)
    na = sum(a[k]["answer_nll_delta"] for k in keys) / len(keys)
    nb = sum(b[k]["answer_nll_delta"] for k in keys) / len(keys)
    worse = sum(1 for k in keys if a[k]["answer_nll_delta"] > b[k]["answer_nll_delta"] + 1e-9)
    better = sum(1 for k in keys if a[k]["answer_nll_delta"] < b[k]["answer_nll_delta"] - 1e-9)
    kept = max(r["kv_bytes_kept"] / r["kv_bytes_full"] for r in a.values())
    print(f"size {size}: n={len(keys)} score/full self {sa/f:.2f} shipped {sb/fb:.2f} (full {f:.3f}); "
          f"NLL d self {na:.3f} shipped {nb:.3f}; self worse in {worse}, better in {better}, p={sign_p(worse, better):.3f}; max kept {kept:.4f}")
