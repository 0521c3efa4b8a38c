"""Evaluation: RULER / LongBench metrics and an offline RULER-style task generator.

* :mod:`pipeline.eval.metrics` -- ``score(metric_name, prediction, references)`` and ``METRICS``
  (RULER string matching, arXiv 2404.06654; LongBench F1 / ROUGE-L / classification / retrieval /
  count / code similarity, arXiv 2308.14508).
* :mod:`pipeline.eval.longbench` -- ``load_longbench_jsonl(path)`` for user-provided LongBench data.
* :mod:`pipeline.eval.ruler` -- ``generate_task(task, length_tokens, count_tokens, n_samples, seed)``
  for the 11 RULER tasks that need no external data set (``TASKS``).
"""

from .longbench import LONGBENCH_DATASET_METRIC, load_longbench_jsonl
from .metrics import METRICS, score
from .ruler import TASKS, generate_task

__all__ = ["LONGBENCH_DATASET_METRIC", "METRICS", "TASKS", "generate_task", "load_longbench_jsonl", "score"]
