"""``apply_weight_layout``: linear weights change memory order only (values, ties and outputs stay)."""

import torch

from pipeline.engine.loading import apply_weight_layout
from tests.tiny import tiny_model


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_column_order_keeps_values_ties_and_outputs_and_row_order_restores_it():
    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's output layer
    before = {id(m): m.weight.detach().clone() for m in _linears(model)}
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    apply_weight_layout(model, "auto")  # CPU: column order
    for module in _linears(model):
        weight = module.weight
        assert weight.stride() == (1, weight.shape[0])
        assert torch.equal(weight, before[id(module)])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    apply_weight_layout(model, "row")
    assert all(m.weight.is_contiguous() and torch.equal(m.weight, before[id(m)]) for m in _linears(model))
    assert model.lm_head.weight is model.model.embed_tokens.weight
