"""The generation engine: prefill a batch of contexts into a compressing cache, then answer every
question of each context from that cache with greedy decoding.

Two decode paths, one flow each:

- the continuous batch (:mod:`pipeline.engine.continuous`, the jobs' default): documents prefilled
  and compressed one by one, decoded together within a KV memory (``kv_memory``), rows leaving and joining;
- the batch path (:mod:`pipeline.engine.sweep`): a batch of documents left padded together
  (:mod:`pipeline.engine.batching`), prefilled once, every compression setting's cache decoded side
  by side. A sweep has many settings; a plain batch (``continuous`` off, a decode-time cap, a document
  retried alone) is a sweep of one setting, prefilled straight into its compressing cache.

In both, each layer is compressed as early as the method's phases allow (``compress_s`` measures
scoring + selection + copying into the variable-length cache), every question round is answered
from that cache (:mod:`pipeline.engine.decoding`), and answers carry what they cost
(:mod:`pipeline.engine.answers`).

Failures stay with their document: a request that cannot be encoded, or a batch that raises, is
retried document by document and a document that still fails yields answers with ``error`` set.
With ``oom_retry_cache_size`` a document that ran out of memory is retried once at that smaller
cache size (its answers' ``setting`` says so).

Times are those of the whole batch a row was part of (``batch_size=1`` gives per-document
figures): ``ttft_s`` = context prefill (with compression) + that question's prefill,
``decode_s`` = the decode steps after the first token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..kv.attention.registered import register as register_attention
from ..kv.attention.varlen_kernels import KernelChoice
from ..kv.compress import Compressor
from ..kv.config import CompressionConfig
from ..kv.rope import model_rotary
from ..kv.storage.cache import ChunkCache, VarLenCache
from .answers import ModelShape
from .batching import Row, rows_for
from .config import GenerationConfig, ModelConfig
from .continuous import ContinuousBatch
from .decoding import Decoder
from .emitter import DocumentCallback, DocumentEmitter
from .kvzap_file import load_kvzap, resolve_kvzap
from .loading import LoadedModel, load_model
from .memory import default_kv_memory, device_label
from .prefill import ContextPrefill
from .priors import load_head_priors, resolve_head_priors
from .prompts import PromptBuilder
from .reconstruction import ContextReconstruction
from .runner import ModelRunner
from .sweep import SweepBatch
from .types import Answer, Request, Setting

logger = logging.getLogger(__name__)

BatchRunner = Callable[[list[Row]], list[Answer]]


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
        cfg = self.model.config
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            itemsize=torch.tensor([], dtype=loaded.dtype).element_size(),
            device_label=device_label(loaded.device),
        )
        self.compression = compression or CompressionConfig()
        self.generation = GenerationConfig.of(generation)
        self.max_context_tokens = max_context_tokens or getattr(cfg, "max_position_embeddings", None)
        self.last_continuous: ContinuousBatch | None = None
        self._kv_memory: int | None = None  # kv_memory_bytes, once decided
        self._kvzap_cache: dict = {}  # file -> KVzapModel: one load per file for every setting
        self.compressor = self.make_compressor(self.compression)
        self.kernels = KernelChoice.from_environment()  # the attention kernels, chosen once for every cache
        self.oom_retry: tuple[float, Compressor] | None = None
        if oom_retry_cache_size is not None:
            self.enable_oom_retry(oom_retry_cache_size)
        self.prompts = PromptBuilder(self.tokenizer, use_chat_template)
        self.model.set_attn_implementation(register_attention())
        self.decoder = Decoder(self.model, self.tokenizer, self.device, self.generation.end_at_sentence)
        self.reconstruction = ContextReconstruction(self.model, self.prompts, self.decoder.pad_id, self.device)
        self.context_prefill = ContextPrefill(self.decoder, self.reconstruction, loaded.layerwise_prefill)
        self.runner = ModelRunner(
            self.model,
            self.decoder,
            self.context_prefill,
            self.reconstruction,
            self.shape,
            self.device,
            self.kernels,
            self.generation,
        )

    @classmethod
    def from_config(
        cls,
        model: ModelConfig,
        compression: CompressionConfig,
        generation: GenerationConfig,
        oom_retry_cache_size: float | None = None,
    ) -> Engine:
        return cls(
            load_model(model),
            compression,
            generation,
            max_context_tokens=model.max_context_tokens,
            oom_retry_cache_size=oom_retry_cache_size,
        )

    def make_compressor(self, config: CompressionConfig) -> Compressor:
        """A compressor for this model (HeadKV priors and KVzap weights read from the config's
        files, or the ones shipped for the model)."""
        config = resolve_kvzap(resolve_head_priors(config, self.loaded.name), self.loaded.name)
        priors = kvzap = None
        if config.head_priors is not None and config.needs_head_priors:
            priors = load_head_priors(config.head_priors, self.shape.num_layers, self.shape.num_kv_heads)
        if config.kvzap_model is not None and config.needs_kvzap_model and config.compresses:
            kvzap = self._kvzap_cache.get(str(config.kvzap_model))
            if kvzap is None:
                kvzap = load_kvzap(config.kvzap_model, self.model, self.loaded.name)
                self._kvzap_cache[str(config.kvzap_model)] = kvzap
        return Compressor(config, priors, rotary=model_rotary(self.model), kvzap=kvzap)

    def enable_oom_retry(self, cache_size: float) -> None:
        """Retry a document that ran out of memory once, compressed to ``cache_size`` instead."""
        retry = self.compression.with_method(cache_size=cache_size, budget=None)
        self.oom_retry = (cache_size, self.make_compressor(retry))

    # ------------------------------------------------------------------ public API
    def generate(self, requests: list[Request], on_document: DocumentCallback | None = None) -> list[Answer]:
        """Answer every question of every request; a failing request yields answers with ``error``
        set and never affects the others. Answers follow the input order. With ``continuous`` (the
        default) the requests' rows go through one continuous decode batch (:mod:`pipeline.engine.continuous`).
        ``on_document(i, answers)``: called once per request as soon as all its answers are known,
        before this returns (:mod:`pipeline.engine.emitter`)."""
        if self.continuous:
            return self._generate(requests, 1, self._run_continuous, whole=True, on_document=on_document)[0]
        run = lambda rows, on_row=None: self._run_batch(rows, self.compressor)  # noqa: E731
        return self._generate(requests, 1, run, on_document=on_document)[0]

    @property
    def continuous(self) -> bool:
        """Whether :meth:`generate` admits documents one by one into the decode loop within the KV
        memory (``continuous``); otherwise a call's documents are prefilled together first."""
        return self.generation.continuous

    @property
    def kv_memory_bytes(self) -> int:
        """The continuous batch's KV memory: ``kv_memory`` MiB, else :func:`default_kv_memory`,
        decided once (the first time, after the model is loaded) and logged."""
        if self.generation.kv_memory is not None:
            return int(self.generation.kv_memory * 2**20)
        if self._kv_memory is None:
            self._kv_memory = default_kv_memory(self.device)
            logger.info("continuous decode batch: up to %.0f MiB of KV cache (default)", self._kv_memory / 2**20)
        return self._kv_memory

    def generate_sweep(self, requests: list[Request], compressions: list[CompressionConfig]) -> list[list[Answer]]:
        """Answers for several compression settings from ONE prefill per batch.

        Prefill attention does not depend on the method, so every layer's dense K/V are captured
        once and each setting compresses from them (results equal separate runs; ``compress_s`` is
        each setting's own, ``ttft_s`` = shared prefill + own compression + question prefill).
        Returns one answer list per setting, in input order, each answer's ``setting`` set.
        ``peak_memory_bytes`` reflects the sweep (the dense capture is held), not a single run.
        """
        if any(c.query_aware != self.compression.query_aware for c in compressions):
            raise ValueError("query_aware must be the same for the engine and every swept setting")
        compressors = [self.make_compressor(c) for c in compressions]
        return self._generate(requests, len(compressors), lambda rows: self._run_sweep_batch(rows, compressors))

    @torch.inference_mode()
    def compress_context(self, request: Request) -> VarLenCache:
        """Prefill and compress one request's context only and return the cache, so callers can
        inspect what was kept: ``cache.kept_positions(layer, 0, kv_head)`` gives the original token
        positions (0 = first context token after the chat-template head) held for that head."""
        return self.compress_contexts([request])

    @torch.inference_mode()
    def compress_contexts(self, requests: list[Request]) -> VarLenCache:
        """:meth:`compress_context` of several requests' contexts prefilled together as one left-padded
        batch (row b of the cache is request b's), as the batch path prefills them."""
        cache = self.new_cache(self.compressor)
        self.prefill([self._rows_for(request)[0] for request in requests], cache)
        return cache

    def new_cache(self, compressor: Compressor) -> VarLenCache:
        """An empty cache for this model, compressing with ``compressor``, on the engine's kernels."""
        return self.runner.new_cache(compressor)

    def prefill(self, rows: list[Row], cache: ChunkCache, passes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The context prefill and compression of ``rows`` into the empty ``cache`` by the plan its config
        chooses (:mod:`pipeline.engine.prefill`), KVzip's passes included unless ``passes`` is False.
        Returns (context lengths (B,), last logits (B, V))."""
        return self.context_prefill.run(rows, cache, passes)

    # ------------------------------------------------------------------ error isolation
    def _generate(
        self,
        requests: list[Request],
        variants: int,
        run: BatchRunner,
        whole: bool = False,
        on_document: DocumentCallback | None = None,
    ) -> list[list[Answer]]:
        """Batch rows (all of them at once when ``whole``), run ``run(rows) -> answers (variant-major,
        then row, then question)``, isolate failures to single documents, and return per-variant
        answer lists in input order; ``on_document`` (one variant only) hears each request's answers
        as soon as they are known (``run(rows, on_row)`` hands on rows as they finish)."""
        answers: dict[tuple[int, int, int], Answer] = {}
        rows: list[tuple[int, Row]] = []
        for i, request in enumerate(requests):
            try:
                rows.extend((i, row) for row in self._rows_for(request))
            except Exception as exc:  # bad input: report per question, keep going
                for v in range(variants):
                    for q, qid in enumerate(request.question_ids or ["0"]):
                        answers[(v, i, q)] = _error_answer(request, qid, exc)
        size = max(len(rows), 1) if whole or not self.generation.batch_size else self.generation.batch_size
        emitter = DocumentEmitter(on_document, rows, len(requests)) if on_document is not None else None
        for begin in range(0, len(rows), size):
            batch = rows[begin : begin + size]
            try:
                if emitter is None:
                    results = run([row for _, row in batch])
                else:
                    results = run([row for _, row in batch], emitter.row_callback(batch))
            except Exception:  # isolate the failing document(s); rows already handed on keep their answers
                self._release_memory()
                for item in batch:
                    known = emitter.answers_of(item) if emitter is not None else None
                    _store(answers, [item], known or self._run_alone(item[1], run, variants), variants)
            else:
                _store(answers, batch, results, variants)
            if emitter is not None:
                emitter.batch_done(batch, answers)
        if emitter is not None:
            emitter.finish(answers)
        return [[answers[key] for key in sorted(answers) if key[0] == v] for v in range(variants)]

    def _run_alone(self, row: Row, run: BatchRunner, variants: int) -> list[Answer]:
        try:
            return run([row])
        except Exception as exc:
            self._release_memory()
            if isinstance(exc, torch.OutOfMemoryError) and self.oom_retry is not None and variants == 1:
                cache_size, compressor = self.oom_retry
                try:
                    setting = Setting(self.compression.label, cache_size, None)
                    return self._run_batch([row], compressor, setting)
                except Exception as retry_exc:
                    self._release_memory()
                    exc = retry_exc
            qids = [row.request.question_ids[q] for q in row.question_indices]
            return [_error_answer(row.request, qid, exc) for _ in range(variants) for qid in qids]

    def _release_memory(self) -> None:
        self.runner.release_memory()

    # ------------------------------------------------------------------ one batch
    def _rows_for(self, request: Request) -> list[Row]:
        return rows_for(
            request,
            self.prompts,
            max_total_tokens=self.max_context_tokens,
            max_new_tokens=self.max_new_tokens_for(request),
            truncate=self.generation.truncate,
            query_aware=self.compression.query_aware,
        )

    def max_new_tokens_for(self, request: Request) -> int:
        return self.runner.max_new_tokens_for(request)

    @torch.inference_mode()
    def _run_batch(self, rows: list[Row], compressor: Compressor, setting: Setting | None = None) -> list[Answer]:
        """The rows prefilled together and decoded as one batch: a sweep of one setting, without
        fidelity (:mod:`pipeline.engine.sweep`); the answers' ``setting`` is ``setting``."""
        return SweepBatch(self.runner, rows, [compressor], settings=[setting], fidelity=False).run()

    def _run_continuous(
        self, rows: list[Row], on_row: Callable[[int, list[Answer]], None] | None = None
    ) -> list[Answer]:
        """Every row through one continuous decode batch; a row it could not answer runs alone.
        ``on_row(k, answers)`` hears each row's answers as soon as they are known."""
        batch = ContinuousBatch(self.runner, self.compressor, self.kv_memory_bytes, on_done=on_row)
        results = batch.run(rows)
        self.last_continuous = batch  # its occupancy and memory figures, for callers that report them
        answers = []
        for k, (row, result) in enumerate(zip(rows, results)):
            if isinstance(result, Exception):
                result = self._run_alone(row, lambda rows: self._run_batch(rows, self.compressor), 1)
                if on_row is not None:
                    on_row(k, result)
            answers += result
        return answers

    @torch.inference_mode()
    def _run_sweep_batch(self, rows: list[Row], compressors: list[Compressor]) -> list[Answer]:
        """Every setting from one prefill (:mod:`pipeline.engine.sweep`)."""
        return SweepBatch(self.runner, rows, compressors).run()


def _store(answers: dict, batch: list[tuple[int, Row]], results: list[Answer], variants: int) -> None:
    it = iter(results)
    for v in range(variants):
        for i, row in batch:
            for q in row.question_indices:
                answers[(v, i, q)] = next(it)


def _error_answer(request: Request, question_id: str, exc: Exception) -> Answer:
    return Answer(doc_id=request.doc_id, question_id=question_id, error=f"{type(exc).__name__}: {exc}")
