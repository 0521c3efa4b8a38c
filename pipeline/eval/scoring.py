"""Scoring an answer against its references by the task's metric (RULER task or LongBench dataset).

:func:`score_answer` is what the batch jobs hand the Ray actors to fill the ``score`` column
(:func:`pipeline.distributed.driver.run_job`'s ``score=``); the sweep scores the same way.
"""

from __future__ import annotations

from .longbench import LONGBENCH_DATASET_METRIC
from .metrics import score
from .ruler import TASK_METRIC


def metric_for_task(task: str | None) -> str | None:
    """The metric of a RULER task or LongBench dataset name (None when unknown)."""
    if not task:
        return None
    return TASK_METRIC.get(task) or LONGBENCH_DATASET_METRIC.get(task)


def score_prediction(metric: str | None, prediction: str | None, references: list[str] | None) -> float | None:
    """Score of one answer, or None when there is nothing to score against."""
    if not metric or not references or prediction is None:
        return None
    return score(metric, prediction, references)


def score_answer(task: str | None, prediction: str | None, references: list[str] | None) -> float | None:
    """Score of an answer whose document names a known task and has references, else None."""
    return score_prediction(metric_for_task(task), prediction, references)
