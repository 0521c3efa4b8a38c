"""Ray Data driver (:func:`run_job`) and the actor class (:class:`Predictor`) of the batch jobs.

Nothing here knows about attention or caches: the actor holds a :class:`pipeline.engine.Engine`
and turns its answers into output-schema rows; the driver moves documents and rows around.
"""

from pipeline.distributed.driver import JobConfigError, JobFailed, RunResult, run_job
from pipeline.distributed.predictor import Predictor

__all__ = ["JobConfigError", "JobFailed", "Predictor", "RunResult", "run_job"]
