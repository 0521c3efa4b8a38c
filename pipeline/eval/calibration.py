"""HeadKV calibration: per-head retrieval scores from needle copy tests.

HeadKV (Fu et al., arXiv 2410.19258; FYYFU/HeadKV) gives each attention head a static share of the
KV budget in proportion to an importance score estimated offline. The plain ("retrieval") variant
uses the retrieval score of Wu et al. (arXiv 2404.15574): while the model copies a needle out of a
long haystack, a head scores a hit at a copy step when its most attended position is the needle
token being copied.

Recipe implemented here (all offline, seeded):

* **Cases.** For each context length in ``lengths``, each depth in ``depths`` (percent of the
  haystack, at a sentence boundary) and ``samples`` draws, a needle
  ``"The special magic {number|word} for {key} is: {value}."`` (RULER-style random key and value:
  a 7-digit number or an adjective-noun word) is put into a Paul Graham essay haystack (or RULER's
  noise haystack) fitted to the length with the model's tokenizer. The prompt is encoded as the
  engine encodes it (:class:`~pipeline.engine.prompts.PromptBuilder`: chat template, context, then
  question + answer prefix ``"The special magic ... for {key} is:"``), and the needle's value
  tokens, exactly as tokenised inside the context, are appended: the copy is *teacher-forced*.
* **Attention.** One forward per case with the recording attention
  (:func:`pipeline.kv.attention.registered.register_recording`, scoped to the run): ordinary causal SDPA for
  the output, plus, for the copy queries only (the positions whose next token is value
  token j), the argmax over keys of each query head's attention logits (= of its attention
  weights) -- :func:`top_attended_positions`.
* **Score.** Per case and head, :func:`retrieval_hits`: the fraction of the J copy steps at which the
  top position is ``needle_start + j`` (``match="position"``, the needle token being copied), or,
  with ``match="token"`` (Wu et al.'s criterion), any needle position holding the same token id.
  The head's retrieval score is the mean over cases, in [0, 1]; no further normalisation (HeadKV's
  budget rule in :func:`pipeline.kv.allocation.headkv.headkv_head_budgets` normalises by the sum).
* **Output.** :func:`priors_document`: ``{"model", "method": "retrieval", "num_layers", "num_heads",
  "num_kv_heads", "scores": [[...] * num_heads] * num_layers, "settings": {...}}``, scores per
  *query* head; :func:`pipeline.engine.priors.load_head_priors` averages them per KV group.

HeadKV's retrieval-reasoning variant (attention mass of the top-k positions on reasoning needles)
is not implemented. Shipped files live in ``pipeline/resources/headkv/``
(:func:`pipeline.engine.priors.shipped_priors`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.prompts import SEPARATOR, PromptBuilder
from ..kv.attention.registered import register_recording
from .ruler import fit_size
from .ruler_data import NOISE_HAYSTACK, essay_words, random_value, random_word, split_sentences
from .ruler_tasks import insert_after_sentences

KIND_NAMES = {"numbers": "number", "words": "word"}
MATCHES = ("position", "token")


# --------------------------------------------------------------------------- pure scoring


def top_attended_positions(
    query: torch.Tensor, key: torch.Tensor, query_pos: torch.Tensor, scaling: float, key_pos: torch.Tensor | None = None
) -> torch.Tensor:
    """Most attended key position of every query head.

    query: (H_q, S, D); key: (H_kv, N, D); query_pos: (S,) positions of the queries; key_pos: (N,)
    (default ``arange(N)``); key j is visible to query s iff key_pos[j] <= query_pos[s].
    Returns (H_q, S) long: ``key_pos`` of the argmax of the softmax attention (= of the logits).
    """
    h_q, s, dim = query.shape
    h_kv, n, _ = key.shape
    groups = h_q // h_kv
    key_pos = torch.arange(n, device=key.device) if key_pos is None else key_pos.to(key.device)
    logits = torch.einsum("kgsd,knd->kgsn", query.float().reshape(h_kv, groups, s, dim), key.float()) * scaling
    visible = key_pos[None, :] <= query_pos.to(key.device)[:, None]
    top = logits.masked_fill(~visible, float("-inf")).argmax(-1).reshape(h_q, s)
    return key_pos[top]


def retrieval_hits(
    top: torch.Tensor, needle_start: int, input_ids: Sequence[int] | torch.Tensor, match: str = "position"
) -> torch.Tensor:
    """Retrieval score of one case: fraction of copy steps that hit the needle.

    top: (..., J) top attended position at copy step j (the step that produces needle token j,
    which sits at ``needle_start + j`` in ``input_ids``). ``match="position"``: hit iff
    ``top == needle_start + j``; ``match="token"``: hit iff ``top`` lies in the needle span and
    ``input_ids[top] == input_ids[needle_start + j]`` (Wu et al.). Returns (...) float in [0, 1].
    """
    if match not in MATCHES:
        raise ValueError(f"match must be one of {MATCHES}, got {match!r}")
    steps = top.shape[-1]
    target_pos = needle_start + torch.arange(steps, device=top.device)
    if match == "position":
        hits = top == target_pos
    else:
        ids = torch.as_tensor(input_ids, device=top.device)
        in_span = (top >= needle_start) & (top < needle_start + steps)
        hits = in_span & (ids[top.clamp(0, ids.numel() - 1)] == ids[target_pos])
    return hits.float().mean(-1)


# --------------------------------------------------------------------------- needle cases


@dataclass
class NeedleCase:
    """One teacher-forced copy test. ``input_ids[copy_start + j]`` (the forced copy) equals
    ``input_ids[needle_start + j]`` (the needle in the context) for j < ``needle_len``."""

    case_id: str
    input_ids: list[int]
    needle_start: int
    needle_len: int
    copy_start: int
    length: int
    depth: float
    kind: str

    @property
    def query_positions(self) -> list[int]:
        """Positions whose next-token prediction is a copy step (the step's query)."""
        return list(range(self.copy_start - 1, self.copy_start - 1 + self.needle_len))


def _haystack_words(haystack: str) -> list[str]:
    if haystack == "essay":
        return list(essay_words())
    if haystack == "noise":
        return NOISE_HAYSTACK.split(" ") * 2000
    raise ValueError(f"haystack must be 'essay' or 'noise', got {haystack!r}")


def _insert(words: list[str], start: int, size: int, needle: str, depth: float) -> str:
    text = " ".join(words[start : start + size])
    sents = split_sentences(text)
    return insert_after_sentences(sents, [needle], [round(len(sents) * depth / 100.0)])


def _fitted_context(
    ids: Callable[[str], list[int]],
    pool: list[str],
    start: int,
    intro: str,
    needle: str,
    depth: float,
    question_tokens: int,
    length: int,
) -> str:
    """The longest ``intro + haystack-with-needle`` whose tokens plus the question's fit ``length``."""
    contexts: dict[int, str] = {}

    def measure(size: int) -> int:
        contexts[size] = intro + _insert(pool, start, size, needle, depth)
        return len(ids(contexts[size])) + question_tokens

    size = fit_size(measure, length, 1)
    return contexts[size] if size in contexts else intro + _insert(pool, start, size, needle, depth)


def _subsequence_at(haystack: list[int], needle: list[int], hint: int) -> int:
    if haystack[hint : hint + len(needle)] == needle:
        return hint
    for i in range(len(haystack) - len(needle), -1, -1):
        if haystack[i : i + len(needle)] == needle:
            return i
    raise ValueError("context tokens not found inside the encoded prompt")


def build_cases(
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int = 0,
    kinds: Sequence[str] = ("numbers", "words"),
    haystack: str = "essay",
    use_chat_template: bool = True,
) -> list[NeedleCase]:
    """Needle copy cases for every (length, depth, sample); needle kinds alternate case by case.

    ``lengths``: target tokens of context + question (the haystack is fitted with the tokenizer);
    ``depths``: needle depth in percent of the haystack's sentences.
    """
    for kind in kinds:
        if kind not in KIND_NAMES:
            raise ValueError(f"needle kind must be one of {sorted(KIND_NAMES)}, got {kind!r}")
    if samples < 1 or not lengths or not depths:
        raise ValueError("need at least one length, one depth and one sample")
    words = _haystack_words(haystack)
    maker = _CaseMaker(tokenizer, PromptBuilder(tokenizer, use_chat_template), words)
    cases = []
    for length in lengths:
        for d_index, depth in enumerate(depths):
            for i in range(samples):
                rng = random.Random(f"headkv/{seed}/{length}/{depth}/{i}")
                kind = kinds[(d_index * samples + i) % len(kinds)]
                case = maker.make(rng, kind, length, depth)
                case.case_id = f"headkv-{length}-d{depth:g}-s{seed}-{i:03d}"
                cases.append(case)
    return cases


class _CaseMaker:
    """One needle case: a fitted haystack with the needle, the prompt, the teacher-forced copy."""

    def __init__(self, tokenizer, builder: PromptBuilder, words: list[str]) -> None:
        self.tokenizer, self.builder, self.words = tokenizer, builder, words
        self.pool = words + words  # a haystack may start near the end: wrap around
        self.sep_len = len(self.ids(SEPARATOR))

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def make(self, rng: random.Random, kind: str, length: int, depth: float) -> NeedleCase:
        name = KIND_NAMES[kind]
        key, value = random_word(rng), random_value(rng, kind)
        lead = f"The special magic {name} for {key} is: "
        needle = f"{lead}{value}."
        intro = f"A special magic {name} is hidden within the following text. Make sure to memorize it.\n"
        question = f"What is the special magic {name} for {key} mentioned in the provided text?"
        start = rng.randrange(max(1, len(self.words) // 2))
        context = _fitted_context(self.ids, self.pool, start, intro, needle, depth, len(self.ids(question)), length)
        enc = self.tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
        body, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        v_begin = context.index(needle) + len(lead)
        v_end = v_begin + len(value)
        # scored: tokens overlapping the value; forced: from the token holding the space
        # before it, so the answer continues "...is:" as the needle does ("is: 1234567")
        scored = [j for j, (a, b) in enumerate(offsets) if b > v_begin and a < v_end]
        forced = [j for j, (a, b) in enumerate(offsets) if b > v_begin - 1 and a < v_end]
        prompt = self.builder.encode(context, [question], f"The special magic {name} for {key} is:")
        body_at = _subsequence_at(prompt.context_ids, body, len(prompt.context_ids) - self.sep_len - len(body))
        copy = body[forced[0] : forced[-1] + 1]
        input_ids = prompt.context_ids + prompt.question_ids[0] + copy
        return NeedleCase(
            case_id="",
            input_ids=input_ids,
            needle_start=body_at + scored[0],
            needle_len=len(scored),
            copy_start=len(input_ids) - len(copy) + scored[0] - forced[0],
            length=length,
            depth=float(depth),
            kind=kind,
        )


# --------------------------------------------------------------------------- running the model


class _TopRecorder:
    def __init__(self, query_positions: torch.Tensor) -> None:
        self.query_positions = query_positions
        self.top: dict[int, torch.Tensor] = {}

    def on_layer(self, module, query, key, value, scaling) -> None:
        if query.shape[0] != 1:
            raise ValueError("calibration runs one case at a time (batch 1)")
        pos = self.query_positions
        self.top[module.layer_idx] = top_attended_positions(query[0, :, pos], key[0], pos, scaling).cpu()


@dataclass
class CalibrationResult:
    """``scores``: (L, H_q) float64 retrieval scores (mean over cases); ``per_case``: (cases, L, H_q);
    ``copy_accuracy``: per case, fraction of copy steps where the model's own argmax is the needle token."""

    scores: torch.Tensor
    per_case: torch.Tensor
    copy_accuracy: list[float]
    cases: list[NeedleCase]
    match: str
    seconds: float


@torch.inference_mode()
def score_case(model: torch.nn.Module, case: NeedleCase, match: str = "position") -> tuple[torch.Tensor, float]:
    """(L, H_q) retrieval hits of one case and the model's copy accuracy on it."""
    device = next(model.parameters()).device
    ids = torch.tensor(case.input_ids, dtype=torch.long, device=device)[None]
    qpos = torch.tensor(case.query_positions, dtype=torch.long, device=device)
    recorder = _TopRecorder(qpos)
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(register_recording())
        out = model.base_model(
            input_ids=ids,
            position_ids=torch.arange(ids.shape[1], device=device)[None],
            use_cache=False,
            attention_recorder=recorder,
        )
    finally:
        model.set_attn_implementation(previous)
    top = torch.stack([recorder.top[i] for i in range(model.config.num_hidden_layers)])  # (L, H_q, J)
    hits = retrieval_hits(top, case.needle_start, case.input_ids, match).double()
    predicted = model.get_output_embeddings()(out.last_hidden_state[0, qpos]).argmax(-1)
    targets = ids[0, case.copy_start : case.copy_start + case.needle_len]
    return hits, float((predicted == targets).float().mean())


def calibrate(
    model: torch.nn.Module,
    cases: Sequence[NeedleCase],
    match: str = "position",
    progress: Callable[[str], None] | None = None,
) -> CalibrationResult:
    """Run every case and average the per-head retrieval scores."""
    if not cases:
        raise ValueError("no calibration cases")
    t0 = time.perf_counter()
    per_case, accuracy = [], []
    for i, case in enumerate(cases):
        hits, acc = score_case(model, case, match)
        per_case.append(hits)
        accuracy.append(acc)
        if progress is not None:
            progress(
                f"[{i + 1}/{len(cases)}] {case.case_id}: {len(case.input_ids)} tokens, copy accuracy {acc:.2f}, "
                f"best head {float(hits.max()):.2f}"
            )
    stacked = torch.stack(per_case)
    return CalibrationResult(stacked.mean(0), stacked, accuracy, list(cases), match, time.perf_counter() - t0)


def priors_document(model_name: str, config, result: CalibrationResult, settings: dict | None = None) -> dict:
    """The JSON object :func:`pipeline.engine.priors.load_head_priors` reads (see module docstring)."""
    num_layers, num_heads = result.scores.shape
    if num_layers != config.num_hidden_layers or num_heads != config.num_attention_heads:
        raise ValueError(f"scores {tuple(result.scores.shape)} do not match the model's layers x query heads")
    lengths = sorted({c.length for c in result.cases})
    by_length = {
        str(n): round(
            sum(a for a, c in zip(result.copy_accuracy, result.cases) if c.length == n)
            / sum(1 for c in result.cases if c.length == n),
            4,
        )
        for n in lengths
    }
    info = {
        "score": "fraction of teacher-forced copy steps at which the head's top-1 attended position is the "
        + (
            "needle token being copied"
            if result.match == "position"
            else "needle span position holding the copied token id"
        ),
        "match": result.match,
        "lengths": lengths,
        "depths": sorted({c.depth for c in result.cases}),
        "kinds": sorted({c.kind for c in result.cases}),
        "cases": len(result.cases),
        "input_tokens_mean": round(sum(len(c.input_ids) for c in result.cases) / len(result.cases), 1),
        "needle_tokens_mean": round(sum(c.needle_len for c in result.cases) / len(result.cases), 2),
        "copy_accuracy": round(sum(result.copy_accuracy) / len(result.copy_accuracy), 4),
        "copy_accuracy_by_length": by_length,
        "seconds": round(result.seconds, 1),
        "teacher_forced": True,
    }
    info.update(settings or {})
    return {
        "model": model_name,
        "method": "retrieval",
        "num_layers": int(num_layers),
        "num_heads": int(num_heads),
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or num_heads),
        "scores": [[round(float(v), 6) for v in row] for row in result.scores],
        "settings": info,
    }


def write_priors(path: str | Path, document: dict) -> Path:
    """Write the priors JSON (parent folders created), one layer of scores per line."""
    parts = []
    for key, value in document.items():
        if key == "scores":
            rows = ",\n  ".join(json.dumps(row) for row in value)
            parts.append(f' "scores": [\n  {rows}\n ]')
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + ",\n".join(parts) + "\n}\n")
    return path
