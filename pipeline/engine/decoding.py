"""One chunk's forward over a cache and the answer text: how a row's generated tokens become its
answer. The context prefill is :mod:`pipeline.engine.prefill`'s, the greedy decode the decode loop's
(:mod:`pipeline.engine.continuous`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..kv.storage.cache import ChunkCache, run_chunk


@dataclass
class RoundResult:
    """One row's answer to one question round."""

    text: str
    generated_tokens: int  # EOS counts as generated
    question_tokens: int
    question_s: float  # the round's question prefill (its own, or the chunk of the rows that joined with it)
    decode_s: float  # the decode steps the row took part in after its first token (shared with their rows)
    steps: int
    token_ids: list[int] = field(default_factory=list)  # the answer's tokens (EOS excluded)
    stop_id: int | None = None  # the EOS id that ended the answer, None when the limit did
    answer_nll: float | None = None  # fidelity: mean NLL of the reference answer (engine.fidelity)
    kv_bytes_reserved: int | None = None  # the row's cache at the round's end: allocated slots ...
    kv_bytes_used: int | None = None  # ... and filled ones (context kept + question + answer)
    finish_reason: str | None = None  # stop (EOS), length (the limit), sentence (the limit, cut to a sentence)
    decode_batch: float | None = None  # mean rows per decode step over the steps of decode_s

    @property
    def reference_tokens(self) -> list[int]:
        """What a fidelity measurement teacher-forces: the tokens and the EOS that ended them."""
        return self.token_ids + ([self.stop_id] if self.stop_id is not None else [])


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|$)")


def last_sentence_end(text: str) -> str:
    """``text`` up to its last complete sentence (unchanged when it has none)."""
    ends = list(_SENTENCE_END.finditer(text))
    return text[: ends[-1].end()] if ends else text


def answer_text(tokenizer, tokens: list[int], cut: bool, end_at_sentence: bool = False) -> tuple[str, str]:
    """The answer's text and why it ended (the output's ``finish_reason``): ``stop`` (not ``cut``:
    EOS), ``length`` (``cut`` by its token limit) or ``sentence`` (cut, then, with ``end_at_sentence``,
    ended at its last complete sentence; a cut answer without one stays ``length``, a fragment).
    A cut answer may end inside a multi-byte character (byte-level tokenizers): the incomplete
    character's tokens (at most 3) are left out rather than decoded to U+FFFD."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if not cut:
        return text, "stop"
    for drop in range(1, min(3, len(tokens)) + 1):
        if not text.endswith("\ufffd"):
            break
        text = tokenizer.decode(tokens[:-drop], skip_special_tokens=True)
    if end_at_sentence and _SENTENCE_END.search(text):
        return last_sentence_end(text), "sentence"
    return text, "length"


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id the model or tokenizer declares as end of sequence."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the model defines no EOS token; cannot decide when generation ends")
    return ids


class Decoder:
    """Runs the chunks of one batch through ``model`` (which uses the registered varlen attention)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        device: torch.device,
        end_at_sentence: bool = False,
    ) -> None:
        self.end_at_sentence = end_at_sentence
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)

    def forward(self, cache: ChunkCache, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One chunk; returns the last position's logits (B, V) in float32."""
        return run_chunk(self.model, cache, ids, pos, logits_to_keep=1).logits[:, -1].float()

    def _text(self, tokens: list[int], stop_id: int | None) -> tuple[str, str]:
        return answer_text(self.tokenizer, tokens, cut=stop_id is None, end_at_sentence=self.end_at_sentence)
