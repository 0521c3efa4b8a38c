"""Ray Data driver (:func:`run_job`) and the actor class (:class:`Predictor`) of the batch jobs.

Nothing here knows about attention or caches: the actor holds a :class:`pipeline.engine.Engine`
and turns its answers into output-schema rows; the driver moves documents and rows around.

The names below are imported on first use: the Ray tasks of ``normalise="ray"`` unpickle functions
of :mod:`pipeline.distributed.inputs` and must not pay for importing torch and transformers through
the driver and the actor (about 3 s per fresh worker on 2 cores).
"""

from importlib import import_module

_EXPORTS = {
    "JobConfigError": "pipeline.distributed.driver",
    "JobFailed": "pipeline.distributed.driver",
    "RunResult": "pipeline.distributed.driver",
    "run_job": "pipeline.distributed.driver",
    "Predictor": "pipeline.distributed.predictor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
