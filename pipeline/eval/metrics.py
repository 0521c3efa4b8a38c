"""Answer-quality metrics of RULER and LongBench, dependency-free.

Every metric has the signature ``metric(prediction: str, references: str | Sequence[str], **kwargs)
-> float`` and returns a score in ``[0, 1]`` (RULER and LongBench report 100 x the mean over rows).
A single reference string is accepted in place of a list; an empty reference list is a data error
(:class:`ValueError`).

RULER (arXiv 2404.06654; https://github.com/NVIDIA/RULER, ``scripts/eval/synthetic/constants.py``):

* :func:`string_match_all` -- fraction of the references contained in the prediction, case-
  insensitively (all synthetic tasks: niah, vt, cwe, fwe).
* :func:`string_match_part` -- 1.0 when any reference is contained (qa tasks).

LongBench (Bai et al., arXiv 2308.14508; https://github.com/THUDM/LongBench, ``LongBench/metrics.py``
and ``eval.py``): every metric is computed against each reference and the maximum is kept, as
LongBench's ``scorer`` does.

* :func:`qa_f1` -- SQuAD-style token F1 after normalisation (lower case, no punctuation, no
  articles a/an/the, single spaces).
* :func:`rouge_l` -- ROUGE-L F1 from the longest common subsequence of whitespace tokens. LongBench
  calls the ``rouge`` package (pltrdy), whose ROUGE-L is the summary-level union-LCS over sentences
  split at ``"."``; we split at whitespace and treat ``"."`` as a separator like that package does,
  but take one LCS over the whole text. Both agree on single-sentence texts.
* :func:`classification_score` -- LongBench's class matching over ``all_classes``.
* :func:`retrieval_score` -- share of the numbers in the prediction equal to the reference's
  paragraph number (``"Paragraph 12"``, or ``"段落12"`` for the Chinese variant).
* :func:`count_score` -- share of the numbers in the prediction equal to the reference count.
* :func:`code_sim_score` -- similarity of the first code line of the prediction (skipping lines with
  ```` ` ````, ``#`` or ``//``) to the reference. LongBench uses ``fuzzywuzzy.fuzz.ratio``; we use
  ``difflib.SequenceMatcher.ratio`` rounded to a whole percent, which is exactly what fuzzywuzzy
  computes without ``python-Levenshtein`` and an approximation of the Levenshtein-based value.
* :func:`qa_f1_zh` / :func:`rouge_l_zh` -- the Chinese variants. LongBench segments with ``jieba``;
  we use one token per CJK character (and per run of other non-space characters), a common
  dependency-free approximation.
* ``*_first_line`` variants -- for trec, triviaqa, samsum and lsht LongBench scores only the first
  line of the prediction (``prediction.lstrip("\\n").split("\\n")[0]``); the registry has those as
  separate names so that a row's ``metric`` column says everything needed.

:data:`METRICS` maps names to functions and :func:`score` looks them up. The LongBench JSONL loader
lives in :mod:`pipeline.eval.longbench` and is re-exported here as :func:`load_longbench_jsonl`.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

References = str | Sequence[str]


def _refs(references: References) -> list[str]:
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("references must contain at least one string")
    return [str(r) for r in refs]


def _best(single: Callable[..., float], prediction: str, references: References, **kwargs) -> float:
    return max(single(prediction or "", ref, **kwargs) for ref in _refs(references))


# ----------------------------------------------------------------------------------------- RULER


def string_match_all(prediction: str, references: References, **_) -> float:
    """RULER: fraction of reference strings contained in the prediction (case-insensitive)."""
    refs = _refs(references)
    pred = (prediction or "").lower()
    return sum(1.0 for r in refs if r.lower() in pred) / len(refs)


def string_match_part(prediction: str, references: References, **_) -> float:
    """RULER: 1.0 when at least one reference string is contained in the prediction."""
    pred = (prediction or "").lower()
    return 1.0 if any(r.lower() in pred for r in _refs(references)) else 0.0


# ------------------------------------------------------------------------------------- LongBench


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalisation: lower case, drop punctuation, drop articles, fix spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


_ZH_PUNCT = set(
    string.punctuation + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》"
    "「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ZH_TOKEN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|[^\s\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")


def _zh_tokens(text: str) -> list[str]:
    """Character-level stand-in for ``jieba.cut`` followed by LongBench's ``normalize_zh_answer``."""
    tokens = ("".join(ch for ch in tok.lower() if ch not in _ZH_PUNCT) for tok in _ZH_TOKEN.findall(text))
    return [t for t in tokens if t]


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """LongBench ``f1_score``: harmonic mean of token precision and recall (multiset overlap)."""
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, references: References, **_) -> float:
    """LongBench ``qa_f1_score``: token F1 of the normalised answers, max over references."""
    return _best(
        lambda p, r: token_f1(normalize_answer(p).split(), normalize_answer(r).split()), prediction, references
    )


def qa_f1_zh(prediction: str, references: References, **_) -> float:
    """LongBench ``qa_f1_zh_score`` with character-level segmentation instead of jieba."""
    return _best(lambda p, r: token_f1(_zh_tokens(p), _zh_tokens(r)), prediction, references)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (O(len(a)·len(b)) time, O(len(b)) memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def _rouge_l_tokens(pred: Sequence[str], ref: Sequence[str]) -> float:
    if not pred or not ref:
        return 0.0  # LongBench: the rouge package raises on empty text and the score is 0
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def _rouge_words(text: str) -> list[str]:
    return text.replace(".", " ").split()


def rouge_l(prediction: str, references: References, **_) -> float:
    """ROUGE-L F1 (LCS of whitespace tokens, ``"."`` as a separator), max over references."""
    return _best(lambda p, r: _rouge_l_tokens(_rouge_words(p), _rouge_words(r)), prediction, references)


def rouge_l_zh(prediction: str, references: References, **_) -> float:
    """LongBench ``rouge_zh_score`` with character-level segmentation instead of jieba."""
    return _best(lambda p, r: _rouge_l_tokens(_zh_tokens(p), _zh_tokens(r)), prediction, references)


def _classification_single(prediction: str, reference: str, all_classes: Sequence[str]) -> float:
    matches = [c for c in all_classes if c in prediction]
    # LongBench drops classes that are a strict substring of the reference (e.g. "city" when the
    # answer is "city name"), so that naming the right class is not penalised by its substrings.
    # (LongBench removes them from the list while iterating over it, which can skip one; we apply
    # the rule to every match.)
    matches = [m for m in matches if not (m in reference and m != reference)]
    return 1.0 / len(matches) if reference in matches else 0.0


def classification_score(
    prediction: str, references: References, all_classes: Sequence[str] | None = None, **_
) -> float:
    """LongBench ``classification_score`` (trec, lsht): the classes named in the prediction are
    collected; the score is ``1 / len(matches)`` when the reference is among them, else 0.

    ``all_classes`` is the row's list of labels (LongBench's ``all_classes`` field). Without it the
    references themselves are used as the class list, i.e. 1.0 when the reference is named.
    """
    classes = list(all_classes) if all_classes else _refs(references)
    return _best(lambda p, r: _classification_single(p, r, classes), prediction, references)


_PARAGRAPH = re.compile(r"(?:Paragraph\s*|段落)(\d+)")


def _number_share(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(1 for n in numbers if n == target) / len(numbers) if numbers else 0.0


def _retrieval_single(prediction: str, reference: str) -> float:
    match = _PARAGRAPH.search(reference) or re.search(r"(\d+)", reference)
    if match is None:
        raise ValueError(f"retrieval reference {reference!r} names no paragraph number")
    return _number_share(prediction, match.group(1))


def retrieval_score(prediction: str, references: References, **_) -> float:
    """LongBench ``retrieval_score`` / ``retrieval_zh_score``: the reference names a paragraph
    (``"Paragraph 7"`` / ``"段落7"``; a bare number also works); the score is the share of the
    numbers in the prediction that equal it (0 when the prediction has no number)."""
    return _best(_retrieval_single, prediction, references)


def count_score(prediction: str, references: References, **_) -> float:
    """LongBench ``count_score`` (passage_count): share of the numbers in the prediction equal to
    the reference count (0 when the prediction has no number)."""
    return _best(lambda p, r: _number_share(p, r.strip()), prediction, references)


def _first_code_line(prediction: str) -> str:
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def fuzzy_ratio(a: str, b: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` as computed without python-Levenshtein (0 for an empty side)."""
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, references: References, **_) -> float:
    """LongBench ``code_sim_score`` (lcc, repobench-p): fuzzy ratio / 100 between the first line of
    the prediction that has no ```` ` ````, ``#`` or ``//`` and the reference. Approximates
    fuzzywuzzy with :class:`difflib.SequenceMatcher` (see the module docstring)."""
    return _best(lambda p, r: fuzzy_ratio(_first_code_line(p), r) / 100, prediction, references)


def first_line(prediction: str) -> str:
    """LongBench's truncation for trec, triviaqa, samsum and lsht."""
    return (prediction or "").lstrip("\n").split("\n")[0]


def _on_first_line(metric: Callable[..., float]) -> Callable[..., float]:
    def wrapped(prediction: str, references: References, **kwargs) -> float:
        return metric(first_line(prediction), references, **kwargs)

    wrapped.__name__ = f"{metric.__name__}_first_line"
    wrapped.__qualname__ = wrapped.__name__
    wrapped.__doc__ = f"{metric.__name__} on the first line of the prediction (LongBench's rule for few-shot tasks)."
    return wrapped


# -------------------------------------------------------------------------------------- registry

Metric = Callable[..., float]

METRICS: dict[str, Metric] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_l_zh": rouge_l_zh,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
}
METRICS.update(
    {f"{name}_first_line": _on_first_line(METRICS[name]) for name in ("qa_f1", "rouge_l", "classification_score")}
)


def get_metric(name: str) -> Metric:
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; known metrics: {', '.join(sorted(METRICS))}") from None


def score(metric_name: str, prediction: str | None, references: References, **kwargs) -> float:
    """Score one prediction with the metric named ``metric_name`` (a :data:`METRICS` key).

    ``kwargs`` go to the metric (``all_classes`` for ``classification_score``). A ``None``
    prediction (a failed row) scores like an empty one. Raises :class:`ValueError` for an unknown
    metric name or an empty reference list.
    """
    return float(get_metric(metric_name)(prediction or "", references, **kwargs))


from .longbench import LONGBENCH_DATASET_METRIC, load_longbench_jsonl  # noqa: E402  (re-export)

__all__ = [
    "METRICS",
    "LONGBENCH_DATASET_METRIC",
    "classification_score",
    "code_sim_score",
    "count_score",
    "get_metric",
    "load_longbench_jsonl",
    "normalize_answer",
    "qa_f1",
    "qa_f1_zh",
    "retrieval_score",
    "rouge_l",
    "rouge_l_zh",
    "score",
    "string_match_all",
    "string_match_part",
]
