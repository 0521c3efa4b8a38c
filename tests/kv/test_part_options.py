"""Each part receives its own typed options (``Part.options_from``), never the whole config; the
config offers every knob once, on the model that declares it."""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel

from pipeline.kv.allocation import ALLOCATIONS
from pipeline.kv.allocation.common import SafeguardOptions
from pipeline.kv.compress import Compressor
from pipeline.kv.config import CompressionConfig, _part_options
from pipeline.kv.parts import declared_knobs
from pipeline.kv.scorers import SCORERS
from pipeline.kv.scorers.common import SinkOptions
from pipeline.kv.scorers.expected_attention import ExpectedAttentionOptions
from pipeline.kv.scorers.snapkv import SnapKVOptions
from pipeline.kv.selection import SELECTIONS
from pipeline.kv.selection.criticalkv import CriticalKVOptions

PARTS = [part for registry in (SCORERS, ALLOCATIONS, SELECTIONS) for part in registry.values()]
# a value other than the default for one knob of each model that declares knobs
CHANGED = {"sink_tokens": 7, "kernel": 5, "epsilon": 0.01, "alpha_safeguard": 0.4, "future_positions": 9}


@pytest.mark.parametrize("part", PARTS, ids=lambda p: f"{type(p).__mro__[1].__name__.lower()}-{p.name}")
def test_each_part_reads_its_own_typed_options_from_the_config(part):
    config = CompressionConfig(method="snapkv", cache_size=0.5, **CHANGED)
    options = part.options_from(config)
    if part.options is None:
        assert options is None
        return
    assert type(options) is part.options and not isinstance(options, CompressionConfig)
    assert set(type(options).model_fields) <= set(CompressionConfig.model_fields) - {"cache_size", "window"}
    for name in type(options).model_fields:
        assert getattr(options, name) == getattr(config, name), name


def test_shared_knobs_are_declared_once_on_a_common_model():
    assert declared_knobs(SinkOptions) == ["sink_tokens"]
    assert "sink_tokens" not in declared_knobs(ExpectedAttentionOptions)
    assert "sink_tokens" in ExpectedAttentionOptions.model_fields  # inherited: the part still reads it
    declared = [name for model in _part_options() for name in declared_knobs(model)]
    assert len(declared) == len(set(declared))
    assert all(issubclass(CompressionConfig, model) for model in _part_options())


def test_the_compressor_hands_each_part_only_its_options(monkeypatch):
    """A spy on each part's method: what arrives is the part's options model, with the config's values."""
    seen: dict[str, BaseModel | None] = {}
    for registry, name, method, at in (  # at: the options' position among the method's arguments
        (SCORERS, "snapkv", "score", 1),
        (ALLOCATIONS, "adakv", "head_budgets", 2),
        (SELECTIONS, "criticalkv", "select", 3),
    ):
        part = registry[name]
        original = getattr(part, method)

        def spy(*args, _original=original, _name=name, _at=at):
            seen[_name] = args[_at]
            return _original(*args)

        monkeypatch.setattr(part, method, spy)
    config = CompressionConfig(method="criticalkv-adakv-snapkv", cache_size=0.5, window=4, kernel=5, epsilon=0.01)
    compressor = Compressor(config)
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 2, 16, 8, generator=gen), torch.randn(2, 2, 16, 8, generator=gen)
    query = torch.randn(2, 4, 16, 8, generator=gen)
    pos = torch.arange(16).expand(2, 16).clone()
    pos[1, :3] = -1
    module = torch.nn.Module()
    module.o_proj = torch.nn.Linear(32, 32, bias=False)
    compressor.compress_observed(0, module, compressor.observe(query, pos), key, value, pos, 8**-0.5)
    # type(), not isinstance: the config itself derives from every options model
    assert type(seen["snapkv"]) is SnapKVOptions and seen["snapkv"].kernel == 5
    assert type(seen["adakv"]) is SafeguardOptions and seen["adakv"].alpha_safeguard == 0.2
    assert type(seen["criticalkv"]) is CriticalKVOptions and seen["criticalkv"].epsilon == 0.01
