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
from pipeline.engine.engine import Engine
from pipeline.engine.types import Request
from pipeline.kv.config import CompressionConfig
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
    out = plain.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
    answer = out[0, ids.shape[1] :].tolist()
    answer = answer[: answer.index(257) + 1] if 257 in answer else answer
    assert engine.tokenizer.decode([t for t in answer if t != 257], skip_special_tokens=True) == full.prediction
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
