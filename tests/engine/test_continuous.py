"""The decode loop (pipeline.engine.continuous): the jobs' continuous batch, the batch path and sweeps,
on tiny random models.

* answers equal each document answered alone (the batch path, one document per batch) for every
  method of every part family, with rows ending at different steps (different token limits, EOS),
  documents with several questions leaving and joining again, and waiting documents joining as
  others leave (a budget that holds only some of them);
* the batch's KV memory never exceeds the budget; a document larger than the budget decodes alone;
* a document whose prefill fails yields error rows and the others are answered;
* the batch path and sweeps decode in the same loop (rows leave the step they end) and give each
  document's answers and fidelity NLL alone; under a decode-time cap every question round starts
  from the compressed context.
"""

import pytest

from pipeline import hooks
from pipeline.engine import admission as admission_module
from pipeline.engine.admission import Admission
from pipeline.engine.config import GenerationConfig
from pipeline.engine.continuous import ContinuousBatch
from pipeline.engine.engine import Engine
from pipeline.engine.sequences import DocumentSource
from pipeline.engine.types import Request
from pipeline.kv.config import CompressionConfig
from pipeline.kv.storage.store import BLOCK, segment_bytes
from tests.faults import Faults
from tests.methods import one_method_per_part
from tests.tiny import tiny_kvzap_file, tiny_loaded

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
METHODS = ["none", *one_method_per_part(), "kvzip", "layer-kvzip", "criticalkv-shares-kvzap"]


def _requests():
    return [
        Request("a", TEXT * 4, ["What is packed?", "Who jumps?"], max_new_tokens=9),
        Request("b", TEXT[:50], ["Who is lazy?"], answer_prefix="The", max_new_tokens=3),
        Request("c", TEXT * 2 + "Sphinx of black quartz.", ["Judge my vow?", "Why?", "How?"], max_new_tokens=6),
        Request("d", TEXT * 3, ["Where?"], max_new_tokens=12),
        Request("e", TEXT, ["When?"], max_new_tokens=1),
    ]


def _engine(
    method, kv_memory=None, batch_size=1, tmp=None, arch="llama", continuous=True, decode_between_prefills=0.0, **kw
):
    """The engine under test; ``continuous=False`` (the batch path, one document per call) makes the
    independent reference of "each document alone"."""
    loaded = tiny_loaded(arch)
    extra = {}
    if CompressionConfig(method=method).needs_kvzap_model:
        extra["kvzap_model"] = tiny_kvzap_file(loaded, str(tmp))
    if CompressionConfig(method=method).needs_head_priors:
        extra["head_priors"] = _priors(tmp)
    comp = CompressionConfig(method=method, cache_size=0.4, window=4, kernel=3, **extra, **kw)
    generation = GenerationConfig(
        max_new_tokens=10,
        batch_size=batch_size,
        kv_memory=kv_memory,
        continuous=continuous,
        decode_between_prefills=decode_between_prefills,
    )
    return Engine(loaded, comp, generation)


def _priors(tmp):
    path = tmp / "heads.json"
    path.write_text('{"scores": [[0.9, 0.1], [0.2, 0.8]]}')
    return path


def _fields(answers):
    return [
        (a.doc_id, a.question_id, a.prediction, a.generated_tokens, a.question_tokens, a.kv_entries_kept, a.error)
        for a in answers
    ]


def _budget_for(engine, requests, rows_at_once):
    """MiB that hold about ``rows_at_once`` of these documents' footprints."""
    source = DocumentSource(engine.runner, engine.compressor)
    sizes = sorted(source.estimate(0, row) for r in requests for row in engine._rows_for(r))
    return sum(sizes[-rows_at_once:]) / 2**20


@pytest.mark.parametrize("method", METHODS)
def test_continuous_answers_equal_each_document_alone(method, tmp_path):
    requests = _requests()
    alone = _engine(method, tmp=tmp_path, continuous=False).generate(requests)
    engine = _engine(method, tmp=tmp_path, batch_size=5)
    engine.generation.kv_memory = _budget_for(engine, requests, 3)
    together = engine.generate(requests)
    assert _fields(together) == _fields(alone)
    assert all(a.error is None for a in together)


def test_chunked_prefill_and_other_architectures_join_the_batch(tmp_path):
    requests = _requests()
    for arch, kw in (("qwen3", {"prefill_chunk": 16}), ("mistral", {}), ("qwen2", {"query_aware": True})):
        alone = _engine("criticalkv-shares-kvzap", tmp=tmp_path, arch=arch, continuous=False, **kw).generate(requests)
        engine = _engine("criticalkv-shares-kvzap", tmp=tmp_path, arch=arch, batch_size=5, **kw)
        engine.generation.kv_memory = _budget_for(engine, requests, 2)
        assert _fields(engine.generate(requests)) == _fields(alone), arch


@pytest.mark.parametrize("rows_at_once", [1, 2, 4])
def test_the_batch_stays_within_its_memory_budget(rows_at_once, tmp_path):
    engine = _engine("snapkv", tmp=tmp_path, batch_size=5)
    requests = _requests()
    rows = [row for r in requests for row in engine._rows_for(r)]
    budget = int(_budget_for(engine, requests, rows_at_once) * 2**20)
    batch = ContinuousBatch(engine.runner, engine.compressor, budget)
    results = batch.run(rows)
    assert all(not isinstance(r, Exception) for r in results)
    assert 0 < batch.largest_bytes <= budget
    assert 1 <= batch.largest_batch < len(rows)  # the budget held some rows, never all
    if rows_at_once > 1:
        assert batch.largest_batch > 1


def test_the_default_budget_is_a_share_of_the_memory_available(tmp_path, monkeypatch):
    """Without --kv-memory the batch holds 25 % of the RAM available (CPU), decided once."""
    import pipeline.engine.memory as memory

    available = [8 * 2**30]
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: type("VM", (), {"available": available[0]})())
    engine = _engine("snapkv", tmp=tmp_path, batch_size=5)
    assert engine.continuous and engine.kv_memory_bytes == 2 * 2**30
    available[0] = 2**30
    assert engine.kv_memory_bytes == 2 * 2**30  # decided once, not per call
    engine.generation.kv_memory = 3.5
    assert engine.kv_memory_bytes == int(3.5 * 2**20)  # --kv-memory wins
    assert not _engine("snapkv", tmp=tmp_path, continuous=False).continuous


def test_a_document_larger_than_the_budget_decodes_alone(tmp_path, caplog):
    engine = _engine("none", tmp=tmp_path, batch_size=5)
    rows = [row for r in _requests() for row in engine._rows_for(r)]
    batch = ContinuousBatch(engine.runner, engine.compressor, 1)
    results = batch.run(rows)
    assert all(not isinstance(r, Exception) for r in results)
    assert batch.largest_batch == 1
    assert "more than kv_memory" in caplog.text


@pytest.fixture
def faults():
    yield lambda **directives: hooks.install(Faults(directives))
    hooks.install(None)


def test_a_failing_document_yields_error_rows_and_the_others_are_answered(faults, tmp_path):
    faults(oom=["c"])  # its prefill raises, in the batch and when retried alone
    requests = _requests()
    engine = _engine("snapkv", tmp=tmp_path, batch_size=5)
    engine.generation.kv_memory = _budget_for(engine, requests, 3)
    answers = engine.generate(requests)
    assert len(answers) == 8
    errors = {a.doc_id for a in answers if a.error is not None}
    assert errors == {"c"}
    assert all("OutOfMemoryError" in a.error for a in answers if a.doc_id == "c")
    alone = _engine("snapkv", tmp=tmp_path, continuous=False).generate([r for r in requests if r.doc_id != "c"])
    assert _fields([a for a in answers if a.doc_id != "c"]) == _fields(alone)


@pytest.fixture
def step_sizes(monkeypatch):
    """The rows of every decode step of the decode loop (pipeline.engine.continuous)."""
    sizes, original = [], ContinuousBatch._step

    def spy(self, cache, active):
        sizes.append(len(active))
        return original(self, cache, active)

    monkeypatch.setattr(ContinuousBatch, "_step", spy)
    return sizes


@pytest.mark.parametrize("method", ["none", "snapkv", "criticalkv-layer-knorm", "adakv-kvzip"])
def test_batch_path_rows_leave_the_step_their_answer_ends(method, step_sizes, tmp_path):
    """The batch path (documents prefilled together) decodes in the decode loop: rows leave as they
    end (the batch shrinks), and answers equal each document alone."""
    requests = _requests()
    together = _engine(method, tmp=tmp_path, batch_size=5, continuous=False).generate(requests)
    assert max(step_sizes) > 1 and len(set(step_sizes)) > 1
    assert _fields(together) == _fields(_engine(method, tmp=tmp_path, continuous=False).generate(requests))


@pytest.mark.parametrize("method", ["snapkv", "criticalkv-adakv-snapkv"])
def test_decode_capped_rows_answer_each_question_from_their_compressed_context(method, step_sizes, tmp_path):
    """Under a decode-time cap (eviction reorders a row's entries) rows of the decode loop leave and
    join with their statistics, and every question round starts from the compressed context: each
    answer equals that question asked alone in a request of its own."""
    requests = _requests()
    capped = {"max_cache_tokens": 12}
    together = _engine(method, tmp=tmp_path, batch_size=5, continuous=False, **capped).generate(requests)
    assert max(step_sizes) > 1
    single = [
        Request(r.doc_id, r.context, [q], answer_prefix=r.answer_prefix, max_new_tokens=r.max_new_tokens)
        for r in requests
        for q in r.questions
    ]
    alone = _engine(method, tmp=tmp_path, continuous=False, **capped).generate(single)
    assert [f[:1] + f[2:] for f in _fields(together)] == [f[:1] + f[2:] for f in _fields(alone)]
    assert any(a.question_id != "0" for a in together)  # several questions per document were asked
    admitted = _engine(method, tmp=tmp_path, batch_size=5, **capped)  # documents admitted one by one
    admitted.generation.kv_memory = _budget_for(admitted, requests, 1)
    assert _fields(admitted.generate(requests)) == _fields(together)
    assert 1 < admitted.last_continuous.largest_batch < len(requests)  # the budget held some back
    assert 0 < admitted.last_continuous.largest_bytes <= admitted.kv_memory_bytes


def test_sweep_rows_leave_and_fidelity_is_unchanged(step_sizes, tmp_path):
    requests = _requests()
    settings = [
        CompressionConfig(method=m, cache_size=c, window=4, kernel=3)
        for m, c in [("none", 1.0), ("snapkv", 0.3), ("criticalkv-layer-knorm", 0.3), ("kvzip", 0.4)]
    ]

    def sweep(batch_size, per_decode):
        generation = GenerationConfig(max_new_tokens=10, batch_size=batch_size, settings_per_decode=per_decode)
        engine = Engine(tiny_loaded("llama"), settings[0], generation)
        return [[(*f, a.answer_nll) for f, a in zip(_fields(s), s)] for s in engine.generate_sweep(requests, settings)]

    together = sweep(5, 4)
    assert max(step_sizes) > 5  # rows of several settings decoded together
    alone = sweep(1, 1)
    for got, expected in zip(together, alone):
        assert [g[:-1] for g in got] == [e[:-1] for e in expected]
        assert [g[-1] for g in got] == pytest.approx([e[-1] for e in expected], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("continuous", [True, False])
def test_each_document_is_handed_on_once_as_soon_as_it_is_answered(continuous, faults, step_sizes, tmp_path):
    """generate(on_document=...): every request exactly once, with the answers generate returns for it;
    in the continuous batch in the order documents finish (the short ones first, while the long ones
    still decode), a failing document too (its error rows, after its retry alone)."""
    faults(oom=["c"])
    requests = _requests()
    engine = _engine("snapkv", tmp=tmp_path, batch_size=5, continuous=continuous)
    engine.generation.kv_memory = _budget_for(engine, requests, 5)
    heard = []
    answers = engine.generate(requests, on_document=lambda i, got: heard.append((i, got, len(step_sizes))))
    assert sorted(i for i, _, _ in heard) == list(range(len(requests)))
    by_doc = {r.doc_id: [a for a in answers if a.doc_id == r.doc_id] for r in requests}
    for i, got, _ in heard:
        assert _fields(got) == _fields(by_doc[requests[i].doc_id])
    order = [requests[i].doc_id for i, _, _ in heard]
    if continuous:
        assert set(order[:2]) == {"b", "e"}  # the 3- and 1-token answers before the 12- and 2x9-token ones
        steps = {requests[i].doc_id: at for i, _, at in heard}
        assert steps["b"] < steps["d"] and steps["e"] < steps["a"]  # handed on while those still decoded
        assert order[-1] == "c"  # failed in the batch: answered (as errors) by its retry alone, at the end
    else:
        assert order == ["a", "b", "c", "d", "e"]  # prefilled together: all at the call's end, in input order
    assert all(a.error for a in by_doc["c"]) and all(
        a.error is None for d, got in by_doc.items() if d != "c" for a in got
    )


@pytest.mark.parametrize("knobs", [{}, {"max_cache_tokens": 30}])
def test_a_documents_estimate_bounds_its_footprint_by_the_stores_own_rule(knobs, tmp_path):
    """Admission estimates a document before its prefill with the rule the store accounts with
    (``segment_bytes``): never below the bytes its cache holds once its question and answer have room,
    and above them by at most the rounding of each segment to whole blocks."""
    engine = _engine("snapkv", tmp=tmp_path, **knobs)
    source, shape = DocumentSource(engine.runner, engine.compressor), engine.shape
    one_question = [r for r in _requests() if len(r.questions) == 1]
    for request in one_question:
        row = engine._rows_for(request)[0]
        opened = source.open(0, row)
        opened.cache.reserve(len(row.prompt.question_ids[0]) + engine.runner.max_new_tokens_for(request))
        held = int(opened.cache.bytes_per_row()[0])
        assert (opened.cache.store[0].value_norm is not None) is bool(knobs)  # the cap's statistics are held
        per_slot = segment_bytes(1, shape.head_dim, shape.itemsize, bool(knobs)) - segment_bytes(0, 1, 1, False)
        rounding = shape.num_layers * shape.num_kv_heads * (BLOCK - 1) * per_slot
        assert held <= source.estimate(0, row) <= held + rounding, request.doc_id


@pytest.mark.parametrize("method", ["snapkv", "criticalkv-shares-kvzap"])
@pytest.mark.parametrize("pause", [0.5, 100.0])
def test_decode_between_prefills_leaves_the_answers_unchanged(method, pause, tmp_path):
    requests = _requests()
    alone = _engine(method, tmp=tmp_path, continuous=False).generate(requests)
    engine = _engine(method, tmp=tmp_path, batch_size=5, decode_between_prefills=pause)
    engine.generation.kv_memory = _budget_for(engine, requests, 5)
    assert _fields(engine.generate(requests)) == _fields(alone)


@pytest.mark.parametrize("pause", [0.0, 100.0])
def test_decode_between_prefills_paces_the_prefills(pause, step_sizes, tmp_path):
    """0: every document that fits is prefilled before the first step (the four that need a step decode
    together);
    a pause far longer than a tiny answer takes: each document is answered before the next is prefilled
    (every step decodes one row, documents handed on in input order)."""
    requests = _requests()
    engine = _engine("snapkv", tmp=tmp_path, batch_size=5, decode_between_prefills=pause)
    engine.generation.kv_memory = _budget_for(engine, requests, 5)
    heard = []
    engine.generate(requests, on_document=lambda i, got: heard.append(requests[i].doc_id))
    if pause:
        assert set(step_sizes) == {1} and heard == ["a", "b", "c", "d", "e"]
    else:
        assert step_sizes[0] == 4 and heard[:2] != ["a", "b"]  # "e" (1 token) ends at its question


def test_the_next_prefill_waits_for_its_share_of_decode_time(monkeypatch, tmp_path):
    """The rule on a clock the test sets: the next document waits while the decoding rows have run for
    less than ``decode_between_prefills`` times the last prefill's seconds; never when none decode."""
    clock = [100.0]
    monkeypatch.setattr(admission_module, "now", lambda device: clock[0])
    engine = _engine("snapkv", tmp=tmp_path, decode_between_prefills=0.5)
    gate = Admission(engine.runner, DocumentSource(engine.runner, engine.compressor), engine.compressor, 1e9, False, {})
    gate.last_open = (2.0, 100.0)  # a 2 s prefill that ended now
    assert gate.paced(decoding=True) and not gate.paced(decoding=False)
    clock[0] = 100.9
    assert gate.paced(decoding=True)
    clock[0] = 101.0
    assert not gate.paced(decoding=True)
    engine.runner.generation.decode_between_prefills = 0.0
    gate = Admission(engine.runner, DocumentSource(engine.runner, engine.compressor), engine.compressor, 1e9, False, {})
    gate.last_open = (2.0, 100.0)
    clock[0] = 100.0
    assert not gate.paced(decoding=True)
