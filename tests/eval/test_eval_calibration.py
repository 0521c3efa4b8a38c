"""HeadKV calibration (pipeline.eval.calibration): scoring on synthetic attention maps, a planted copy
head, the needle cases, the hook against eager attention, and the priors file round trip."""

import json

import pytest
import torch

from pipeline.engine.priors import load_head_priors, shipped_priors
from pipeline.eval.calibration import (
    build_cases,
    calibrate,
    priors_document,
    retrieval_hits,
    score_case,
    top_attended_positions,
    write_priors,
)
from tests.tiny import tiny_model, tiny_tokenizer


def test_retrieval_hits_on_synthetic_maps():
    # needle at positions 10..13 holding tokens 7 8 7 9 (token 7 twice)
    ids = list(range(100, 110)) + [7, 8, 7, 9] + list(range(200, 210))
    top = torch.tensor(
        [
            [10, 11, 12, 13],  # perfect copy head
            [12, 11, 10, 13],  # attends to the other "7" at steps 0 and 2
            [0, 11, 20, 13],  # half right
            [5, 5, 5, 5],  # never on the needle
        ]
    )
    torch.testing.assert_close(retrieval_hits(top, 10, ids, "position"), torch.tensor([1.0, 0.5, 0.5, 0.0]))
    torch.testing.assert_close(retrieval_hits(top, 10, ids, "token"), torch.tensor([1.0, 1.0, 0.5, 0.0]))
    layered = torch.stack([top, top.flip(0)])  # (L=2, H=4, J=4)
    assert retrieval_hits(layered, 10, ids).shape == (2, 4)
    with pytest.raises(ValueError):
        retrieval_hits(top, 10, ids, "nearest")


def test_planted_copy_head_gets_the_top_score():
    g = torch.Generator().manual_seed(0)
    h_q, h_kv, n, d = 8, 2, 80, 16
    needle_start, needle_len = 30, 5
    key = torch.randn(h_kv, n, d, generator=g)
    copy_pos = torch.arange(n - needle_len - 1, n - 1)  # queries of the copy steps
    query = torch.randn(h_q, needle_len, d, generator=g)
    planted = 5  # query head 5 (KV head 1) looks up the needle token it is copying
    query[planted] = 8 * key[1, needle_start : needle_start + needle_len]
    top = top_attended_positions(query, key, copy_pos, scaling=d**-0.5)
    assert bool((top <= copy_pos[None, :]).all())  # causal: never a future key
    ids = torch.randint(0, 50, (n,), generator=g).tolist()
    scores = retrieval_hits(top, needle_start, ids)
    assert float(scores[planted]) == 1.0
    assert int(scores.argmax()) == planted and float(scores.sort().values[-2]) < 1.0


def test_top_attended_positions_respect_key_positions():
    g = torch.Generator().manual_seed(1)
    query, key = torch.randn(2, 3, 4, generator=g), torch.randn(1, 6, 4, generator=g)
    key_pos = torch.tensor([0, 2, 4, 6, 8, 10])
    top = top_attended_positions(query, key, torch.tensor([0, 5, 10]), 1.0, key_pos)
    assert bool((top[:, 0] == 0).all())  # only key 0 is visible to the query at position 0
    assert set(top.flatten().tolist()) <= set(key_pos.tolist()) and bool((top[:, 1] <= 4).all())


@pytest.fixture(scope="module")
def cases():
    return build_cases(tiny_tokenizer(), [320, 480], [0, 50, 100], 2, seed=1)


def test_cases_hold_the_needle_and_its_forced_copy(cases):
    tok = tiny_tokenizer()
    assert len(cases) == 2 * 3 * 2 and {c.kind for c in cases} == {"numbers", "words"}
    for c in cases:
        assert c.needle_len >= 5
        assert (
            c.input_ids[c.copy_start : c.copy_start + c.needle_len]
            == c.input_ids[c.needle_start : c.needle_start + c.needle_len]
        )
        assert c.copy_start + c.needle_len == len(c.input_ids) and c.needle_start < c.copy_start - c.needle_len
        value = tok.decode(c.input_ids[c.needle_start : c.needle_start + c.needle_len])
        context = tok.decode(c.input_ids[: c.needle_start + c.needle_len + 1])
        assert context.endswith(f"is: {value}.")  # the whole value, and nothing else, is scored
        assert 0.9 * c.length <= len(c.input_ids) <= c.length + 80  # fitted (plus template + copy)
        assert tok.decode(c.input_ids[c.copy_start - 4 : c.copy_start]).endswith("is: ")
    depth_pos = {c.depth: c.needle_start / c.copy_start for c in cases if c.length == 480}
    assert depth_pos[0.0] < 0.35 and depth_pos[100.0] > 0.7  # just after the intro / at the end
    assert depth_pos[0.0] < depth_pos[50.0] < depth_pos[100.0]
    again = build_cases(tiny_tokenizer(), [320, 480], [0, 50, 100], 2, seed=1)
    assert [c.input_ids for c in again] == [c.input_ids for c in cases]


def test_hook_matches_eager_attention_maps(cases):
    model = tiny_model("mistral", seed=2)
    case = cases[3]
    hits, acc = score_case(model, case, "position")
    assert model.config._attn_implementation == "sdpa"  # restored after the run
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(input_ids=torch.tensor(case.input_ids)[None], output_attentions=True)
    model.set_attn_implementation("sdpa")
    qpos = torch.tensor(case.query_positions)
    top = torch.stack([a[0][:, qpos].argmax(-1) for a in out.attentions])  # (L, H_q, J)
    torch.testing.assert_close(hits, retrieval_hits(top, case.needle_start, case.input_ids).double())
    assert 0.0 <= acc <= 1.0


def test_priors_file_shape_normalisation_and_loading(cases, tmp_path):
    model = tiny_model("llama", seed=4)  # 2 layers, 4 query heads, 2 KV heads
    result = calibrate(model, cases[:4])
    assert result.scores.shape == (2, 4) and result.per_case.shape == (4, 2, 4)
    torch.testing.assert_close(result.scores, result.per_case.mean(0))
    assert bool(((result.scores >= 0) & (result.scores <= 1)).all())
    doc = priors_document("tiny-llama", model.config, result, {"seed": 1})
    assert (doc["method"], doc["num_layers"], doc["num_heads"], doc["num_kv_heads"]) == ("retrieval", 2, 4, 2)
    assert doc["settings"]["cases"] == 4 and doc["settings"]["seed"] == 1 and doc["settings"]["match"] == "position"
    path = write_priors(tmp_path / "sub" / "priors.json", doc)
    assert json.loads(path.read_text())["scores"] == doc["scores"]
    priors = load_head_priors(path, 2, 2)
    expected = torch.tensor(doc["scores"], dtype=torch.float64).view(2, 2, 2).mean(-1)
    torch.testing.assert_close(priors, expected)
    with pytest.raises(ValueError, match="do not match"):
        priors_document("x", tiny_model("mistral").config, result)


def test_shipped_smollm2_priors_load():
    path = shipped_priors("smollm2")
    assert path is not None and path.is_file(), "the SmolLM2 calibration ships in pipeline/resources/headkv/"
    doc = json.loads(path.read_text())
    assert (doc["num_layers"], doc["num_heads"], doc["num_kv_heads"]) == (30, 9, 3)
    priors = load_head_priors(path, 30, 3)
    assert priors.shape == (30, 3) and float(priors.sum()) > 0
    assert doc["settings"]["copy_accuracy"] > 0.8  # the model really copied the needles
