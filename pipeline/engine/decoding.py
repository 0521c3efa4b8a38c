"""Prefill and greedy decoding over one cache: the context chunk, then each question round.

For question round r (question r of every row), the question chunk is prefilled at positions
continuing each row's own original context length, then tokens are decoded one by one until EOS or
the row's ``max_new_tokens``; the cache is rolled back to the compressed context before the next
round, so one compressed context answers many questions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .. import hooks
from ..kv.cache import ChunkCache, VarLenCache, run_chunk
from ..kv.rows import park_rows, unpark_rows
from .batching import Row, left_pad
from .fidelity import continuation_nll
from .memory import now


@dataclass
class RoundResult:
    """One row's answer to one question round."""

    text: str
    generated_tokens: int  # EOS counts as generated
    question_tokens: int
    question_s: float  # the round's question prefill (the batch's)
    decode_s: float  # the round's decode steps after the first token (the batch's)
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

    def __init__(self, model: torch.nn.Module, tokenizer, device: torch.device, end_at_sentence: bool = False) -> None:
        self.end_at_sentence = end_at_sentence
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)

    def forward(self, cache: ChunkCache, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One chunk; returns the last position's logits (B, V) in float32."""
        return run_chunk(self.model, cache, ids, pos, logits_to_keep=1).logits[:, -1].float()

    def prefill(self, rows: list[Row], cache: ChunkCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded context prefill into ``cache`` -> (context lengths (B,), last logits (B, V))."""
        hooks.fire("engine.prefill", doc_ids=[r.request.doc_id for r in rows], cache_size=cache.kept_fraction)
        ctx_len = torch.tensor([len(r.prompt.context_ids) for r in rows])
        zeros = torch.zeros(len(rows), dtype=torch.long)
        ids, pos = left_pad([r.prompt.context_ids for r in rows], zeros, self.pad_id, self.device)
        return ctx_len, self.forward(cache, ids, pos)

    def prefill_chunked(self, rows: list[Row], cache: VarLenCache, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Context prefill ``chunk`` tokens at a time (positions [k*chunk, (k+1)*chunk) of every row),
        compressing the cache after each chunk (:mod:`pipeline.kv.chunked`). Same returns as :meth:`prefill`."""
        hooks.fire("engine.prefill", doc_ids=[r.request.doc_id for r in rows], cache_size=cache.kept_fraction)
        contexts = [r.prompt.context_ids for r in rows]
        ctx_len = torch.tensor([len(c) for c in contexts])
        logits = None
        cache.begin_chunked_prefill(ctx_len.to(self.device))
        for begin in range(0, int(ctx_len.max()), chunk):
            pieces = [c[begin : begin + chunk] for c in contexts]
            ids, pos = left_pad(pieces, torch.full((len(rows),), begin), self.pad_id, self.device)
            out = self.forward(cache, ids, pos)
            cache.compress_chunk(ctx_len.clamp(max=begin + chunk).to(self.device))
            ends = ((ctx_len > begin) & (ctx_len <= begin + chunk)).to(out.device)
            logits = out if logits is None else torch.where(ends[:, None], out, logits)
        cache.end_chunked_prefill()
        return ctx_len, logits

    def answer_rounds(
        self,
        cache: VarLenCache,
        rows: list[Row],
        ctx_len: torch.Tensor,
        logits: torch.Tensor,
        limits: list[int],
        references: list[list[list[int]]] | None = None,
        own_reference: bool = False,
    ) -> list[list[RoundResult]]:
        """Every question round from one compressed context (rolled back between rounds);
        ``limits``: each row's max new tokens. Fidelity (:mod:`pipeline.engine.fidelity`) is measured
        after each round's answers, of ``references`` ([round][row] token ids) or, with
        ``own_reference``, of the round's own answers (the full cache's). Returns [round][row]."""
        rounds = max(len(r.question_indices) for r in rows)
        fidelity = references is not None or own_reference
        cache.snapshot()
        per_round = []
        for r in range(rounds):
            if r > 0:
                cache.restore()
            results, first_logits, mark = self._answer_round(cache, rows, r, ctx_len, logits, limits, fidelity)
            if fidelity:
                targets = [x.reference_tokens for x in results] if own_reference else references[r]
                self._measure_fidelity(cache, mark, results, first_logits, targets, ctx_len)
            per_round.append(results)
        return per_round

    def _measure_fidelity(self, cache, mark, results, first_logits, targets, ctx_len) -> None:
        """Set each result's ``answer_nll``: the mean NLL of ``targets[b]`` after its question, with
        the cache rolled back to ``mark`` (the end of the question chunk)."""
        cache.rollback(mark)
        start = ctx_len.to(self.device) + torch.tensor([x.question_tokens for x in results], device=self.device)
        nll = continuation_nll(self.model, cache, first_logits, targets, start, self.pad_id)
        for result, value in zip(results, nll):
            result.answer_nll = value

    def _answer_round(
        self,
        cache: VarLenCache,
        rows: list[Row],
        r: int,
        ctx_len: torch.Tensor,
        prefill_logits: torch.Tensor,
        limits: list[int],
        fidelity: bool = False,
    ) -> tuple[list[RoundResult], torch.Tensor, list | None]:
        """Prefill question r of every row (rows without one repeat their last) and decode greedily.
        Also returns the logits that predict each row's first answer token (B, V) and, with
        ``fidelity``, a checkpoint of the cache at the end of the question."""
        q_ids = [row.prompt.question_ids[min(r, len(row.prompt.question_ids) - 1)] for row in rows]
        q_len = torch.tensor([len(q) for q in q_ids])
        t0 = now(self.device)
        if int(q_len.max()) > 0:
            cache.reserve(int(q_len.max()) + max(limits))
            logits = self.forward(cache, *left_pad(q_ids, ctx_len, self.pad_id, self.device))
        else:  # query-aware: the question was part of the context chunk
            cache.reserve(max(limits))
            logits = prefill_logits
        q_s = now(self.device) - t0
        mark = cache.checkpoint() if fidelity else None
        t1 = now(self.device)
        tokens, stops, steps, row_steps = self._greedy(cache, logits, (ctx_len + q_len).to(self.device), limits)
        decode_s = now(self.device) - t1
        reserved, used = cache.bytes_per_row().tolist(), cache.used_bytes_per_row().tolist()
        texts = [self._text(tokens[b], stops[b]) for b in range(len(rows))]
        results = [
            RoundResult(
                text=texts[b][0],
                finish_reason=texts[b][1],
                decode_batch=row_steps / steps if steps else None,
                generated_tokens=len(tokens[b]) + (1 if len(tokens[b]) < limits[b] else 0),
                question_tokens=int(q_len[b]),
                question_s=q_s,
                decode_s=decode_s,
                steps=steps,
                token_ids=tokens[b],
                stop_id=stops[b],
                kv_bytes_reserved=int(reserved[b]),
                kv_bytes_used=int(used[b]),
            )
            for b in range(len(rows))
        ]
        return results, logits, mark

    def _text(self, tokens: list[int], stop_id: int | None) -> tuple[str, str]:
        return answer_text(self.tokenizer, tokens, cut=stop_id is None, end_at_sentence=self.end_at_sentence)

    def _greedy(
        self, cache: VarLenCache, logits: torch.Tensor, next_pos: torch.Tensor, limits: list[int]
    ) -> tuple[list[list[int]], list[int | None], int, int]:
        """Greedy tokens per row (EOS excluded), the EOS id that ended each row (None: its limit), the
        number of decode forwards and the rows they decoded, summed. Once half the rows of the batch
        have ended they leave it (:func:`~pipeline.kv.rows.park_rows`), so later steps decode the
        active rows only; they are put back, in order, when every row has ended (not under a
        decode-time cap, which evicts per row)."""
        bsz = logits.shape[0]
        tokens: list[list[int]] = [[] for _ in range(bsz)]
        stops: list[int | None] = [None] * bsz
        done = [False] * bsz
        rows, parked, parked_rows = list(range(bsz)), [], []  # rows[j]: the batch row cache row j holds
        steps = row_steps = 0
        while True:
            choice = logits.argmax(-1).tolist()
            for j, b in enumerate(rows):
                if not done[b]:
                    if choice[j] in self.eos_ids:
                        done[b], stops[b] = True, choice[j]
                    else:
                        tokens[b].append(choice[j])
                        done[b] = len(tokens[b]) >= limits[b]
            if all(done[b] for b in rows):
                break
            active = [j for j, b in enumerate(rows) if not done[b]]
            if cache.cap is None and 2 * len(active) <= len(rows):
                parked_rows.append([b for b in rows if done[b]])
                parked.append(park_rows(cache, [j for j, b in enumerate(rows) if done[b]], active))
                rows, choice, next_pos = [rows[j] for j in active], [choice[j] for j in active], next_pos[active]
            step_ids = torch.tensor(choice, dtype=torch.long, device=self.device)[:, None]
            logits = self.forward(cache, step_ids, next_pos[:, None])
            next_pos = next_pos + 1
            steps, row_steps = steps + 1, row_steps + len(rows)
        if parked:
            unpark_rows(cache, rows, parked, parked_rows)
        return tokens, stops, steps, row_steps
