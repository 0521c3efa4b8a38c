"""``CompressionConfig``: which parts compress the context's KV cache and with which knobs.

A method is ``scorer x allocation x selection`` (:mod:`pipeline.kv.parts`). Its user-facing spelling,
printed in the ``method`` column of every output row and accepted as ``method=`` / ``--method``, is

    [SELECTION-][ALLOCATION-]SCORER        e.g. snapkv, adakv-snapkv, criticalkv-headkv-snapkv

where the default selection (``topk``) and allocation (``uniform``) are left out, and ``none``
keeps the full cache. Every combination the registries allow is valid; ``method_names()`` lists
them. The part knobs are not declared here: each lives on the part's own typed ``options`` model
(``kernel`` on SnapKV, ``epsilon`` on CriticalKV ...), which the part's methods receive
(:meth:`~pipeline.kv.parts.Part.options_from`); this config offers every registered knob on one flat
surface, for the command lines and YAML files, so that a knob is set the same way whichever method uses it.

The config is composed of small models, so that a job takes only the part that applies to it:
:class:`MethodChoice` (the parts and the budget) + :class:`ScoringKnobs` (the window and every part's
knobs; the perturbation diagnostics) + :class:`CacheKnobs` (decode-time cap, question placement,
chunked prefill); :class:`CompressionKnobs` = the two knob models, what a sweep shares across its settings.

Budgets: ``cache_size`` is the kept fraction of each row's own context length (0.2 keeps 20 %, as
the paper's "cache size"); ``budget`` (tokens per KV head) overrides it when given. The observation
window sits inside the budget; when a row is so short that its budget is smaller than the window,
the window shrinks to the budget for that row.
"""

from __future__ import annotations

import itertools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from .allocation import ALLOCATIONS
from .parts import declared_knobs
from .phases import Phase, method_phase
from .prefill.rules import config_refusal
from .scorers import SCORERS
from .selection import SELECTIONS

FULL_CACHE = "none"
DEFAULT_ALLOCATION = "uniform"
DEFAULT_SELECTION = "topk"
PART_FIELDS = ("scorer", "allocation", "selection")


def parse_method(method: str) -> dict[str, str]:
    """``'criticalkv-adakv-snapkv'`` -> ``{'scorer': 'snapkv', 'allocation': 'adakv', 'selection': 'criticalkv'}``."""
    text = method.strip().lower()
    if text == FULL_CACHE:
        return {"scorer": FULL_CACHE, "allocation": DEFAULT_ALLOCATION, "selection": DEFAULT_SELECTION}
    *prefix, scorer = text.split("-")
    parts = {"scorer": scorer, "allocation": DEFAULT_ALLOCATION, "selection": DEFAULT_SELECTION}
    expected = "[selection-][allocation-]scorer"
    for token in prefix:
        kind = "selection" if token in SELECTIONS else "allocation" if token in ALLOCATIONS else None
        if kind is None or parts[kind] != (DEFAULT_SELECTION if kind == "selection" else DEFAULT_ALLOCATION):
            raise ValueError(
                f"method {method!r}: {token!r} is not a selection or allocation in {expected} order "
                f"(selections: {', '.join(SELECTIONS)}; allocations: {', '.join(ALLOCATIONS)})"
            )
        if kind == "selection" and parts["allocation"] != DEFAULT_ALLOCATION:
            raise ValueError(f"method {method!r}: the selection comes first ({expected})")
        parts[kind] = token
    if scorer not in SCORERS:
        raise ValueError(f"method {method!r}: unknown scorer {scorer!r}; choose one of {', '.join(SCORERS)}")
    return parts


def method_name(scorer: str, allocation: str = DEFAULT_ALLOCATION, selection: str = DEFAULT_SELECTION) -> str:
    """The spelling of a part combination (inverse of :func:`parse_method`)."""
    if scorer == FULL_CACHE:
        return FULL_CACHE
    prefix = [p for p, default in ((selection, DEFAULT_SELECTION), (allocation, DEFAULT_ALLOCATION)) if p != default]
    return "-".join([*prefix, scorer])


def method_names() -> list[str]:
    """Every valid method name: ``none`` and each scorer x allocation x selection."""
    combos = itertools.product(SELECTIONS, ALLOCATIONS, SCORERS)
    return [FULL_CACHE] + [method_name(sc, al, se) for se, al, sc in combos]


class MethodChoice(BaseModel):
    """Which method compresses and how much it keeps (the parts and the budget); a sweep sets these per
    setting, so its own config holds only :class:`CompressionKnobs`."""

    scorer: str = Field(
        FULL_CACHE,
        description=f"base scores per entry: {FULL_CACHE} (keep the full cache) or one of {', '.join(SCORERS)}",
    )
    allocation: str = Field(
        DEFAULT_ALLOCATION, description=f"how many entries each KV head keeps: one of {', '.join(ALLOCATIONS)}"
    )
    selection: str = Field(
        DEFAULT_SELECTION, description=f"which entries fill each head's count: one of {', '.join(SELECTIONS)}"
    )
    cache_size: float = Field(1.0, gt=0.0, le=1.0, description="kept fraction of each context (0.2 keeps 20%)")
    budget: int | None = Field(None, ge=1, description="kept tokens per KV head (overrides cache_size)")
    variant: str | None = Field(
        None,
        description="the knob overrides of a swept variant, as its label spells them (set by the sweep)",
        json_schema_extra={"cli": False},
    )


class CacheKnobs(BaseModel):
    """How the compressed cache is built and held: the question's place, the decode-time cap, the
    chunked prefill. (The prefill-time diagnostics of ``jobs/perturbation.py`` take none of these.)"""

    max_cache_tokens: int | None = Field(None, ge=1, description="decode-time cap of entries per KV head")
    query_aware: bool = Field(False, description="compress with the question inside the observation window")
    prefill_chunk: int | None = Field(
        None,
        ge=1,
        description="prefill the context this many tokens at a time, compressing the cache after each "
        "chunk (peak memory: the compressed cache + one chunk); none: the whole context in one pass",
    )
    chunk_budget: Literal["final", "running"] = Field(
        "final",
        description="what a chunked prefill keeps after each chunk: final: up to the document's final budget "
        "(known before the prefill; the kept set a one-pass prefill would choose for scorers that score an "
        "entry alone, such as kvzap and knorm); running: the kept fraction of the tokens seen so far "
        "(less memory while the early chunks go through, at some cost in quality)",
    )


#: knobs of the configs themselves (not of a part), in the order the help lists them
CORE_FIELDS = (*MethodChoice.model_fields, "window", *CacheKnobs.model_fields)


def _part_options() -> tuple[type[BaseModel], ...]:
    """Every model that declares registered parts' knobs, once each, in registration order; a knob
    name declared by two models (or by the configs themselves) fails here."""
    models = list(
        dict.fromkeys(m for reg in (SCORERS, ALLOCATIONS, SELECTIONS) for p in reg.values() for m in p.option_models())
    )
    seen: dict[str, str] = {}
    for model in models:
        for name in declared_knobs(model):
            if name in seen or name in CORE_FIELDS:
                raise TypeError(f"knob {name!r} of {model.__name__} is also declared by {seen.get(name, 'the core')}")
            seen[name] = model.__name__
    return tuple(models)


def _knob_bases() -> tuple[type[BaseModel], ...]:
    """The knob models as bases of one class: a model that another derives from comes after it."""
    return tuple(sorted(_part_options(), key=lambda model: -len(model.__mro__)))


# lays out its own command line (option_groups, cli_aliases: the protocol of pipeline.options.CommandLineConfig,
# which this core does not import); its docstring is the title of its help group
class ScoringKnobs(*_knob_bases()):
    """KV-cache compression"""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    window: int = Field(32, ge=1, description="observation window: the last context tokens, always kept")

    def setting(self, method: str, cache_size: float, **updates) -> CompressionConfig:
        """The validated :class:`CompressionConfig` of ``method`` at ``cache_size`` with these knobs
        (of a whole config, its knobs only: the method and budget are the arguments)."""
        knobs = self.model_dump(include=set(type(self).model_fields) - set(MethodChoice.model_fields))
        return CompressionConfig.model_validate({**knobs, "method": method, "cache_size": cache_size, **updates})

    @classmethod
    def cli_aliases(cls) -> dict:
        """Flags that are not fields (none here; :class:`CompressionConfig` has ``--method``)."""
        return {}

    @classmethod
    def option_groups(cls) -> list[tuple[str, list[str]]]:
        """(title, field names): the config's own fields first, then each part's knobs (CLI help)."""
        groups = [(ScoringKnobs.__doc__ or "", [name for name in CORE_FIELDS if name in cls.model_fields])]
        for model in _part_options():
            groups.append(((model.__doc__ or model.__name__).strip(), declared_knobs(model)))
        return groups


class CompressionKnobs(ScoringKnobs, CacheKnobs):
    """KV-cache compression"""


class CompressionConfig(MethodChoice, CompressionKnobs):
    """How the context's KV cache is compressed (see the module docstring).

    Construct with the parts (``scorer=``, ``allocation=``, ``selection=``) or with their
    spelling ``method=``; a bad value fails at construction with a pydantic ``ValidationError``
    whose location names the field.
    """

    @model_validator(mode="before")
    @classmethod
    def _method_to_parts(cls, data: object) -> object:
        if not isinstance(data, dict) or data.get("method") is None:
            return data
        data = dict(data)
        try:
            parsed = parse_method(str(data.pop("method")))
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        for name, value in parsed.items():
            given = data.get(name)
            if given is not None and str(given).strip().lower() != value:
                raise ValueError(
                    f"method {method_name(**parsed)!r} has {name} {value!r}, but {name}={given!r} was given"
                )
            data[name] = value
        return data

    @model_validator(mode="after")
    def _consistent(self) -> CompressionConfig:
        if self.scorer != FULL_CACHE:
            SCORERS[self.scorer]  # noqa: B018 - raises naming the known scorers
        elif (self.allocation, self.selection) != (DEFAULT_ALLOCATION, DEFAULT_SELECTION):
            raise ValueError(f"scorer {FULL_CACHE!r} keeps the full cache; allocation and selection do not apply")
        for part in self.parts():
            part.check(self)
        if self.budget is not None and self.compresses and self.budget < self.window:
            raise ValueError(
                f"budget ({self.budget} tokens per head) is smaller than the observation window "
                f"({self.window}); the window is always kept and counts inside the budget"
            )
        refusal = config_refusal(self)  # the prefill's rules (pipeline.kv.prefill.rules)
        if refusal is not None:
            raise ValueError(refusal)
        if self.max_cache_tokens is not None and self.max_cache_tokens <= self.window:
            raise ValueError(
                f"max_cache_tokens ({self.max_cache_tokens}) must exceed the window ({self.window}),"
                " which is never evicted"
            )
        return self

    @computed_field(description="the method's spelling, [selection-][allocation-]scorer or none")
    @property
    def method(self) -> str:
        return method_name(self.scorer, self.allocation, self.selection)

    @property
    def label(self) -> str:
        """The output's ``method`` column: the spelling, plus ``[knob=value,...]`` for a sweep variant."""
        return self.method if self.variant is None else f"{self.method}[{self.variant}]"

    def with_method(self, method: str | None = None, **updates) -> CompressionConfig:
        """A validated copy with another method (its spelling) and/or other field values."""
        data = self.model_dump(exclude={"method", *PART_FIELDS} if method is not None else {"method"})
        if method is not None:
            data["method"] = method
        return CompressionConfig.model_validate({**data, **updates})

    def parts(self) -> list:
        """The registered parts this config uses (the scorer only when it is not ``none``)."""
        if self.scorer == FULL_CACHE:
            return []
        return [SCORERS[self.scorer], ALLOCATIONS[self.allocation], SELECTIONS[self.selection]]

    @property
    def compresses(self) -> bool:
        return self.scorer != FULL_CACHE and (self.cache_size < 1.0 or self.budget is not None)

    @property
    def needs_head_priors(self) -> bool:
        return any(part.needs_head_priors for part in self.parts())

    @property
    def chunked(self) -> bool:
        """The context is prefilled chunk by chunk with compression after each (``prefill_chunk``)."""
        return self.prefill_chunk is not None and self.compresses

    @property
    def needs_kvzap_model(self) -> bool:
        return any(part.needs_kvzap_model for part in self.parts())

    @property
    def phase(self) -> Phase:
        """When this method decides what is kept (:mod:`pipeline.kv.phases`); ``LAYER`` when it keeps
        the full cache."""
        return method_phase(self.parts()) if self.compresses else Phase.LAYER

    @classmethod
    def cli_aliases(cls) -> dict:
        """``--method``: the parts in one word, as the output's ``method`` column spells them."""
        return {
            "method": (
                str,
                "the method as one word, [selection-][allocation-]scorer (e.g. criticalkv-adakv-"
                "snapkv) or none; sets --scorer, --allocation and --selection",
                parse_method,
            )
        }


#: The product's default compression, for the batch jobs and ``pipeline.generate`` alike; chosen by
#: measurement (docs/results/template-protection/README.md, "The default"): the learned one-pass scorer
#: keeps 0.89-0.94x of the full cache's RULER score at 0.4 with a plain prefill's time, where KVzip's
#: passes (``criticalkv-layer-kvzip``, the best answers) cost 4x on CPU and 12-26x on a GPU. A model
#: without a shipped KVzap file is calibrated by the batch job on its own documents (``--calibrate``).
DEFAULT_METHOD = "criticalkv-shares-kvzap"
DEFAULT_CACHE_SIZE = 0.4


def default_compression() -> CompressionConfig:
    """The product's default compression (see :data:`DEFAULT_METHOD`)."""
    return CompressionConfig(method=DEFAULT_METHOD, cache_size=DEFAULT_CACHE_SIZE)
