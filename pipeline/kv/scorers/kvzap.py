"""KVzap (Jegou & Jeblick, arXiv 2601.07891; kvpress ``KVzapPress``): KVzip's scores predicted in
the ordinary prefill, with no reconstruction pass. Per layer a small model (linear or MLP,
:class:`~pipeline.kv.kvzap_model.KVzapModel`) maps each entry's attention input h_i (B, n, hidden)
to a predicted KVzip+ log-score per KV head; the score is its exponential (a predicted attention x
value-norm mass, non-negative like the other scorers', so CriticalKV's ``(A_i + eps) * m_i`` reads
it the same way). Cost: one (n x hidden) @ (hidden x H_kv) matmul per layer. A file with position
weights adds its term in each entry's position and the row's context length (the whole context's,
also in a chunked prefill) before the exponential; a file with one predictor per calibration length
reads them at that length (linear in log length between the two around it).

The weights come from a calibration on the model itself (``jobs/calibrate_kvzap.py``); a file made
for another model is refused. The first ``sink_tokens`` entries and the observation window are
always kept. With the ``shares`` allocation the budgets across layers follow KVzip's global top-k
as calibrated, while each layer is still compressed right after its own attention.
"""

from __future__ import annotations

import torch

from ..kvzap_model import KVzapModelOptions
from ..parts import LayerContext, LayerInputs, Scorer
from .common import SinkOptions, finalise, sink_mask

MAX_LOG_SCORE = 60.0  # exp() stays finite in float32


def kvzap_scores(predicted: torch.Tensor, key_pos: torch.Tensor, window: torch.Tensor, sink_tokens: int):
    """predicted: (B, H_kv, n) log-scores; key_pos: (B, n); window: (B,) -> (B, H_kv, n) float32
    scores (exp of the prediction; +inf on sinks and window, -inf on padding)."""
    scores = predicted.float().clamp(max=MAX_LOG_SCORE).exp()
    scores = scores.masked_fill(sink_mask(key_pos, sink_tokens)[:, None, :], float("inf"))
    return finalise(scores, key_pos, window)


class KVzapOptions(KVzapModelOptions, SinkOptions):
    """KVzap scorer: its weights file and the attention sinks"""


class KVzap(Scorer):
    name = "kvzap"
    options = KVzapOptions
    summary = "KVzip+ scores predicted from each layer's hidden states in one pass (arXiv 2601.07891)"
    needs_hidden_states = True
    needs_kvzap_model = True
    weighs_by_value_norm = True  # KVzip+ targets: max attention x ||W_O v_i|| / ||h||

    def observe(self, query, key_pos, options, window, rotary=None, inputs: LayerInputs | None = None) -> torch.Tensor:
        if inputs is None or inputs.hidden is None or inputs.kvzap is None:
            raise ValueError("kvzap needs the layer's hidden states and a KVzap model (compression.kvzap_model)")
        return inputs.kvzap.predict_from_hidden(inputs.layer_idx, inputs.hidden)

    def merge_observed(self, earlier, later, window, options) -> torch.Tensor:
        return torch.cat([earlier, later], dim=-1)  # per-entry predictions (B, H_kv, n)

    def score(self, ctx: LayerContext, options: KVzapOptions) -> torch.Tensor:
        predicted = ctx.observed
        lengths = ctx.lengths if ctx.context_lengths is None else ctx.context_lengths
        if ctx.kvzap is not None and ctx.kvzap.per_length:
            predicted = ctx.kvzap.at_lengths(predicted, lengths)
        if ctx.kvzap is not None and ctx.kvzap.uses_positions:
            predicted = predicted + ctx.kvzap.position_term(ctx.layer_idx, ctx.key_pos, lengths)
        return kvzap_scores(predicted, ctx.key_pos, ctx.row_window, options.sink_tokens)
