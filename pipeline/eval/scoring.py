"""Scoring an answer against its references by the task's metric (RULER task or LongBench dataset).

:func:`score_answer` is what the batch jobs hand the Ray actors to fill the ``score`` column
(:func:`pipeline.distributed.driver.run_job`'s ``score=``); the sweep scores the same way.
"""

from __future__ import annotations

from .longbench import LONGBENCH_DATASET_METRIC
from .metrics import rouge_l, score
from .ruler import TASK_METRIC
from .summaries import SUMMARY_METRIC, SUMMARY_TASK


def metric_for_task(task: str | None) -> str | None:
    """The metric of a RULER task, LongBench dataset name or the essay summaries (None when unknown)."""
    if not task:
        return None
    if task == SUMMARY_TASK:
        return SUMMARY_METRIC
    return TASK_METRIC.get(task) or LONGBENCH_DATASET_METRIC.get(task)


def score_prediction(metric: str | None, prediction: str | None, references: list[str] | None) -> float | None:
    """Score of one answer, or None when there is nothing to score against."""
    if not metric or not references or prediction is None:
        return None
    return score(metric, prediction, references)


def score_answer(
    task: str | None,
    prediction: str | None,
    references: list[str] | None,
    full_cache_prediction: str | None = None,
    default_metric: str | None = None,
) -> float | None:
    """Score of an answer with references: by its document's task's metric (RULER task, LongBench
    dataset), else by ``default_metric`` (the jobs' ``--metric``); None without references.

    Essay summaries have no references: in a sweep they score ROUGE-L against the full cache's
    answer to the same question (``full_cache_prediction``), None elsewhere."""
    metric = metric_for_task(task) or default_metric
    if metric == SUMMARY_METRIC:
        if prediction is None or full_cache_prediction is None:
            return None
        return rouge_l(prediction, [full_cache_prediction])
    return score_prediction(metric, prediction, references)
