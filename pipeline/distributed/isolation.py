"""Documents that kill their worker: found, answered with an ``error`` row, and the job goes on.

The commonest failure of batch LLM inference is one document that runs its actor out of memory (the
kernel's OOM killer, Ray's memory monitor, a CUDA fault): the process dies, Ray restarts the actor
and retries the batch, which kills it again. The actor pool retries a dead actor's batch once
(``max_task_retries``, :data:`ACTOR_TASK_RETRIES`), so a batch that kills its actor twice fails the
run's first pass with a worker-death error (:func:`is_worker_death`). The driver then isolates:

1. the documents without committed rows run again in their batches, with Ray Data told to drop a
   block that fails (``DataContext.max_errored_blocks``) instead of stopping, and each actor given one
   batch at a time (Ray Data queues two by default, and an actor's death fails both): every batch
   without the poison document is answered and committed;
2. those still missing run again one per batch, so that each poison document dies alone;
3. with ``--oom-retry-cache-size`` set, those still missing run once more alone at that smaller
   cache size (the rows' ``cache_size`` column says so);
4. each document still missing gets its rows committed with ``error`` set: what happened, how often,
   and its context's size. The run's manifest and summary name those documents, and the exit code
   follows the contract (3 above ``--max-error-fraction``). A rerun skips them like any error row
   unless ``--retry-errors`` asks.

Only documents normalised on the driver can be isolated (their rows are known); with ``normalise=
"ray"`` the worker-death error ends the run as before (exit 1, rerun to resume).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pyarrow as pa
import ray.exceptions
from ray.data import DataContext

from pipeline.distributed.config import JobConfig
from pipeline.distributed.rows import RowMaker

#: a batch whose actor died is retried once on a restarted actor before its pass gives up on it
ACTOR_TASK_RETRIES = 1
_RAY_DATA_BLOCK_ERRORS = "ray.data._internal.execution.streaming_executor_state"
_DEATHS = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError)


def is_worker_death(exc: BaseException | None) -> bool:
    """The error, or one it was raised from, is a Ray worker or actor process that died."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, _DEATHS):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def death_message(doc: dict, tries: list[str]) -> str:
    """The ``error`` of a document no worker survived: what happened, how often, and its size."""
    chars = len(doc.get("context") or "")
    return (
        f"worker died: the actor process answering this document died each time it tried ({', '.join(tries)}); "
        f"likely out of memory (its context has {chars:,} characters): give the actors more memory, a smaller "
        "--cache-size, --prefill-chunk or --layerwise-prefill, or --oom-retry-cache-size"
    )


class Isolation:
    """The isolation passes of one run (see the module docstring). ``run_pass(config, docs)`` runs one
    Ray Data pass over ``docs`` and commits what it returns; ``missing(docs)`` keeps the documents of
    ``docs`` without committed rows; ``commit(table)`` commits rows made on the driver."""

    def __init__(
        self,
        config: JobConfig,
        run_pass: Callable[[JobConfig, pa.Table], None],
        missing: Callable[[pa.Table], pa.Table],
        commit: Callable[[pa.Table], None],
        rows: RowMaker,
    ) -> None:
        self.config, self.run_pass, self.missing, self.commit, self.rows = config, run_pass, missing, commit, rows

    def passes(self) -> list[tuple[str, JobConfig]]:
        """(what the pass is called in an error message, its config), in order."""
        config = self.config
        alone = config.model_copy(update={"generation": config.generation.model_copy(update={"batch_size": 1})})
        out = [("in its batch again", config), ("alone", alone)]
        size = config.oom_retry_cache_size
        if size is not None and config.compression.compresses:
            smaller = alone.model_copy(
                update={"compression": alone.compression.model_copy(update={"cache_size": size})}
            )
            out.append((f"alone at cache size {size:g}", smaller))
        return out

    def isolate(self, docs: pa.Table, log: Callable[[str], None]) -> list[dict]:
        """Run the passes over the documents of ``docs`` still missing, then commit error rows for
        those no pass answered; returns ``[{"doc_id", "error"}]`` for them."""
        context, quiet = DataContext.get_current(), logging.getLogger(_RAY_DATA_BLOCK_ERRORS)
        previous, level = context.max_errored_blocks, quiet.level
        context.max_errored_blocks = -1  # a batch that kills its actor twice is dropped, the pass goes on
        quiet.setLevel(logging.CRITICAL)  # each dropped block's traceback: the lines below say it shortly
        tries = ["in its batch"]
        try:
            remaining = self.missing(docs)
            for what, config in self.passes():
                if remaining.num_rows == 0:
                    break
                log(f"a worker died: {remaining.num_rows} documents without rows run again {what}")
                self.run_pass(config, remaining)
                tries.append(what)
                remaining = self.missing(remaining)
        finally:
            context.max_errored_blocks = previous
            quiet.setLevel(level)
        poisoned = []
        for doc in remaining.to_pylist():
            message = death_message(doc, tries)
            self.commit(self.rows.to_table(self.rows.rows_for(doc, message)))
            poisoned.append({"doc_id": str(doc["doc_id"]), "error": message})
            log(f"document {doc['doc_id']!r} killed its worker every time: its rows carry the error")
        return poisoned
