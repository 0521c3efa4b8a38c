"""Engine behaviour on tiny random models: equals plain transformers generation, batching and
multi-question answering do not change results, prompts and errors are handled."""

import json
import tempfile

import pytest
import torch

from pipeline import hooks
from pipeline.engine.config import GenerationConfig, ModelConfig
from pipeline.engine.decoding import answer_text
from pipeline.engine.engine import Engine
from pipeline.engine.loading import ModelNotFoundError, load_model
from pipeline.engine.prompts import ContextTooLongError, PromptBuilder
from pipeline.engine.types import Request
from pipeline.kv.config import CompressionConfig
from tests.faults import Faults
from tests.methods import ALL_METHODS
from tests.tiny import DEVICE, tiny_kvzap_file, tiny_loaded, tiny_model, tiny_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "


KVZAP_DIR = tempfile.mkdtemp(prefix="kvzap-tiny-")


def _engine(arch="llama", method="none", cache_size=1.0, batch_size=1, max_new=10, priors=None, **kw):
    extra = {"head_priors": priors} if priors else {}
    loaded = tiny_loaded(arch)
    if CompressionConfig(method=method).needs_kvzap_model and "kvzap_model" not in kw:
        extra["kvzap_model"] = tiny_kvzap_file(loaded, KVZAP_DIR)
    comp = CompressionConfig(method=method, cache_size=cache_size, window=4, kernel=3, **extra, **kw)
    return Engine(loaded, comp, GenerationConfig(max_new_tokens=max_new, batch_size=batch_size))


@pytest.fixture(scope="module")
def priors(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "heads.json"
    path.write_text(json.dumps({"scores": [[0.9, 0.1], [0.2, 0.8]]}))
    return path


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_engine_equals_plain_generate(arch):
    engine = _engine(arch, max_new=12)
    request = Request("d", TEXT * 3, ["Who jumps?"], answer_prefix="It is")
    answer = engine.generate([request])[0]
    prompt = engine.prompts.encode(request.context, request.questions, request.answer_prefix)
    ids = torch.tensor([prompt.context_ids + prompt.question_ids[0]], device=DEVICE)
    reference = tiny_model(arch)  # same seed, default sdpa attention, transformers' own cache
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    new = out[0, ids.shape[1] :].tolist()
    cut = 257 not in new  # ended by the token limit, not EOS
    if not cut:
        new = new[: new.index(257)]
    # a cut answer leaves out a trailing incomplete UTF-8 character (random models emit any byte)
    assert (answer.prediction, answer.finish_reason) == answer_text(engine.tokenizer, new, cut=cut)
    assert answer.decode_batch == (1.0 if answer.generated_tokens > 1 else None)  # one row: alone at every step
    assert answer.generated_tokens == len(new) + (0 if cut else 1)
    assert answer.error is None
    assert answer.context_tokens == len(prompt.context_ids)
    assert answer.question_tokens == len(prompt.question_ids[0])
    assert 1 <= answer.generated_tokens <= 12
    assert answer.kv_entries_full == answer.kv_entries_kept == len(prompt.context_ids) * 2 * engine.shape.num_kv_heads


@pytest.mark.parametrize("method", ALL_METHODS)
def test_batch_equals_one_by_one(method, priors):
    requests = [
        Request("a", TEXT * 4, ["What is packed?"]),
        Request("b", TEXT[:50], ["Who is lazy?"], answer_prefix="The"),
        Request("c", TEXT * 2 + "Sphinx of black quartz.", ["Judge my vow?"]),
    ]
    kw = dict(method=method, cache_size=0.4, priors=priors if "headkv" in method else None)
    batched = _engine(batch_size=3, **kw).generate(requests)
    alone = _engine(batch_size=1, **kw).generate(requests)
    assert [a.prediction for a in batched] == [a.prediction for a in alone]
    assert [a.kv_entries_kept for a in batched] == [a.kv_entries_kept for a in alone]
    assert all(a.error is None for a in batched)


@pytest.mark.parametrize("method", ["none", "criticalkv-adakv-snapkv"])
def test_answers_report_reserved_and_used_cache_bytes(method):
    engine = _engine(method=method, cache_size=0.5, max_new=6)
    (answer,) = engine.generate([Request("d", TEXT * 3, ["Who jumps?"])])
    shape = engine.shape
    per_entry = 2 * shape.head_dim * shape.itemsize + 4  # K and V rows + the int32 original position
    appended = answer.question_tokens + answer.generated_tokens - 1  # the last token is never fed back
    grown = appended * shape.num_layers * shape.num_kv_heads * per_entry
    assert answer.kv_bytes_used == answer.kv_bytes_kept + grown
    assert answer.kv_bytes_reserved >= answer.kv_bytes_used


@pytest.mark.parametrize("method", ["none", "criticalkv-adakv-snapkv"])
def test_many_questions_equal_separate_runs(method):
    questions = ["Who jumps?", "What is in the box?", "Is the dog lazy?"]
    engine = _engine(method=method, cache_size=0.5, batch_size=2)
    together = engine.generate([Request("d", TEXT * 3, questions), Request("e", TEXT, ["Why?"])])
    separate = [engine.generate([Request("d", TEXT * 3, [q])])[0] for q in questions]
    assert [a.prediction for a in together[:3]] == [a.prediction for a in separate]
    assert [a.question_id for a in together] == ["0", "1", "2", "0"]
    assert together[3].doc_id == "e"


def test_query_aware_rows_per_question():
    engine = _engine(method="criticalkv-snapkv", cache_size=0.5, query_aware=True)
    answers = engine.generate([Request("d", TEXT * 3, ["Who jumps?", "Why?"])])
    assert [a.question_id for a in answers] == ["0", "1"]
    assert all(a.question_tokens == 0 or a.error is None for a in answers)
    assert answers[0].context_tokens > answers[1].context_tokens  # question inside the prefilled chunk


def test_chat_template_split_and_answer_prefix():
    tok = tiny_tokenizer(chat=True)
    builder = PromptBuilder(tok)
    enc = builder.encode("CONTEXT", ["QUESTION?"], "Answer:")
    text = tok.decode(enc.context_ids) + "|" + tok.decode(enc.question_ids[0])
    assert text == "<|bos|><|user|>CONTEXT\n\n|QUESTION?<|eos|><|assistant|>Answer:"
    plain = PromptBuilder(tiny_tokenizer(chat=False)).encode("CONTEXT", ["Q?"], "A:")
    assert tok.decode(plain.context_ids) == "CONTEXT\n\n"  # this tokenizer adds no BOS itself
    assert tok.decode(plain.question_ids[0]) == "Q?\nA:"


def test_truncation_policies():
    builder = PromptBuilder(tiny_tokenizer(chat=False))
    body = "".join(chr(ord("a") + i % 26) for i in range(200))
    middle = builder.encode(body, ["q"], max_total_tokens=100, reserve_tokens=10, truncate="middle")
    assert middle.truncated_tokens > 0
    text = builder.tokenizer.decode(middle.context_ids[:-2])
    assert text.startswith(body[:20]) and text.endswith(body[-20:])
    left = builder.encode(body, ["q"], max_total_tokens=100, reserve_tokens=10, truncate="left")
    assert builder.tokenizer.decode(left.context_ids[:-2]) == body[-len(left.context_ids) + 2 :]
    with pytest.raises(ContextTooLongError, match="fit the model window"):
        builder.encode(body, ["q"], max_total_tokens=100, reserve_tokens=10, truncate="error")


def test_bad_requests_become_error_rows_and_neighbours_survive():
    engine = _engine(batch_size=3)
    answers = engine.generate(
        [
            Request("ok", TEXT, ["Who?"]),
            Request("empty", "   ", ["Who?"]),
            Request("noq", TEXT, [""]),
            Request("ok2", TEXT, ["Why?"]),
        ]
    )
    by_doc = {a.doc_id: a for a in answers}
    assert by_doc["ok"].error is None and by_doc["ok2"].error is None
    assert "context is empty" in by_doc["empty"].error
    assert "question" in by_doc["noq"].error


def test_model_loading_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        load_model(ModelConfig(name=str(tmp_path / "missing.gguf")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(ModelConfig(name=str(tmp_path / "empty")))
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text("{}")
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(ModelConfig(name=str(tmp_path / "pickled")))
    with pytest.raises(ModelNotFoundError, match="neither a directory"):
        load_model(ModelConfig(name=str(tmp_path / "nothing-here")))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="unknown scorer 'magic'"):
        CompressionConfig(method="magic")
    with pytest.raises(ValueError, match="cache_size"):
        CompressionConfig(cache_size=1.5)
    with pytest.raises(ValueError, match="smaller than the observation window"):
        CompressionConfig(method="snapkv", budget=8, window=32)
    with pytest.raises(ValueError, match="head_priors: .*none ships for model 'tiny-llama'"):
        _engine(method="headkv-snapkv", cache_size=0.5)


def test_kept_positions_readable_through_engine():
    engine = _engine(method="criticalkv-adakv-snapkv", cache_size=0.3)
    request = Request("d", TEXT * 3, ["Who?"])
    cache = engine.compress_context(request)
    n = len(engine.prompts.encode(request.context, request.questions).context_ids)
    heads = engine.shape.num_kv_heads
    kept = [cache.kept_positions(layer, 0, h) for layer in range(2) for h in range(heads)]
    assert sum(len(k) for k in kept) == int(cache.context_entries[0])
    assert sum(len(k) for k in kept) == pytest.approx(0.3 * n * 2 * heads, abs=2 * heads)
    for positions in kept:
        assert positions.min() >= 0 and positions.max() < n
        assert list(range(n - 4, n)) == positions[-4:].tolist()  # the window is always kept


def test_contexts_prefilled_together_keep_what_each_keeps_alone():
    """compress_contexts: a left-padded batch of two documents of different lengths, row b as alone."""
    engine = _engine(method="criticalkv-adakv-snapkv", cache_size=0.3)
    requests = [Request("long", TEXT * 3, ["Who?"]), Request("short", TEXT * 2, ["Who?"])]
    together = engine.compress_contexts(requests)
    for row, request in enumerate(requests):
        alone = engine.compress_context(request)
        assert int(together.context_entries[row]) == int(alone.context_entries[0])
        for layer in range(len(alone.store)):
            for head in range(engine.shape.num_kv_heads):
                kept = together.kept_positions(layer, row, head)
                assert torch.equal(kept, alone.kept_positions(layer, 0, head))


@pytest.fixture
def faults():
    """``faults(**directives)`` installs the test hook in this process; removed after the test."""
    yield lambda **directives: hooks.install(Faults(directives))
    hooks.install(None)


def test_simulated_oom_is_recorded_and_neighbours_survive(faults):
    faults(oom=["bad"])
    requests = [Request("a", TEXT, ["Who?"]), Request("bad", TEXT * 2, ["Who?", "Why?"]), Request("c", TEXT, ["Why?"])]
    answers = _engine(method="snapkv", cache_size=0.5, batch_size=3).generate(requests)
    by_doc = {(a.doc_id, a.question_id): a for a in answers}
    assert len(answers) == 4
    assert by_doc[("a", "0")].error is None and by_doc[("c", "0")].error is None
    assert "OutOfMemoryError" in by_doc[("bad", "0")].error and "OutOfMemoryError" in by_doc[("bad", "1")].error


def test_oom_retry_with_smaller_cache(faults):
    faults(oom=["bad"])
    comp = CompressionConfig(method="snapkv", cache_size=0.5, window=4, kernel=3)
    engine = Engine(tiny_loaded(), comp, GenerationConfig(max_new_tokens=4), oom_retry_cache_size=0.2)
    # the simulated OOM fires on every prefill of "bad": the retry fails too and the error is kept
    answer = engine.generate([Request("bad", TEXT, ["Who?"])])[0]
    assert "OutOfMemoryError" in answer.error
    # a document that fits at 0.2: retried, answered, and the row says which cache size it used
    faults(oom=["bad"], oom_above=0.3)
    engine = Engine(tiny_loaded(), comp, GenerationConfig(max_new_tokens=4), oom_retry_cache_size=0.2)
    answers = engine.generate([Request("bad", TEXT, ["Who?"]), Request("good", TEXT, ["Who?"])])
    assert answers[0].error is None and answers[0].setting.cache_size == 0.2
    assert answers[0].as_row()["cache_size"] == 0.2 and "cache_size" not in answers[1].as_row()
    assert answers[0].kv_entries_kept < answers[1].kv_entries_kept and answers[1].setting is None


def test_hook_rejects_unknown_events_and_directives():
    with pytest.raises(ValueError, match="unknown hook event"):
        hooks.fire("engine.explode")
    with pytest.raises(ValueError, match="unknown fault directive"):
        Faults({"explode": 1})


@pytest.mark.parametrize("query_aware", [False, True])
def test_sweep_from_one_prefill_equals_separate_runs(query_aware, priors):
    settings = [
        CompressionConfig(
            method=m,
            cache_size=0.3 + 0.1 * (i % 3),
            window=4,
            kernel=3,
            query_aware=query_aware,
            head_priors=priors,
            kvzap_model=tiny_kvzap_file(tiny_loaded(), KVZAP_DIR),
        )
        for i, m in enumerate(ALL_METHODS)
    ]
    requests = [
        Request("a", TEXT * 3, ["Who jumps?", "Why?"]),
        Request("b", TEXT, ["What?"]),
        Request("bad", "", ["?"]),
    ]
    engine = Engine(tiny_loaded(), settings[0], GenerationConfig(max_new_tokens=8, batch_size=2))
    swept = engine.generate_sweep(requests, settings)
    assert len(swept) == len(settings)
    for setting, answers in zip(settings, swept):
        alone = Engine(tiny_loaded(), setting, GenerationConfig(max_new_tokens=8, batch_size=2)).generate(requests)
        assert [a.prediction for a in answers] == [a.prediction for a in alone]
        assert [a.kv_entries_kept for a in answers] == [a.kv_entries_kept for a in alone]
        assert answers[-1].error and "context is empty" in answers[-1].error


def test_sweep_decode_groups_and_one_row_caches():
    """Settings decoded side by side answer as each decoded alone; full-cache and decode-capped
    settings are decoded alone; a batch's cache split into one-row caches (how its rows join the
    decode loop) holds each row's kept entries, as each document compressed alone."""
    from pipeline.engine.sequences import PrebuiltSource
    from pipeline.engine.sweep import decode_groups

    settings = [
        CompressionConfig(method=m, cache_size=s, window=4, kernel=3)
        for m in ("criticalkv-adakv-snapkv", "none", "snapkv", "layer-knorm", "streamingllm")
        for s in (0.3, 0.6)
    ]
    settings.append(CompressionConfig(method="snapkv", cache_size=0.5, window=4, kernel=3, max_cache_tokens=12))
    requests = [Request("a", TEXT * 3, ["Who jumps?", "Why?"]), Request("b", TEXT, ["What?"])]
    answers = {}
    for group in (1, 4):
        engine = Engine(tiny_loaded(), settings[0], GenerationConfig(max_new_tokens=8, settings_per_decode=group))
        compressors = [engine.make_compressor(c) for c in settings]
        groups = decode_groups(compressors, group)
        assert groups[:2] == [[2], [3]] and groups[2] == [10]  # the two full caches, then the capped one
        assert sorted(i for g in groups for i in g) == list(range(len(settings))) and max(map(len, groups)) == group
        answers[group] = [
            [(a.prediction, a.kv_entries_kept) for a in s] for s in engine.generate_sweep(requests, settings)
        ]
    assert answers[1] == answers[4]

    engine = _engine(method="criticalkv-adakv-snapkv", cache_size=0.4)
    rows = [row for request in requests for row in engine._rows_for(request)[:1]]
    together = engine.new_cache(engine.compressor)
    ctx_len, logits = engine.prefill(rows, together)
    costs = [(0, 0, 0.0, 0.0)] * len(rows)
    for request, row, opened in zip(requests, rows, PrebuiltSource.split(together, ctx_len, logits, costs)):
        alone = engine.compress_context(request)
        assert opened.cache.store[0].num_rows == 1 and opened.ctx_len == len(row.prompt.context_ids)
        for layer in range(len(alone.store)):
            for head in range(alone.store[0].num_heads):
                assert torch.equal(opened.cache.kept_positions(layer, 0, head), alone.kept_positions(layer, 0, head))
        assert opened.cache.context_entries.tolist() == alone.context_entries.tolist()
    assert all(layer is None for layer in together.store)  # consumed as split: never held twice

    single = engine.new_cache(engine.compressor)
    ctx_len, logits = engine.prefill(rows[:1], single)
    layers = list(single.store)
    (opened,) = PrebuiltSource.split(single, ctx_len, logits, costs[:1])
    assert all(a is b for a, b in zip(opened.cache.store, layers))  # one row: taken over, not copied


@pytest.mark.parametrize("method", ["kvzap", "criticalkv-shares-kvzap", "layer-knorm", "adakv-snapkv"])
def test_chunked_prefill_batches_like_one_by_one_and_one_chunk_is_one_pass(method):
    requests = [
        Request("a", TEXT * 4, ["What is packed?"]),
        Request("b", TEXT[:50], ["Who is lazy?"], answer_prefix="The"),
        Request("c", TEXT * 2 + "Sphinx of black quartz.", ["Judge my vow?", "Why?"]),
    ]
    runs = {}
    for label, batch, chunk in (("batched", 3, 64), ("alone", 1, 64), ("one-chunk", 3, 4096), ("one-pass", 3, None)):
        answers = _engine(method=method, cache_size=0.4, batch_size=batch, prefill_chunk=chunk).generate(requests)
        assert all(a.error is None for a in answers)
        runs[label] = [(a.prediction, a.kv_entries_kept) for a in answers]
    assert runs["batched"] == runs["alone"]
    assert runs["one-chunk"] == runs["one-pass"]
    assert runs["batched"] != runs["one-pass"]  # 64-token chunks really evicted before the context ended


def test_sweep_decodes_a_chunked_setting_from_its_own_prefill():
    kvzap = tiny_kvzap_file(tiny_loaded(), KVZAP_DIR)
    settings = [
        CompressionConfig(method=m, cache_size=0.4, window=4, prefill_chunk=c, kvzap_model=kvzap)
        for m, c in (("none", None), ("kvzap", 48), ("kvzap", None), ("criticalkv-kvzap", 48))
    ]
    requests = [Request("a", TEXT * 3, ["Who jumps?", "Why?"]), Request("b", TEXT, ["What?"])]
    engine = Engine(tiny_loaded(), settings[0], GenerationConfig(max_new_tokens=8, batch_size=2))
    swept = engine.generate_sweep(requests, settings)
    for setting, answers in zip(settings, swept):
        alone = Engine(tiny_loaded(), setting, GenerationConfig(max_new_tokens=8, batch_size=2)).generate(requests)
        assert [(a.prediction, a.kv_entries_kept) for a in answers] == [
            (a.prediction, a.kv_entries_kept) for a in alone
        ]
    assert [a.kv_entries_kept for a in swept[1]] != [a.kv_entries_kept for a in swept[2]] or [
        a.prediction for a in swept[1]
    ] != [a.prediction for a in swept[2]]


def test_chunked_prefill_refuses_kvzip_and_the_decode_cap():
    with pytest.raises(ValueError, match="prefill_chunk: scorer 'kvzip'"):
        CompressionConfig(method="layer-kvzip", cache_size=0.2, prefill_chunk=512)
    with pytest.raises(ValueError, match="cannot be combined"):
        CompressionConfig(method="snapkv", cache_size=0.2, prefill_chunk=512, max_cache_tokens=64)
    CompressionConfig(method="layer-kvzip", cache_size=1.0, prefill_chunk=512)  # keeps everything: no chunking


def test_a_cache_size_below_the_window_keeps_the_window_and_warns(caplog):
    """cache_size 1e-9 used to keep one entry per KV head silently; the window (4 here) is always kept
    and the engine says so, naming the document; the kept bytes report what was kept."""
    engine = _engine(method="snapkv", cache_size=1e-9, max_new=3)
    with caplog.at_level("WARNING", logger="pipeline.engine.batching"):
        (answer,) = engine.generate([Request("tiny-share", TEXT * 3, ["Who jumps?"])])
    assert answer.error is None
    shape = engine.shape
    assert answer.kv_entries_kept == 4 * shape.num_layers * shape.num_kv_heads
    assert "'tiny-share'" in caplog.text and "below the observation window (4 tokens" in caplog.text
    assert "keeps 4 per head" in caplog.text


def test_an_engine_chooses_its_attention_kernels_once_for_every_cache(monkeypatch):
    """The forced kernels are read when the engine is made; its caches (batch, continuous, sweep) keep
    that choice whatever the environment says later."""
    from pipeline.kv.attention.varlen_kernels import KERNEL_ENV, RAGGED_ENV, KernelChoice

    monkeypatch.setenv(KERNEL_ENV, "reference")
    monkeypatch.setenv(RAGGED_ENV, "blocked")
    engine = _engine(method="snapkv", cache_size=0.5)
    monkeypatch.setenv(KERNEL_ENV, "sdpa")
    monkeypatch.delenv(RAGGED_ENV)
    chosen = KernelChoice(varlen="reference", ragged="blocked")
    assert engine.kernels == chosen
    assert engine.new_cache(engine.compressor).kernels == chosen
    assert engine.compress_context(Request("d", "one two three four five six seven eight", ["?"])).kernels == chosen
