"""Every prefill rule, as one matrix (pipeline.kv.prefill.rules): every method name x cache size x
chunked prefill x decode-time cap x layer slices x context length is either refused when the config is
built, naming the fields, or planned as written here from the method's name alone (an independent
statement of the rules: which scorers need the whole context, which allocation decides across layers,
which scorer observes every query at once)."""

import itertools

import pytest

from pipeline.kv.config import CompressionConfig
from pipeline.kv.prefill.rules import PrefillPlan, plan_prefill, shares_capture
from tests.methods import ALL_METHODS

PASSES_SCORERS = {"kvzip"}  # score from reconstruction passes over the whole context
WHOLE_QUERY_SCORERS = {"expected_attention"}  # observe every query of a layer at once
CROSS_LAYER_ALLOCATIONS = {"layer"}  # one budget across layers, decided after every layer's scores


def _words(method: str) -> tuple[str, set[str]]:
    *prefix, scorer = method.split("-")
    return scorer, set(prefix)


def _expected(method: str, size: float, chunk, cap, layer_slice: int, length: int) -> PrefillPlan | str:
    """The plan, or the words the refusal must contain."""
    scorer, prefix = _words(method)
    compresses = method != "none" and size < 1.0
    passes = compresses and scorer in PASSES_SCORERS
    cross = compresses and bool(prefix & CROSS_LAYER_ALLOCATIONS)
    if compresses and chunk is not None and passes:
        return "prefill_chunk"
    if compresses and chunk is not None and cap is not None:
        return "max_cache_tokens"
    if not compresses:
        layers = "at-once"
    elif passes:
        layers = "after-passes"
    elif cross:
        layers = "deferred" if cap is not None else "streamed"  # every scorer here scores in its layer
    else:
        layers = "at-once"
    if compresses and chunk is not None:
        return PrefillPlan("chunks", layers, chunk)
    sliceable = cap is None and not (compresses and scorer in WHOLE_QUERY_SCORERS)
    if sliceable and 0 < layer_slice < length:
        return PrefillPlan("layer-by-layer", layers, layer_slice)
    return PrefillPlan("one-pass", layers)


CASES = list(itertools.product(ALL_METHODS, (0.3, 1.0), (None, 8), (None, 12)))


@pytest.mark.parametrize("method, size, chunk, cap", CASES)
def test_every_combination_is_planned_or_refused_as_the_rules_say(method, size, chunk, cap):
    knobs = {"cache_size": size, "window": 4, "prefill_chunk": chunk, "max_cache_tokens": cap}
    for layer_slice, length in ((0, 40), (8, 40), (8, 8), (64, 40)):
        want = _expected(method, size, chunk, cap, layer_slice, length)
        if isinstance(want, str):
            with pytest.raises(ValueError, match=want):
                CompressionConfig(method=method, **knobs)
            return
        config = CompressionConfig(method=method, **knobs)
        assert plan_prefill(config, layer_slice, length) == want, (layer_slice, length)
        assert shares_capture(config) is (want.forward != "chunks")


def test_the_matrix_covers_every_plan():
    """The expectations are not vacuous: every forward and every layer timing occurs, and refusals too."""
    seen = {
        _expected(m, s, c, cap, sl, n)
        for m, s, c, cap in CASES
        for sl, n in ((0, 40), (8, 40))
    }  # fmt: skip
    plans = [p for p in seen if isinstance(p, PrefillPlan)]
    assert {p.forward for p in plans} == {"one-pass", "layer-by-layer", "chunks"}
    assert {p.layers for p in plans} == {"at-once", "streamed", "deferred", "after-passes"}
    assert {"prefill_chunk", "max_cache_tokens"} <= {p for p in seen if isinstance(p, str)}
