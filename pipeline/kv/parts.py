"""The three kinds of part a compression method is built from, and their registries' base types.

A method is ``scorer x allocation x selection`` (see ``docs/ARCHITECTURE.md``):

* a :class:`Scorer` turns one layer's prefill into base scores s (B, H_kv, n) float32, with
  ``+inf`` on the observation window (always kept, inside the budget) and ``-inf`` on padding
  (never keepable);
* an :class:`Allocation` decides how many entries each (row, KV head) keeps, (B, H_kv) long;
* a :class:`Selection` decides which entries fill each head's count, (B, H_kv, n) bool.

Each part is one small module with a class deriving from one of these, registered by name in
its package's ``__init__`` (``pipeline.kv.scorers.SCORERS`` ...). A part's own knobs are one typed
pydantic model assigned to ``options`` (knobs shared by several parts live on a small common model
the parts' options derive from, e.g. ``SinkOptions``); the part's methods receive an instance of
it (:meth:`Part.options_from`), never the whole config. :class:`pipeline.kv.config.CompressionConfig`
offers every registered knob on one flat surface (the command lines and YAML files), each declared
once, on the model that owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import torch
from pydantic import BaseModel

from .phases import Phase

if TYPE_CHECKING:  # annotations only
    from .kvzap_model import KVzapModel
    from .value_norms import NormStats, OutputProjection

#: positions (B, n) -> (cos, sin), each (B, n, D): the model's rotary embedding (HF half-split convention)
Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LayerContext:
    """One layer's prefill as the parts see it.

    key, value: (B, H_kv, n, D) post-RoPE; key_pos: (B, n) original positions, -1 on padding;
    lengths / row_budget / row_window: (B,) long (real tokens, kept entries per head and
    observation window of each row, see :func:`pipeline.kv.allocation.row_budgets`);
    observed: what the scorer's :meth:`Scorer.observe` kept of the prefill queries;
    projection(): the layer's W_O slices (float32, cached by the compressor);
    head_priors: (L, H_kv) HeadKV priors or None; kvzap: the learned scorer's weights and
    calibrated shares (:class:`~pipeline.kv.kvzap_model.KVzapModel`) or None;
    selection_weighs_values: the method's selection declares :attr:`Selection.weighs_by_value_norm`;
    scorer_weighs_values: the method's scorer declares :attr:`Scorer.weighs_by_value_norm`;
    known_norms: (B, H_kv, n) projected value norms already computed (NaN where not; a chunked
    prefill's held entries) or None; context_lengths: (B,) each row's whole context when the layer
    holds only part of it (a chunked prefill's chunk), else None (``lengths`` is the whole context).
    """

    layer_idx: int
    key: torch.Tensor
    value: torch.Tensor
    key_pos: torch.Tensor
    scaling: float
    lengths: torch.Tensor
    row_budget: torch.Tensor
    row_window: torch.Tensor
    observed: object
    projection: Callable[[], OutputProjection]
    head_priors: torch.Tensor | None = None
    kvzap: KVzapModel | None = None
    selection_weighs_values: bool = False
    scorer_weighs_values: bool = False
    known_norms: torch.Tensor | None = None
    context_lengths: torch.Tensor | None = None


@dataclass
class LayerInputs:
    """What a layer's prefill offers :meth:`Scorer.observe` besides its queries: the layer index,
    the attention input hidden states (B, n, hidden) when the scorer declares
    ``needs_hidden_states`` (else None), and the learned scorer's weights (or None)."""

    layer_idx: int
    hidden: torch.Tensor | None = None
    kvzap: KVzapModel | None = None


class Part:
    """Common to all parts: a registry name, optional knobs and a consistency check."""

    name: ClassVar[str]
    #: the part's knobs as one typed model, handed to its methods (:meth:`options_from`); None: no knobs
    options: ClassVar[type[BaseModel] | None] = None
    summary: ClassVar[str] = ""
    #: the engine must load per-head priors (HeadKV) and pass them as ``LayerContext.head_priors``
    needs_head_priors: ClassVar[bool] = False
    #: the engine must load a KVzap file (:mod:`pipeline.kv.kvzap_model`) for the compressor
    needs_kvzap_model: ClassVar[bool] = False
    #: when the part has what it needs to decide (:mod:`pipeline.kv.phases`): right after each
    #: layer's attention unless it says otherwise
    decides: ClassVar[Phase] = Phase.LAYER

    def check(self, config: BaseModel) -> None:
        """Raise ``ValueError`` when ``config`` (a :class:`~pipeline.kv.config.CompressionConfig`, which
        imports the registries, so it is not named here) cannot run with this part (default: nothing
        to check)."""

    def option_models(self) -> tuple[type[BaseModel], ...]:
        """The models that declare this part's knobs: its options model and the common models it
        derives from, each declaring at least one knob of its own."""
        if self.options is None:
            return ()
        return tuple(m for m in self.options.__mro__ if issubclass(m, BaseModel) and declared_knobs(m))

    def options_from(self, config: BaseModel) -> BaseModel | None:
        """This part's typed options, read from a config's knobs (None for a part without knobs)."""
        if self.options is None:
            return None
        return self.options.model_validate({name: getattr(config, name) for name in self.options.model_fields})


def declared_knobs(model: type[BaseModel]) -> list[str]:
    """The fields ``model`` declares itself (not inherited from another options model)."""
    inherited = {name for base in model.__bases__ if issubclass(base, BaseModel) for name in base.model_fields}
    return [name for name in model.model_fields if name not in inherited]


class Scorer(Part):
    """Base scores of context entries (see the module docstring for the conventions).

    A scorer that ``decides`` in ``Phase.PASSES`` (KVzip) cannot score from the prefill alone: its
    ``observed`` is filled after the prefill by the engine's context-reconstruction passes
    (:mod:`pipeline.engine.reconstruction`), so compression waits for every layer.
    """

    #: ``observe`` reads each layer's attention input (``LayerInputs.hidden``), recorded by the cache
    needs_hidden_states: ClassVar[bool] = False
    #: ``observe`` can run on consecutive slices of a layer's queries, merged by :meth:`merge_observed`
    #: (a layer-by-layer prefill, :mod:`pipeline.kv.prefill.layer_by_layer`)
    observes_in_slices: ClassVar[bool] = True
    #: the scores already weigh each entry by its projected value norm ``||W_O v_i||`` (KVzap's predicted
    #: KVzip+ scores); CriticalKV's default stage-1 ratio reads it (``LayerContext``)
    weighs_by_value_norm: ClassVar[bool] = False

    def observed_queries(self, window: int, options: BaseModel | None) -> int:
        """How many of the last prefill queries :meth:`observe` keeps (0: none); window: the
        method's observation window (tokens)."""
        return 0

    def observe(
        self,
        query: torch.Tensor,
        key_pos: torch.Tensor,
        options: BaseModel | None,
        window: int,
        rotary: Rotary | None = None,
        inputs: LayerInputs | None = None,
    ) -> object:
        """What the scorer needs of the prefill queries, kept while the layer's attention runs.

        query: (B, H_q, n, D) post-RoPE; options: this scorer's knobs; window: the observation window
        (tokens); rotary: the model's RoPE (cos, sin) at given positions, for
        scorers that need pre-RoPE queries; inputs: the layer index, hidden states and learned
        weights (:class:`LayerInputs`). Default: the last :meth:`observed_queries` queries (a
        view) or None. Called once per layer; a compression sweep keeps the result of every setting.
        """
        tail = self.observed_queries(window, options)
        return query[:, :, -tail:] if tail else None

    def merge_observed(self, earlier: object, later: object, window: int, options: BaseModel | None) -> object:
        """What :meth:`observe` returns for two consecutive slices of a layer's queries together, from
        what it returned for each. Default: the last :meth:`observed_queries` queries of both."""
        tail = self.observed_queries(window, options)
        return torch.cat([earlier, later], dim=2)[:, :, -tail:] if tail else None

    def score(self, ctx: LayerContext, options: BaseModel | None) -> torch.Tensor:
        """(B, H_kv, n) float32 base scores; options: this scorer's knobs (:attr:`Part.options`)."""
        raise NotImplementedError


class Allocation(Part):
    """Per-head counts (never which entries).

    ``decides = Phase.LAYER``: :meth:`head_budgets` decides one layer from its own scores, right after
    its prefill attention. ``Phase.PREFILL``: :meth:`model_head_budgets` needs every layer's scores
    (a cross-layer budget), so the dense cache is held until the prefill (or the chunk) ends.
    """

    def head_budgets(self, scores: torch.Tensor, ctx: LayerContext, options: BaseModel | None) -> torch.Tensor:
        """scores: (B, H_kv, n) base scores -> (B, H_kv) long kept entries per head; options: this
        allocation's knobs."""
        raise NotImplementedError

    #: a ``Phase.PREFILL`` allocation whose counts from the first layers' scores (:meth:`prefix_head_budgets`)
    #: never fall below what those layers finally keep, so the cache can compress each layer as it comes
    #: and shrink earlier ones later (:mod:`pipeline.kv.prefill.streamed_budgets`) instead of holding the dense cache
    streams: ClassVar[bool] = False

    def model_head_budgets(
        self, scores: list[torch.Tensor], contexts: list[LayerContext], options: BaseModel | None
    ) -> list[torch.Tensor]:
        """Every layer's counts from every layer's scores (list of (B, H_kv, n)) -> list of (B, H_kv)."""
        return [self.head_budgets(s, ctx, options) for s, ctx in zip(scores, contexts)]

    def prefix_head_budgets(
        self, scores: list[torch.Tensor], contexts: list[LayerContext], num_layers: int, options: BaseModel | None
    ) -> list[torch.Tensor]:
        """Counts of the first ``len(scores)`` of ``num_layers`` layers from their scores alone (an
        allocation that :attr:`streams`): each at least what :meth:`model_head_budgets` gives that layer
        once every layer is scored, and equal to it when ``len(scores) == num_layers``."""
        raise NotImplementedError(f"allocation {self.name!r} does not stream across layers")


class Selection(Part):
    """Which entries fill each head's count."""

    #: True when the selection weighs scores by the entries' projected value norms itself (CriticalKV);
    #: a scorer that would weigh by the value norm leaves it to the selection then (``LayerContext``)
    weighs_by_value_norm: ClassVar[bool] = False
    #: choosing ``b' <= b`` entries from the ``b`` this selection chose gives what it chooses at ``b'``
    #: from all of them (given the same scores), so a count that only falls can be applied in steps
    nested: ClassVar[bool] = False

    def select(
        self,
        scores: torch.Tensor,
        head_budget: torch.Tensor,
        ctx: LayerContext,
        options: BaseModel | None,
        stats: NormStats,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """options: this selection's knobs. Returns (keep (B, H_kv, n) bool, projected value norms
        (B, H_kv, n) float32 with NaN where not computed, or None when the selection computes none)."""
        raise NotImplementedError


P = TypeVar("P", bound=Part)


class Registry(Mapping[str, P], Generic[P]):
    """Name -> part, in registration order; unknown names fail with the list of known ones."""

    def __init__(self, kind: str, parts: list[P]) -> None:
        self.kind = kind
        self._parts: dict[str, P] = {}
        for part in parts:
            if part.name in self._parts:
                raise ValueError(f"{kind} {part.name!r} registered twice")
            if "-" in part.name:
                raise ValueError(f"{kind} name {part.name!r}: '-' separates parts in method names")
            self._parts[part.name] = part

    def __getitem__(self, name: str) -> P:
        try:
            return self._parts[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self._parts)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._parts

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)
