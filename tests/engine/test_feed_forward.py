"""``chunk_feed_forward``: MLPs run a slice of tokens at a time, with the values of the whole sequence."""

import pytest
import torch

from pipeline.engine.config import GenerationConfig
from pipeline.engine.engine import Engine
from pipeline.engine.feed_forward import SequenceChunkedMLP, chunk_feed_forward
from pipeline.engine.types import Request
from pipeline.kv.config import CompressionConfig
from tests.engine.test_engine import KVZAP_DIR, TEXT
from tests.tiny import ARCHS, tiny_kvzap_file, tiny_loaded, tiny_model


def _slices_seen(model) -> list[int]:
    """Every token count the inner MLPs are called with (forward pre-hooks)."""
    seen: list[int] = []
    for module in model.modules():
        if isinstance(module, SequenceChunkedMLP):
            module.inner.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))
    return seen


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_sliced_mlps_give_the_whole_sequences_logits_at_batch_2_with_left_padding(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 250, (2, 23), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # the second row left padded
    with torch.inference_mode():
        expected = model(input_ids=ids, attention_mask=mask).logits
    assert chunk_feed_forward(model, 5) == model.config.num_hidden_layers
    seen = _slices_seen(model)
    with torch.inference_mode():
        got = model(input_ids=ids, attention_mask=mask).logits
    assert seen and max(seen) <= 5 and sum(seen) == 23 * model.config.num_hidden_layers
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_wrapping_is_idempotent_zero_unwraps_and_other_blocks_stay():
    model = tiny_model("llama")
    plain = [layer.mlp for layer in model.model.layers]
    chunk_feed_forward(model, 8)
    assert chunk_feed_forward(model, 3) == len(plain)  # not wrapped twice: the slice changes
    assert all(layer.mlp.inner is mlp and layer.mlp.tokens == 3 for layer, mlp in zip(model.model.layers, plain))
    assert chunk_feed_forward(model, 0) == 0
    assert [layer.mlp for layer in model.model.layers] == plain

    class Experts(torch.nn.Module):  # not a dense per-token MLP by name: left alone
        def forward(self, x):
            return x

    model.model.layers[0].mlp = Experts()
    assert chunk_feed_forward(model, 4) == len(plain) - 1
    assert isinstance(model.model.layers[0].mlp, Experts)
    with pytest.raises(ValueError, match="positive"):
        SequenceChunkedMLP(plain[0], 0)


@pytest.mark.parametrize("method", ["none", "criticalkv-shares-kvzap", "criticalkv-layer-kvzip", "snapkv"])
def test_engine_answers_and_kept_entries_are_unchanged_by_sliced_mlps(method):
    requests = [Request("a", TEXT * 3, ["Who jumps?", "Why?"]), Request("b", TEXT, ["What?"])]
    results = []
    for tokens in (0, 7):
        loaded = tiny_loaded("llama")
        extra = {"kvzap_model": tiny_kvzap_file(loaded, KVZAP_DIR)} if "kvzap" in method else {}
        chunk_feed_forward(loaded.model, tokens)
        comp = CompressionConfig(method=method, cache_size=0.4, window=4, kernel=3, **extra)
        engine = Engine(loaded, comp, GenerationConfig(max_new_tokens=8, batch_size=2, continuous=False))
        answers = engine.generate(requests)
        results.append([(a.prediction, a.kv_entries_kept) for a in answers])
    assert results[0] == results[1]
