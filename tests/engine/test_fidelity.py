"""Answer fidelity in sweeps: the teacher-forced NLL of the full cache's answer.

* the full-cache setting's NLL equals a plain transformers forward over context + question + its
  own greedy answer (and EOS), so its delta is 0;
* every compressed setting gets an NLL of that same answer and a delta, in query-agnostic and
  query-aware mode, for several questions per document;
* rows that are not swept (plain jobs) carry no fidelity.
"""

import pytest
import torch

from pipeline.engine.config import GenerationConfig
from pipeline.engine.decoding import answer_text
from pipeline.engine.engine import Engine
from pipeline.engine.types import Request
from pipeline.kv.config import CompressionConfig
from pipeline.kv.storage.cache import run_chunk
from tests.tiny import DEVICE, tiny_loaded, tiny_model

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "


def _settings(query_aware=False):
    return [
        CompressionConfig(method=m, cache_size=c, window=4, kernel=3, query_aware=query_aware)
        for m, c in [("none", 1.0), ("snapkv", 0.3), ("criticalkv-layer-knorm", 0.3)]
    ]


def test_full_cache_nll_equals_a_plain_forward():
    engine = Engine(tiny_loaded(), _settings()[0], GenerationConfig(max_new_tokens=6))
    request = Request("a", TEXT * 3, ["Who jumps?"], answer_prefix="It is")
    full = engine.generate_sweep([request], _settings())[0][0]
    prompt = engine.prompts.encode(request.context, request.questions, request.answer_prefix)
    plain = tiny_model("llama")  # same weights; its own greedy answer (with EOS, if it stops) is the reference
    ids = torch.tensor([prompt.context_ids + prompt.question_ids[0]], device=DEVICE)
    answer = _greedy_reference(plain, ids[0].tolist(), 6)
    tokens = [t for t in answer if t != 257]
    assert answer_text(engine.tokenizer, tokens, cut=257 not in answer)[0] == full.prediction
    ids = torch.tensor([ids[0].tolist() + answer], device=DEVICE)
    with torch.inference_mode():
        logits = plain(input_ids=ids).logits[0].float()
    start = len(prompt.context_ids) + len(prompt.question_ids[0]) - 1
    nll = -torch.log_softmax(logits[start : start + len(answer)], -1).gather(1, torch.tensor(answer)[:, None])
    assert full.answer_nll == pytest.approx(float(nll.mean()), rel=1e-4, abs=1e-5)
    assert full.answer_nll_delta == 0.0


@pytest.mark.parametrize("query_aware", [False, True])
def test_every_compressed_setting_gets_a_delta(query_aware):
    engine = Engine(tiny_loaded(), _settings(query_aware)[0], GenerationConfig(max_new_tokens=5, batch_size=2))
    requests = [Request("a", TEXT * 3, ["Who jumps?", "Why?"]), Request("b", TEXT * 2, ["What?"])]
    swept = engine.generate_sweep(requests, _settings(query_aware))
    full = swept[0]
    for answers in swept[1:]:
        for mine, ref in zip(answers, full):
            assert mine.answer_nll is not None and mine.answer_nll >= 0
            assert mine.answer_nll_delta == pytest.approx(mine.answer_nll - ref.answer_nll)
    assert any(abs(a.answer_nll_delta) > 1e-6 for answers in swept[1:] for a in answers)


def test_plain_generation_has_no_fidelity():
    engine = Engine(tiny_loaded(), _settings()[1], GenerationConfig(max_new_tokens=3))
    answer = engine.generate([Request("a", TEXT, ["Who?"])])[0]
    assert answer.answer_nll is None and answer.answer_nll_delta is None


def _greedy_reference(plain, ids: list[int], new_tokens: int) -> list[int]:
    """The full cache's answer as plain transformers generates it, ending EOS (257) included."""
    x = torch.tensor([ids], device=DEVICE)
    out = plain.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens)
    answer = out[0, len(ids) :].tolist()
    return answer[: answer.index(257) + 1] if 257 in answer else answer


@torch.inference_mode()
def _one_chunk_nll(engine, plain, cache, context_ids, question_ids, answer) -> float:
    """Naive reference: question + answer teacher-forced as one chunk over the compressed context
    alone (batch 1); a query-aware row's first answer token is predicted by the context's last
    logits, which compression does not change (plain forward)."""
    seq = question_ids + answer
    pos = torch.arange(len(context_ids), len(context_ids) + len(seq), device=DEVICE)[None]
    ids = torch.tensor([seq], device=DEVICE)
    logits = run_chunk(engine.model, cache, ids, pos, logits_to_keep=len(seq)).logits[0].float()
    rows = logits[len(question_ids) - 1 : len(seq) - 1]
    if not question_ids:
        first = plain(input_ids=torch.tensor([context_ids], device=DEVICE)).logits[0, -1:].float()
        rows = torch.cat([first, logits[: len(seq) - 1]])
    nll = -torch.log_softmax(rows, -1).gather(1, torch.tensor(answer, device=DEVICE)[:, None])
    return float(nll.mean())


@pytest.mark.parametrize("method,query_aware", [("snapkv", False), ("criticalkv-layer-knorm", False), ("snapkv", True)])
def test_compressed_nll_equals_one_teacher_forced_chunk(method, query_aware):
    """The sweep measures fidelity after each round's answer, from the end of its question, at batch
    2 with left padding and several questions; the naive reference runs each question and answer
    again as one chunk over that setting's cache built alone."""
    setting = CompressionConfig(method=method, cache_size=0.3, window=4, kernel=3, query_aware=query_aware)
    full = CompressionConfig(method="none", cache_size=1.0, query_aware=query_aware)
    engine = Engine(tiny_loaded(), full, GenerationConfig(max_new_tokens=5, batch_size=2))
    questions = [["Who jumps?"], ["What?"]] if query_aware else [["Who jumps?", "Why?"], ["What?"]]
    requests = [Request("a", TEXT * 3, questions[0]), Request("b", TEXT * 2, questions[1])]
    _, swept = engine.generate_sweep(requests, [full, setting])
    alone = Engine(tiny_loaded(), setting, GenerationConfig(max_new_tokens=5))
    plain = tiny_model("llama")
    got = iter(swept)
    for request in requests:
        prompt = alone.prompts.encode(request.context, request.questions, request.answer_prefix)
        cache = alone.compress_context(request)
        cache.snapshot()
        for q_ids in prompt.question_ids:
            context = prompt.context_ids + (q_ids if query_aware else [])
            question = [] if query_aware else q_ids
            answer = _greedy_reference(plain, context + question, 5)
            cache.restore()
            expected = _one_chunk_nll(alone, plain, cache, context, question, answer)
            assert next(got).answer_nll == pytest.approx(expected, rel=1e-4, abs=1e-5)
