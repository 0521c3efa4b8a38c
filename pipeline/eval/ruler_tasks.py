"""Sample builders for the RULER-style tasks (one sample at a given haystack size).

Follows RULER (arXiv 2404.06654; https://github.com/NVIDIA/RULER, ``scripts/data/synthetic/``
``niah.py``, ``variable_tracking.py``, ``common_words_extraction.py``, ``freq_words_extraction.py``,
``constants.py`` and ``scripts/synthetic.yaml``). :mod:`pipeline.eval.ruler` fits the size to a
token length and assembles rows; this module only turns ``(sample seed, size)`` into one sample.

Every builder re-creates its :class:`random.Random` from the sample seed and draws everything that
must not depend on the haystack size (keys, values, variable names, vocabularies, seeds of the
positional streams) *before* anything that does. So the fitter can rebuild a sample at many sizes
and the needles and answers stay the same; only the haystack grows.

RULER's full prompt is ``template + answer_prefix``; here it is split in three strings whose plain
concatenation ``context + question + answer_prefix`` is RULER's prompt: ``context`` is everything
up to and including the haystack (it is what the pipeline prefills and compresses before it sees
the question), ``question`` starts with RULER's ``"\\n"`` separator.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from . import ruler_data as data

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

# RULER scripts/data/synthetic/constants.py, each template cut at "{context}" into our three parts.
NIAH_CONTEXT = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}"
)
NIAH_QUESTION = "\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
NIAH_ANSWER = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

VT_CONTEXT = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {query} in the text above."
VT_ANSWER = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
    "are assigned the value {query}, they are: "
)

CWE_CONTEXT = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}"
)
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"

FWE_CONTEXT = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}"
)
FWE_QUESTION = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three "
    "most frequently appeared words in the above coded text?"
)
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"


class TooSmall(ValueError):
    """The requested haystack size cannot hold the task's needles."""


@dataclass(frozen=True)
class Sample:
    context: str
    question: str
    answer_prefix: str
    reference: list[str]


@dataclass(frozen=True)
class NiahConfig:
    """One row of RULER's ``synthetic.yaml`` for the ``niah`` family."""

    haystack: str  # noise | essay | needle
    type_k: str  # numbers | words | uuids
    type_v: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


NIAH_CONFIGS: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_v=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_q=4),
}


def _singular(template: str) -> str:
    """RULER's rewrite of the niah template when exactly one value is asked for."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(old, new)
    return template


def noise_lines(num_sentences: int) -> list[str]:
    """RULER's noise haystack, one line per repetition of the five noise sentences.

    RULER counts the haystack in whole lines; we count sentences, and the last line holds the
    remaining ``num_sentences % 5`` sentences. This gives the length fitter a 4-token granularity
    instead of ~20 (RULER instead leaves the slack to ``tokens_to_generate``).
    """
    full, rest = divmod(num_sentences, len(data.NOISE_SENTENCES))
    lines = [data.NOISE_HAYSTACK] * full
    if rest:
        lines.append(" ".join(data.NOISE_SENTENCES[:rest]))
    return lines


def insert_at_depths(words: list[str] | tuple[str, ...], size: int, inserts: list[str], rng: random.Random) -> str:
    """RULER's essay insertion: split the first ``size`` words into sentences and put each insert
    after the sentence at a depth drawn (without replacement) from :data:`ruler_data.DEPTHS`."""
    if size <= len(words):
        text = " ".join(words[:size])
    else:  # RULER repeats the haystack as many times as needed
        reps = -(-size // len(words))
        text = " ".join((list(words) * reps)[:size])
    sents = data.split_sentences(text)
    depths = rng.sample(data.DEPTHS, len(inserts))
    return insert_after_sentences(sents, inserts, sorted(int(len(sents) * d / 100) for d in depths))


def insert_after_sentences(sents: list[str], inserts: list[str], cuts: list[int]) -> str:
    """``inserts[i]`` placed after the first ``cuts[i]`` sentences (cuts sorted), joined with spaces."""
    cuts = [0, *cuts, len(sents)]
    parts: list[str] = []
    for i in range(1, len(cuts)):
        segment = " ".join(sents[cuts[i - 1] : cuts[i]])
        if segment:
            parts.append(segment)
        if i - 1 < len(inserts):
            parts.append(inserts[i - 1])
    return " ".join(parts)


def build_niah(cfg: NiahConfig, sample_seed: int, size: int) -> Sample:
    """RULER ``niah.py`` ``generate_input_output``; ``size`` counts noise sentences, essay words or
    distractor needles depending on ``cfg.haystack``."""
    rng = random.Random(sample_seed)
    num_k = max(cfg.num_k, cfg.num_q)
    keys = data.distinct_values(rng, cfg.type_k, num_k)
    flat_values = data.distinct_values(rng, cfg.type_v, num_k * cfg.num_v)
    values = [flat_values[i * cfg.num_v : (i + 1) * cfg.num_v] for i in range(num_k)]
    needles = [NEEDLE.format(type_needle_v=cfg.type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    queried = rng.sample(range(num_k), cfg.num_q)
    pos_rng = random.Random(rng.getrandbits(64))  # everything below may depend on size

    if cfg.haystack == "essay":
        if size < 1:
            raise TooSmall("essay haystack needs at least one word")
        body = insert_at_depths(data.essay_words(), size, needles, pos_rng)
    else:
        if cfg.haystack == "noise":
            lines = noise_lines(size)
        elif cfg.haystack == "needle":
            d_keys = data.distinct_values(pos_rng, cfg.type_k, size, exclude=set(keys))
            lines = [
                NEEDLE.format(type_needle_v=cfg.type_v, key=k, value=data.random_value(pos_rng, cfg.type_v))
                for k in d_keys
            ]
        else:
            raise ValueError(f"unknown haystack kind {cfg.haystack!r}")
        if len(lines) < len(needles):
            raise TooSmall(f"{len(lines)} haystack lines cannot hold {len(needles)} needles")
        for index, needle in zip(sorted(pos_rng.sample(range(len(lines)), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        body = "\n".join(lines)

    queries = [keys[i] for i in queried]
    answers = [v for i in queried for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    ctx_t, q_t, a_t, type_v = NIAH_CONTEXT, NIAH_QUESTION, NIAH_ANSWER, cfg.type_v
    if cfg.num_q * cfg.num_v == 1:
        ctx_t, q_t, a_t, type_v = _singular(ctx_t), _singular(q_t), _singular(a_t), type_v[:-1]
    return Sample(
        context=ctx_t.format(type_needle_v=type_v, context=body),
        question=q_t.format(type_needle_v=type_v, query=query),
        answer_prefix=a_t.format(type_needle_v=type_v, query=query),
        reference=answers,
    )


# ----------------------------------------------------------------------------- variable tracking

VT_NUM_CHAINS, VT_NUM_HOPS = 1, 4  # RULER synthetic.yaml
VT_ICL_NOISE_SENTENCES = 25  # RULER sizes its example to 500 tokens; we fix 5 noise lines


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, name_len: int):
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if name not in names:
            names.append(name)
    var_groups, chains = [], []
    for c in range(num_chains):
        group = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        chain = [f"VAR {group[0]} = {rng.randint(10000, 99999)}"]
        chain += [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(num_hops)]
        var_groups.append(group)
        chains.append(chain)
    return var_groups, chains


def _vt_text(chains: list[list[str]], num_sentences: int, rng: random.Random) -> str:
    lines = noise_lines(num_sentences)
    for chain in chains:
        if len(lines) < len(chain):
            raise TooSmall(f"{len(lines)} noise lines cannot hold a chain of {len(chain)} assignments")
        positions = sorted(rng.sample(range(len(lines)), len(chain)))
        for j, pos in enumerate(positions):
            lines.insert(pos + j, chain[j])
    return "\n".join(lines).replace(". \n", ".\n")


def build_vt(sample_seed: int, size: int) -> Sample:
    """RULER ``variable_tracking.py`` with its one-shot example (``--add_fewshot`` style, as
    RULER's ``main`` always prepends it). ``size`` counts noise sentences of the main haystack."""
    rng = random.Random(sample_seed)
    icl_groups, icl_chains = _vt_chains(rng, VT_NUM_CHAINS, VT_NUM_HOPS, name_len=3)
    groups, chains = _vt_chains(rng, VT_NUM_CHAINS, VT_NUM_HOPS, name_len=5)
    icl_rng, pos_rng = random.Random(rng.getrandbits(64)), random.Random(rng.getrandbits(64))

    icl_value = icl_chains[0][0].split("=")[-1].strip()
    icl = (
        VT_CONTEXT.format(context=_vt_text(icl_chains, VT_ICL_NOISE_SENTENCES, icl_rng))
        + VT_QUESTION.format(query=icl_value)
        + VT_ANSWER.format(num_v=VT_NUM_HOPS + 1, query=icl_value)
        + " ".join(icl_groups[0])
        + "\n"
    )
    value = chains[0][0].split("=")[-1].strip()
    return Sample(
        context=icl + "\n" + VT_CONTEXT.format(context=_vt_text(chains, size, pos_rng)),
        question=VT_QUESTION.format(query=value),
        answer_prefix=VT_ANSWER.format(num_v=VT_NUM_HOPS + 1, query=value),
        reference=list(groups[0]),
    )


# ------------------------------------------------------------------------ common words extraction

CWE_NUM_CW = 10


def _cwe_list(words: list[str], common_repeats: int, uncommon_repeats: int, rng: random.Random):
    common, uncommon = words[:CWE_NUM_CW], words[CWE_NUM_CW:]
    word_list = common * common_repeats + uncommon * uncommon_repeats
    rng.shuffle(word_list)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common


def build_cwe(sample_seed: int, size: int, long_form: bool) -> Sample:
    """RULER ``common_words_extraction.py``; ``size`` is the number of distinct words.

    RULER's settings: below 4096 tokens the 10 common words appear 6 times and the others once,
    after a one-shot example of 20 words (3x / 1x); from 4096 on, 30x / 3x after a 40-word
    example (10x / 3x). Past the ~8k wonderwords RULER switches to its ``english_words.json``,
    which no package ships; we then add distinct ``adjective-noun`` words instead.
    """
    if size < CWE_NUM_CW + 1:
        raise TooSmall(f"cwe needs more than {CWE_NUM_CW} distinct words")
    rng = random.Random(sample_seed)
    fs_rng, pos_rng = random.Random(rng.getrandbits(64)), random.Random(rng.getrandbits(64))
    vocab = list(data.common_words())
    rng.shuffle(vocab)
    if size > len(vocab):
        vocab += data.distinct_values(rng, "words", size - len(vocab), exclude=set(vocab))
    if long_form:
        fs_words, fs_reps, reps = 40, (10, 3), (30, 3)
    else:
        fs_words, fs_reps, reps = 20, (3, 1), (6, 1)
    fs_ctx, fs_answer = _cwe_list(fs_rng.sample(data.common_words(), fs_words), *fs_reps, fs_rng)
    shot = (
        CWE_CONTEXT.format(context=fs_ctx)
        + CWE_QUESTION
        + CWE_ANSWER
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(fs_answer))
    )
    ctx, common = _cwe_list(vocab[:size], *reps, pos_rng)
    return Sample(
        context=shot + "\n" + CWE_CONTEXT.format(context=ctx),
        question=CWE_QUESTION,
        answer_prefix=CWE_ANSWER,
        reference=list(common),
    )


# -------------------------------------------------------------------------- frequent words extraction

FWE_ALPHA, FWE_WORD_LEN = 2.0, 6


def fwe_vocab_size(length_tokens: int) -> int:
    """RULER: ``vocab_size = max_seq_length // 50`` (we keep at least 10 words)."""
    return max(10, length_tokens // 50)


def build_fwe(sample_seed: int, size: int, vocab_size: int) -> Sample:
    """RULER ``freq_words_extraction.py``: word of rank k appears ``int(size * k**-alpha /
    zeta(alpha))`` times, rank 1 is the noise word ``'...'``, the answer is ranks 2-4."""
    rng = random.Random(sample_seed)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."
    norm = data.zeta(FWE_ALPHA)
    counts = [int(size * k**-FWE_ALPHA / norm) for k in range(1, vocab_size + 1)]
    if counts[3] <= counts[4]:
        raise TooSmall("fwe needs enough words for a strict top three")
    words = [w for w, c in zip(ranked, counts) for _ in range(c)]
    rng.shuffle(words)
    return Sample(
        context=FWE_CONTEXT.format(context=" ".join(words)),
        question=FWE_QUESTION,
        answer_prefix=FWE_ANSWER,
        reference=ranked[1:4],
    )
