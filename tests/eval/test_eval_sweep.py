"""Sweep settings, RULER documents for a sweep, and scoring."""

import pytest

from pipeline.eval.scoring import score_prediction
from pipeline.eval.sweep import ruler_documents, sweep_settings
from pipeline.kv.config import CompressionConfig


def test_settings_have_one_full_reference_and_every_pair():
    settings = sweep_settings(["snapkv", "criticalkv-snapkv"], [0.2, 0.4, 1.0], CompressionConfig(window=16))
    pairs = [(s.method, s.cache_size) for s in settings]
    assert pairs == [
        ("none", 1.0),
        ("snapkv", 0.2),
        ("snapkv", 0.4),
        ("criticalkv-snapkv", 0.2),
        ("criticalkv-snapkv", 0.4),
    ]
    assert all(s.window == 16 for s in settings)
    with pytest.raises(ValueError, match="methods"):
        sweep_settings(["magic"], [0.2], CompressionConfig())
    with pytest.raises(ValueError, match="cache_sizes"):
        sweep_settings(["snapkv"], [0.0], CompressionConfig())


def test_ruler_documents_are_scorable():
    count = lambda text: len(text.split())  # noqa: E731
    docs = ruler_documents(["niah_single_1", "vt"], 600, 2, count, seed=1, max_new_tokens=20)
    assert len(docs) == 4 and {d["task"] for d in docs} == {"niah_single_1", "vt"}
    for doc in docs:
        assert doc["max_new_tokens"] <= 20
        refs = doc["references"][0]
        assert all(r in doc["context"] for r in refs)
        assert score_prediction(doc["metric"], " ".join(refs), refs) == 1.0
        assert score_prediction(doc["metric"], "nothing", refs) == 0.0
    assert score_prediction(None, "x", ["x"]) is None
    with pytest.raises(ValueError, match="tasks"):
        ruler_documents(["nope"], 600, 1, count)


def test_summary_documents_fit_and_score_against_the_full_cache():
    from pipeline.eval.scoring import score_answer
    from pipeline.eval.summaries import SUMMARY_TASK
    from pipeline.eval.sweep import sweep_documents

    count = lambda text: len(text.split())  # noqa: E731
    docs = sweep_documents(["niah_single_1", SUMMARY_TASK], 900, 3, count, seed=2, max_new_tokens=20, summary_tokens=90)
    summaries = [d for d in docs if d["task"] == SUMMARY_TASK]
    assert len(summaries) == 3 and len({d["doc_id"] for d in summaries}) == 3
    for doc in summaries:
        assert 800 <= count(doc["context"]) <= 900 and doc["context"].endswith((".", "?", "!", '"'))
        assert doc["max_new_tokens"] == 90 and doc["references"] is None
    assert all(d["max_new_tokens"] <= 20 for d in docs if d["task"] != SUMMARY_TASK)
    assert score_answer(SUMMARY_TASK, "the cat sat on the mat", None, "the cat sat on the mat") == 1.0
    assert 0 < score_answer(SUMMARY_TASK, "the cat sat", None, "the cat sat on the mat") < 1
    assert score_answer(SUMMARY_TASK, "x", None, None) is None  # not in a sweep with the full cache
    with pytest.raises(ValueError, match="essays reach"):
        sweep_documents([SUMMARY_TASK], 100000, 1, count)


def test_variants_sweep_other_knob_values_under_their_own_label():
    base = CompressionConfig(window=16)
    settings = sweep_settings(
        ["snapkv", "snapkv[window=8,pooling=avg,kernel=5]", "layer-kvzip[kvzip_plus=true]"], [0.2], base
    )
    assert [(s.label, s.cache_size) for s in settings] == [
        ("none", 1.0),
        ("snapkv", 0.2),
        ("snapkv[kernel=5,pooling=avg,window=8]", 0.2),
        ("layer-kvzip[kvzip_plus=true]", 0.2),
    ]
    plain, variant, plus = settings[1:]
    assert (plain.window, plain.kernel, plain.pooling, plain.variant) == (16, 7, "max", None)
    assert (variant.window, variant.kernel, variant.pooling, variant.method) == (8, 5, "avg", "snapkv")
    assert plus.kvzip_plus is True and plus.allocation == "layer"


@pytest.mark.parametrize(
    "entry, message",
    [
        ("snapkv[window=64", "not NAME or NAME"),
        ("snapkv[window]", "is not knob=value"),
        ("snapkv[]", "empty brackets"),
        ("snapkv[window=8,window=9]", "sets window twice"),
        ("snapkv[cache_size=0.5]", "cache_size cannot vary"),
        ("snapkv[scorer=knorm]", "scorer cannot vary"),
        ("snapkv[colour=red]", "colour cannot vary"),
        ("snapkv[kernel=4]", "kernel must be odd"),
        ("snapkv[window=many]", "window"),
        ("magic[window=8]", "unknown"),
    ],
)
def test_bad_variants_fail_naming_the_entry(entry, message):
    with pytest.raises(ValueError, match=message):
        sweep_settings([entry], [0.2], CompressionConfig())


def test_a_variant_equal_in_label_to_another_entry_is_refused():
    with pytest.raises(ValueError, match="swept twice"):
        sweep_settings(["snapkv[window=8]", "snapkv[window=08]"], [0.2], CompressionConfig())
