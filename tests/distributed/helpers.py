"""Test-only engine factory: ``JobConfig(engine_factory="tests.distributed.helpers:tiny_engine")``.

The model name picks a tiny random architecture built in code: ``tiny-llama``, ``tiny-qwen2``, ...
"""

from pipeline.engine.config import GenerationConfig, ModelConfig
from pipeline.engine.engine import Engine
from pipeline.kv.config import CompressionConfig
from tests import faults
from tests.tiny import ARCHS, tiny_loaded


def tiny_engine(model: ModelConfig, compression: CompressionConfig, generation: GenerationConfig) -> Engine:
    """The tiny engine; in a run whose processes name a faults file, with the fault hook installed."""
    faults.install_from_environment()
    arch = model.name.removeprefix("tiny-")
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny model {model.name!r}; choose tiny-{', tiny-'.join(ARCHS)}")
    return Engine(tiny_loaded(arch), compression, generation, max_context_tokens=model.max_context_tokens)
