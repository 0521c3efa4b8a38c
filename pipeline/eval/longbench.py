"""Loader for user-provided LongBench data (JSONL) and LongBench's dataset tables.

LongBench (Bai et al., "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding", arXiv 2308.14508; https://github.com/THUDM/LongBench) ships one JSONL file per
dataset, each line holding ``input`` (the question; empty for summarisation), ``context``,
``answers`` (list of strings), ``length``, ``dataset``, ``language``, ``all_classes`` (labels of
the classification datasets, else null) and ``_id``. LongBench's data is not in any package, so
nothing here downloads it: users point :func:`load_longbench_jsonl` at files they have.

:data:`LONGBENCH_DATASET_METRIC` is LongBench's ``dataset2metric`` (``LongBench/eval.py``) written
with the metric names of :data:`pipeline.eval.metrics.METRICS`; the four datasets that LongBench
scores on the first line of the prediction (trec, triviaqa, samsum, lsht) use the
``*_first_line`` variants. :data:`LONGBENCH_MAX_NEW_TOKENS` is ``config/dataset2maxlen.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

LONGBENCH_DATASET_METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "dureader": "rouge_l_zh",
    "gov_report": "rouge_l",
    "qmsum": "rouge_l",
    "multi_news": "rouge_l",
    "vcsum": "rouge_l_zh",
    "trec": "classification_score_first_line",
    "triviaqa": "qa_f1_first_line",
    "samsum": "rouge_l_first_line",
    "lsht": "classification_score_first_line",
    "passage_retrieval_en": "retrieval_score",
    "passage_count": "count_score",
    "passage_retrieval_zh": "retrieval_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}

LONGBENCH_MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}


def longbench_dataset_name(name: str) -> str:
    """Canonical dataset name: LongBench-E files and ids carry an ``_e`` suffix (``hotpotqa_e``)."""
    if name in LONGBENCH_DATASET_METRIC:
        return name
    if name.endswith("_e") and name[:-2] in LONGBENCH_DATASET_METRIC:
        return name[:-2]
    raise ValueError(f"unknown LongBench dataset {name!r}; known datasets: {', '.join(LONGBENCH_DATASET_METRIC)}")


def load_longbench_jsonl(path: str | Path, dataset: str | None = None) -> list[dict]:
    """Read a LongBench-format JSONL file into evaluation rows.

    Args:
        path: a LongBench JSONL file (e.g. ``hotpotqa.jsonl`` or ``hotpotqa_e.jsonl``).
        dataset: dataset name for every row; by default each line's ``dataset`` field, else the
            file name's stem.

    Returns:
        One dict per line with ``doc_id`` (``_id``, else ``"{dataset}-{line}"``), ``task`` (the
        dataset name), ``context``, ``question`` (``input``; empty for summarisation),
        ``answer_prefix`` (``""``: LongBench has none), ``reference`` (``answers`` as a list of
        strings), ``all_classes`` (list or ``None``; pass it to ``score(...,
        all_classes=row["all_classes"])``), ``max_new_tokens`` (LongBench's dataset2maxlen) and
        ``metric`` (a :data:`pipeline.eval.metrics.METRICS` name from
        :data:`LONGBENCH_DATASET_METRIC`).

    Raises:
        ValueError: a line that is not a JSON object, lacks ``context`` or ``answers``, has an
            empty ``answers`` list, or names a dataset that LongBench does not have.
    """
    path = Path(path)
    rows: list[dict] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected a JSON object")
            missing = [k for k in ("context", "answers") if k not in item]
            if missing:
                raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
            answers = item["answers"]
            answers = [answers] if isinstance(answers, str) else [str(a) for a in answers or []]
            if not answers:
                raise ValueError(f"{where}: 'answers' is empty")
            try:
                name = longbench_dataset_name(dataset or item.get("dataset") or path.stem)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            classes = item.get("all_classes")
            rows.append(
                {
                    "doc_id": str(item.get("_id") or f"{name}-{line_no}"),
                    "task": name,
                    "context": str(item["context"]),
                    "question": str(item.get("input") or ""),
                    "answer_prefix": "",
                    "reference": answers,
                    "all_classes": [str(c) for c in classes] if classes else None,
                    "max_new_tokens": LONGBENCH_MAX_NEW_TOKENS[name],
                    "metric": LONGBENCH_DATASET_METRIC[name],
                }
            )
    return rows
