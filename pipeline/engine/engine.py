"""The generation engine: prefill a batch of contexts into a compressing cache, then answer every
question of each context from that cache with greedy decoding.

Per batch of documents (left padded together):

1. context chunks are prefilled once; each layer is compressed right after its attention
   (``compress_s`` measures scoring + selection + copying into the variable-length cache);
2. for question round r (question r of every document), the question chunk is prefilled at
   positions continuing each row's own original context length, then tokens are decoded one by
   one until EOS or ``max_new_tokens``; the cache is rolled back to the compressed context before
   the next round, so one compressed context answers many questions;
3. in query-aware mode each (document, question) pair is its own row whose context chunk ends
   with the question, so the question lies inside the observation window.

Times are those of the whole batch a row was part of (``batch_size=1`` gives per-document
figures): ``ttft_s`` = context prefill (with compression) + that question's prefill,
``decode_s`` = the decode steps after the first token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import CompressionConfig, GenerationConfig, ModelConfig
from ..kv.attention import register as register_attention
from ..kv.cache import VarLenCache
from ..kv.compress import Compressor
from .faults import FaultInjection
from .loading import LoadedModel, load_model
from .memory import PeakMemory, device_label, now
from .prompts import EncodedPrompt, PromptBuilder
from .types import Answer, Request


@dataclass
class _Row:
    """One sequence of a prefill batch: a request, the questions answered from it."""

    request: Request
    prompt: EncodedPrompt
    question_indices: list[int]


def load_head_priors(path: Path, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """Read a HeadKV priors JSON (``{"scores": [[...] * heads] * layers}``), per KV head.

    Scores given per query head are averaged over each GQA group.
    """
    data = json.loads(Path(path).read_text())
    scores = torch.tensor(data["scores"] if isinstance(data, dict) else data, dtype=torch.float64)
    if scores.dim() != 2 or scores.shape[0] != num_layers:
        raise ValueError(f"head_priors {path}: expected {num_layers} layers of scores, got shape {tuple(scores.shape)}")
    if scores.shape[1] != num_kv_heads:
        if scores.shape[1] % num_kv_heads:
            raise ValueError(f"head_priors {path}: {scores.shape[1]} heads per layer do not group into {num_kv_heads}")
        scores = scores.view(num_layers, num_kv_heads, -1).mean(-1)
    if bool((scores < 0).any()):
        raise ValueError(f"head_priors {path}: scores must be non-negative")
    return scores


class Engine:
    """Holds one model and answers :class:`Request` batches (see module docstring)."""

    def __init__(
        self,
        loaded: LoadedModel,
        compression: CompressionConfig | None = None,
        generation: GenerationConfig | None = None,
        max_context_tokens: int | None = None,
        use_chat_template: bool = True,
        oom_retry_cache_size: float | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.compression = compression or CompressionConfig()
        self.generation = generation or GenerationConfig()
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_context_tokens = max_context_tokens or getattr(cfg, "max_position_embeddings", None)
        self.compressor = self.make_compressor(self.compression)
        self.oom_retry_cache_size = None
        self._retry_compressor = None
        if oom_retry_cache_size is not None:
            self.enable_oom_retry(oom_retry_cache_size)
        self.faults = FaultInjection.from_env()
        self.prompts = PromptBuilder(self.tokenizer, use_chat_template)
        self.model.set_attn_implementation(register_attention())
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)

    def enable_oom_retry(self, cache_size: float) -> None:
        """Retry a document that ran out of memory once, compressed to ``cache_size`` instead."""
        retry = CompressionConfig.model_validate({**self.compression.model_dump(), "cache_size": cache_size, "budget": None})
        self._retry_compressor = self.make_compressor(retry)
        self.oom_retry_cache_size = cache_size

    def make_compressor(self, config: CompressionConfig) -> Compressor:
        """A compressor for this model (HeadKV priors read from the config's file, if any)."""
        priors = None
        if config.head_priors is not None:
            priors = load_head_priors(config.head_priors, self.num_layers, self.num_kv_heads)
        return Compressor(config, priors)

    @classmethod
    def from_config(
        cls,
        model: ModelConfig,
        compression: CompressionConfig,
        generation: GenerationConfig,
        oom_retry_cache_size: float | None = None,
    ) -> "Engine":
        return cls(
            load_model(model), compression, generation,
            max_context_tokens=model.max_context_tokens, oom_retry_cache_size=oom_retry_cache_size,
        )

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if not ids:
            raise ValueError("the model defines no EOS token; cannot decide when generation ends")
        return ids

    # ------------------------------------------------------------------ public API
    def generate(self, requests: list[Request]) -> list[Answer]:
        """Answer every question of every request; a failing request yields answers with ``error``
        set and never affects the others. Order of answers follows the input order."""
        return self._generate(requests, [self.compressor], self._run_batch)[0]

    def generate_sweep(self, requests: list[Request], compressions: list[CompressionConfig]) -> list[list[Answer]]:
        """Answers for several compression settings from ONE prefill per batch.

        Prefill attention does not depend on the method, so every layer's dense K/V and last
        window queries are captured once and each setting compresses from them (results equal
        separate runs; ``compress_s`` is each setting's own, ``ttft_s`` = shared prefill + own
        compression + question prefill). Returns one answer list per setting, in input order.
        ``peak_memory_bytes`` reflects the sweep (the dense capture is held), not a single run.
        """
        if any(c.query_aware != self.compression.query_aware for c in compressions):
            raise ValueError("query_aware must be the same for the engine and every swept setting")
        compressors = [self.make_compressor(c) for c in compressions]
        return self._generate(requests, compressors, lambda rows: self._run_sweep_batch(rows, compressors))

    def _generate(self, requests: list[Request], variants: list[Compressor], run) -> list[list[Answer]]:
        """Batch rows, run ``run(rows) -> answers (variant-major, then row, then question)``, isolate
        failures to single documents, and return per-variant answer lists in input order."""
        answers: dict[tuple[int, int, int], Answer] = {}
        rows: list[tuple[int, _Row]] = []
        for i, request in enumerate(requests):
            try:
                rows.extend((i, row) for row in self._rows_for(request))
            except Exception as exc:  # bad input: report per question, keep going
                for v in range(len(variants)):
                    for q, qid in enumerate(request.question_ids or ["0"]):
                        answers[(v, i, q)] = self._error_answer(request, qid, exc)
        size = self.generation.batch_size
        for begin in range(0, len(rows), size):
            batch = rows[begin : begin + size]
            try:
                results = run([row for _, row in batch])
                self._store(answers, batch, results, len(variants))
            except Exception:  # isolate the failing document(s)
                self._release_memory()
                for item in batch:
                    self._store(answers, [item], self._run_alone(item[1], run, len(variants)), len(variants))
        return [[answers[key] for key in sorted(answers) if key[0] == v] for v in range(len(variants))]

    @staticmethod
    def _store(answers: dict, batch: list[tuple[int, _Row]], results: list[Answer], n_variants: int) -> None:
        it = iter(results)
        for v in range(n_variants):
            for i, row in batch:
                for q in row.question_indices:
                    answers[(v, i, q)] = next(it)

    def _run_alone(self, row: _Row, run, n_variants: int) -> list[Answer]:
        try:
            return run([row])
        except Exception as exc:
            self._release_memory()
            if isinstance(exc, torch.OutOfMemoryError) and self._retry_compressor is not None and n_variants == 1:
                try:
                    answers = self._run_batch([row], compressor=self._retry_compressor)
                    for answer in answers:
                        answer.cache_size = self.oom_retry_cache_size
                    return answers
                except Exception as retry_exc:
                    self._release_memory()
                    exc = retry_exc
            qids = [row.request.question_ids[q] for q in row.question_indices]
            return [self._error_answer(row.request, qid, exc) for _ in range(n_variants) for qid in qids]

    def _release_memory(self) -> None:
        """Drop what a failed batch left behind (its cache is unreachable once the frame is gone)."""
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @staticmethod
    def _error_answer(request: Request, question_id: str, exc: Exception) -> Answer:
        return Answer(doc_id=request.doc_id, question_id=question_id, error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ preparation
    def _max_new(self, request: Request) -> int:
        return request.max_new_tokens or self.generation.max_new_tokens

    def _rows_for(self, request: Request) -> list[_Row]:
        if not isinstance(request.context, str) or not request.context.strip():
            raise ValueError("context is empty" if isinstance(request.context, str) else "context is not text")
        if not request.questions or any(not isinstance(q, str) or not q.strip() for q in request.questions):
            raise ValueError("missing or empty question")
        encode = dict(
            max_total_tokens=self.max_context_tokens,
            reserve_tokens=self._max_new(request),
            truncate=self.generation.truncate,
        )
        if not self.compression.query_aware:
            prompt = self.prompts.encode(request.context, request.questions, request.answer_prefix, **encode)
            return [_Row(request, prompt, list(range(len(request.questions))))]
        rows = []
        for q, question in enumerate(request.questions):
            prompt = self.prompts.encode(request.context, [question], request.answer_prefix, **encode)
            merged = EncodedPrompt(prompt.context_ids + prompt.question_ids[0], [[]], prompt.truncated_tokens)
            rows.append(_Row(request, merged, [q]))
        return rows

    def _left_pad(self, sequences: list[list[int]], offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) ids and positions (offset + index among real tokens, -1 on padding)."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        pos = torch.full((len(sequences), width), -1, dtype=torch.long)
        for b, seq in enumerate(sequences):
            if seq:
                ids[b, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
                pos[b, width - len(seq) :] = torch.arange(len(seq)) + int(offsets[b])
        return ids.to(self.device), pos.to(self.device)

    def _forward(self, cache: VarLenCache, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One forward over a chunk; returns the last position's logits (B, V) in float32."""
        cache.begin_chunk(pos)
        out = self.model(
            input_ids=ids, position_ids=pos.clamp(min=0), cache=cache, varlen_cache=cache, use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1].float()

    # ------------------------------------------------------------------ one batch
    @torch.inference_mode()
    def compress_context(self, request: Request) -> VarLenCache:
        """Prefill and compress one request's context only and return the cache, so callers can
        inspect what was kept: ``cache.kept_positions(layer, 0, kv_head)`` gives the original token
        positions (0 = first context token after the chat-template head) held for that head."""
        cache = VarLenCache(self.num_layers, self.compressor)
        self._prefill(self._rows_for(request)[:1], cache)
        return cache

    def _prefill(self, rows: list[_Row], cache: VarLenCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded context prefill into ``cache`` (compressing, or capturing for a sweep)
        -> (context lengths (B,), last logits)."""
        if self.faults.active:
            size = cache.compressor.config.cache_size if cache.compressor is not None else 1.0
            self.faults.before_prefill([r.request.doc_id for r in rows], size)
        ctx_len = torch.tensor([len(r.prompt.context_ids) for r in rows])
        ids, pos = self._left_pad([r.prompt.context_ids for r in rows], torch.zeros(len(rows), dtype=torch.long))
        return ctx_len, self._forward(cache, ids, pos)

    @torch.inference_mode()
    def _run_batch(self, rows: list[_Row], compressor: Compressor | None = None) -> list[Answer]:
        meter = PeakMemory(self.device)
        with meter:
            t0 = now(self.device)
            cache = VarLenCache(self.num_layers, compressor or self.compressor)
            ctx_len, logits = self._prefill(rows, cache)
            prefill_s = now(self.device) - t0
            per_round = self._answer_rounds(cache, rows, ctx_len, logits)
        kept = (cache.context_entries.tolist(), cache.context_bytes.tolist())
        return self._make_answers(rows, kept, ctx_len, per_round, prefill_s, cache.compress_seconds, meter.peak_bytes)

    @torch.inference_mode()
    def _run_sweep_batch(self, rows: list[_Row], compressors: list[Compressor]) -> list[Answer]:
        meter = PeakMemory(self.device)
        answers: list[tuple] = []
        with meter:
            window = max(c.config.window for c in compressors)
            capture = VarLenCache(self.num_layers, None, capture_window=window)
            t0 = now(self.device)
            ctx_len, logits = self._prefill(rows, capture)
            prefill_s = now(self.device) - t0
            for compressor in compressors:
                cache = VarLenCache.from_capture(capture, compressor)
                per_round = self._answer_rounds(cache, rows, ctx_len, logits)
                kept = (cache.context_entries.tolist(), cache.context_bytes.tolist())
                answers.append((kept, per_round, cache.compress_seconds))
                del cache  # one derived cache alive at a time
        return [
            a
            for kept, per_round, compress_s in answers
            for a in self._make_answers(rows, kept, ctx_len, per_round, prefill_s + compress_s, compress_s, meter.peak_bytes)
        ]

    def _answer_rounds(self, cache: VarLenCache, rows: list[_Row], ctx_len: torch.Tensor, logits: torch.Tensor) -> list:
        """Every question round from one compressed context (rolled back between rounds)."""
        rounds = max(len(r.question_indices) for r in rows)
        if rounds > 1:
            cache.snapshot()
        per_round = []
        for r in range(rounds):
            if r > 0:
                cache.restore()
            per_round.append(self._answer_round(cache, rows, r, ctx_len, logits))
        return per_round

    def _make_answers(self, rows, kept, ctx_len, per_round, ttft_base, compress_s, peak_bytes) -> list[Answer]:
        """Answer records; ``kept`` = (entries per row, bytes per row) of the compressed context."""
        entries, kept_bytes = kept
        itemsize = torch.tensor([], dtype=self.loaded.dtype).element_size()
        answers = []
        for b, row in enumerate(rows):
            full_entries = int(ctx_len[b]) * self.num_layers * self.num_kv_heads
            for r, q in enumerate(row.question_indices):
                text, generated, q_tokens, q_s, decode_s, steps = per_round[r][b]
                answers.append(
                    Answer(
                        doc_id=row.request.doc_id,
                        question_id=row.request.question_ids[q],
                        prediction=text,
                        context_tokens=int(ctx_len[b]),
                        question_tokens=q_tokens,
                        generated_tokens=generated,
                        kv_entries_full=full_entries,
                        kv_entries_kept=int(entries[b]),
                        kv_bytes_full=full_entries * 2 * self.head_dim * itemsize,
                        kv_bytes_kept=int(kept_bytes[b]),
                        ttft_s=ttft_base + q_s,
                        compress_s=compress_s,
                        decode_s=decode_s,
                        decode_ms_per_token=(1000.0 * decode_s / steps) if steps else None,
                        peak_memory_bytes=peak_bytes,
                        device=device_label(self.device),
                        truncated_tokens=row.prompt.truncated_tokens,
                    )
                )
        return answers

    def _answer_round(self, cache: VarLenCache, rows: list[_Row], r: int, ctx_len: torch.Tensor, prefill_logits):
        """Prefill question r of every row (rows without one repeat their last) and decode greedily.

        Returns per row (text, generated tokens, question tokens, question prefill s, decode s, steps).
        """
        bsz = len(rows)
        q_ids = [row.prompt.question_ids[min(r, len(row.prompt.question_ids) - 1)] for row in rows]
        q_len = torch.tensor([len(q) for q in q_ids])
        limits = [self._max_new(row.request) for row in rows]
        t0 = now(self.device)
        if int(q_len.max()) > 0:
            for layer in cache.store:
                layer.reserve(int(q_len.max()) + max(limits))
            ids, pos = self._left_pad(q_ids, ctx_len)
            logits = self._forward(cache, ids, pos)
        else:  # query-aware: the question was part of the context chunk
            logits = prefill_logits
            for layer in cache.store:
                layer.reserve(max(limits))
        q_s = now(self.device) - t0
        next_pos = (ctx_len + q_len).to(self.device)
        tokens: list[list[int]] = [[] for _ in range(bsz)]
        done = [False] * bsz
        steps = 0
        t1 = now(self.device)
        while True:
            choice = logits.argmax(-1).tolist()
            for b in range(bsz):
                if not done[b]:
                    if choice[b] in self.eos_ids:
                        done[b] = True
                    else:
                        tokens[b].append(choice[b])
                        done[b] = len(tokens[b]) >= limits[b]
            if all(done):
                break
            step_ids = torch.tensor(choice, dtype=torch.long, device=self.device)[:, None]
            logits = self._forward(cache, step_ids, next_pos[:, None])
            next_pos = next_pos + 1
            steps += 1
        decode_s = now(self.device) - t1
        results = []
        for b in range(bsz):
            generated = len(tokens[b]) + (1 if len(tokens[b]) < limits[b] else 0)  # EOS counts as generated
            text = self.tokenizer.decode(tokens[b], skip_special_tokens=True)
            results.append((text, generated, int(q_len[b]), q_s, decode_s, steps))
        return results
