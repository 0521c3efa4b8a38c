"""Scorers: one module each, registered here by name (see :mod:`pipeline.kv.parts`)."""

from ..parts import Registry, Scorer
from . import defensivekv, expected_attention, knorm, kvzap, kvzip, snapkv, streamingllm

SCORERS: Registry[Scorer] = Registry(
    "scorer",
    [
        snapkv.SnapKV(),
        streamingllm.StreamingLLM(),
        knorm.KNorm(),
        defensivekv.DefensiveKV(),
        expected_attention.ExpectedAttention(),
        kvzip.KVzip(),
        kvzap.KVzap(),
    ],
)
