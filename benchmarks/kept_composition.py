"""What a compression method keeps, by the part of the prompt each entry belongs to.

    python -m benchmarks.kept_composition [--length 4096] [--seeds 0,1] [--samples 2]
        [--variants criticalkv-shares-kvzap@0.2,criticalkv-shares-kvzap@0.4,criticalkv-layer-kvzip@0.4]
        [--tasks niah_single_1,...] [--out benchmarks/results/kept_composition.md]

A diagnostic for "why does a method answer worse with more memory": for RULER needle documents
(the eval sweeps' generator, query-agnostic as the jobs run), every context token is put in one
class, and each variant's kept fraction of each class is reported, mean over documents, layers and
KV heads. Classes, in the order they are assigned:

* ``template``     BOS + chat-template head (the prompt's ``prefix_tokens``; KVzip's sinks);
* ``window``       the context chunk's last ``window`` tokens (every scorer keeps them);
* ``needle``       tokens overlapping a needle sentence that holds a reference answer;
* ``distractor``   tokens overlapping any other needle sentence (other keys, RULER's distractors);
* ``instruction``  the task's text before the haystack (up to its first line break);
* ``haystack``     everything else.

For two sizes of one method (``NAME@0.2`` and ``NAME@0.4``) it also says where the entries the
larger size adds go, and whether the kept sets are nested. SmolLM2 fp32 on CPU through
``Engine.compress_context``: the real prefill, scoring and selection of the jobs.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import load_smollm2, machine, variant_engine
from pipeline.engine.types import Request
from pipeline.eval.sweep import ruler_documents, token_counter

CLASSES = ("template", "window", "needle", "distractor", "instruction", "haystack")
NEEDLE_SENTENCE = re.compile(r"One of the special magic [^\n]*? is: [^\n]*?\.(?=\s|$)")
DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue"
DEFAULT_VARIANTS = "criticalkv-shares-kvzap@0.2,criticalkv-shares-kvzap@0.4,criticalkv-layer-kvzip@0.4"


def token_classes(tokenizer, doc: dict, prefix_tokens: int, context_tokens: int, window: int) -> torch.Tensor:
    """(n,) long class index (into :data:`CLASSES`) of each context-chunk token of ``doc``."""
    text = doc["context"]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    references = [value for refs in doc["references"] for value in refs]
    char_class = [CLASSES.index("haystack")] * len(text)
    first_break = text.find("\n")
    for i in range(first_break if first_break > 0 else 0):
        char_class[i] = CLASSES.index("instruction")
    for match in NEEDLE_SENTENCE.finditer(text):
        kind = "needle" if any(ref in match.group(0) for ref in references) else "distractor"
        for i in range(match.start(), match.end()):
            char_class[i] = CLASSES.index(kind)
    classes = torch.full((context_tokens,), CLASSES.index("haystack"), dtype=torch.long)
    classes[:prefix_tokens] = CLASSES.index("template")
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        if prefix_tokens + t < context_tokens and end > start:
            classes[prefix_tokens + t] = min(char_class[start:end], key=_priority)
    classes[max(context_tokens - window, 0) :] = CLASSES.index("window")
    return classes


def _priority(cls: int) -> int:
    """needle over distractor over instruction over haystack, where a token straddles two."""
    return ("needle", "distractor", "instruction", "haystack").index(CLASSES[cls])


def kept_masks(engine, doc: dict) -> tuple[torch.Tensor, int]:
    """(L, H_kv, n) bool of the kept context entries, and the prompt's template-prefix length."""
    request = Request(doc["doc_id"], doc["context"], doc["questions"], answer_prefix=doc["answer_prefix"])
    prompt = engine.prompts.encode(request.context, request.questions, request.answer_prefix)
    n = len(prompt.context_ids)  # these documents fit the model's window: nothing is cut
    cache = engine.compress_context(request)
    layers, heads = engine.shape.num_layers, engine.shape.num_kv_heads
    mask = torch.zeros(layers, heads, n, dtype=torch.bool)
    for layer in range(layers):
        for head in range(heads):
            mask[layer, head, cache.kept_positions(layer, 0, head)] = True
    return mask, prompt.prefix_tokens


def composition(mask: torch.Tensor, classes: torch.Tensor) -> dict[str, float]:
    """Kept fraction of each class's entries (over layers, heads and the class' tokens)."""
    out = {}
    for c, name in enumerate(CLASSES):
        sel = classes == c
        if sel.any():
            out[name] = mask[:, :, sel].float().mean().item()
    return out


def measure(loaded, variants: list[str], docs: list[dict], window: int) -> dict:
    """Per variant: the per-class kept fractions of each document, the masks, and the seconds spent
    (``loaded``: the model, a :func:`~pipeline.engine.loading.load_model` result)."""
    tokenizer = loaded.tokenizer
    sums: dict[str, dict[str, list[float]]] = {v: defaultdict(list) for v in variants}
    masks: dict[str, list[torch.Tensor]] = {v: [] for v in variants}
    classes_per_doc = []
    seconds = defaultdict(float)
    for variant in variants:
        name, size = variant.rsplit("@", 1)
        engine = variant_engine(loaded, name, float(size))
        for d, doc in enumerate(docs):
            t0 = time.perf_counter()
            mask, prefix = kept_masks(engine, doc)
            seconds[variant] += time.perf_counter() - t0
            if len(classes_per_doc) <= d:
                classes_per_doc.append(token_classes(tokenizer, doc, prefix, mask.shape[-1], window))
            for cls, frac in composition(mask, classes_per_doc[d]).items():
                sums[variant][cls].append(frac)
            masks[variant].append(mask)
        print(f"{variant}: {len(docs)} documents in {seconds[variant]:.0f} s", flush=True)
    return {"sums": sums, "masks": masks, "classes": classes_per_doc, "seconds": seconds}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def composition_table(result: dict, variants: list[str]) -> list[str]:
    classes = result["classes"]
    tokens = {name: _mean([(c == i).sum().item() for c in classes]) for i, name in enumerate(CLASSES)}
    lines = ["| variant | " + " | ".join(CLASSES) + " | template whole in (layer, head) | s/doc |"]
    lines.append("|---" * (len(CLASSES) + 3) + "|")
    lines.append("| tokens per document | " + " | ".join(f"{tokens[c]:.1f}" for c in CLASSES) + " | | |")
    for v in variants:
        whole = _mean([m[:, :, c == 0].all(dim=-1).float().mean().item() for m, c in zip(result["masks"][v], classes)])
        cells = " | ".join(f"{_mean(result['sums'][v][c]):.3f}" for c in CLASSES)
        lines.append(f"| {v} | {cells} | {whole:.3f} | {result['seconds'][v] / len(classes):.1f} |")
    return lines


def growth_table(result: dict, variants: list[str]) -> list[str]:
    """For each method at two sizes: nesting, and where the added entries go."""
    by_method = defaultdict(list)
    for v in variants:
        by_method[v.rsplit("@", 1)[0]].append(v)
    lines = []
    for method, sizes in by_method.items():
        if len(sizes) < 2:
            continue
        small, large = sorted(sizes, key=lambda v: float(v.rsplit("@", 1)[1]))[:2]
        nested, share = [], defaultdict(list)
        for a, b, c in zip(result["masks"][small], result["masks"][large], result["classes"]):
            nested.append((a & b).sum().item() / max(a.sum().item(), 1))
            added = b & ~a
            for i, name in enumerate(CLASSES):
                share[name].append(added[:, :, c == i].sum().item() / max(added.sum().item(), 1))
        lines += [
            "",
            f"**{method}, {small.rsplit('@', 1)[1]} → {large.rsplit('@', 1)[1]}**: "
            f"{100 * _mean(nested):.1f} % of the smaller size's entries are kept by the larger one.",
            "",
            "| share of the added entries | " + " | ".join(CLASSES) + " |",
            "|---" * (len(CLASSES) + 1) + "|",
            "| | " + " | ".join(f"{_mean(share[c]):.3f}" for c in CLASSES) + " |",
        ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="RULER document length in tokens (default 4096)")
    parser.add_argument("--seeds", default="0,1", help="document seeds, comma-separated (default 0,1)")
    parser.add_argument("--samples", type=int, default=2, help="documents per task and seed (default 2)")
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help=f"RULER tasks (default {DEFAULT_TASKS})")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"NAME@SIZE list (default {DEFAULT_VARIANTS})")
    parser.add_argument("--window", type=int, default=32, help="the observation window (default 32)")
    parser.add_argument("--out", type=Path, default=None, help="write the report here as well")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    variants = args.variants.split(",")
    loaded = load_smollm2()
    counter = token_counter(loaded.tokenizer)
    docs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        docs += ruler_documents(args.tasks.split(","), args.length, args.samples, counter, seed=seed)
    result = measure(loaded, variants, docs, args.window)
    lines = [
        "# What each method keeps, by prompt class",
        "",
        f"- command: `python -m benchmarks.kept_composition --length {args.length} --seeds {args.seeds} "
        f"--samples {args.samples} --tasks {args.tasks} --variants {args.variants}`",
        f"- {len(docs)} documents; machine: {machine()}",
        "",
        "Kept fraction of each class's entries (mean over documents, layers and KV heads):",
        "",
        *composition_table(result, variants),
        *growth_table(result, variants),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
