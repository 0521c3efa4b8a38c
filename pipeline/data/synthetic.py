"""Built-in sample data: long needle-in-a-haystack QA documents and long reports to summarise.

Everything is generated from word lists and sentence templates with ``random.Random(seed)``: the
same arguments always give the same documents, nothing is downloaded. Documents are dicts with the
normalised columns (``DOCUMENT_COLUMNS``), ready for ``pa.Table.from_pylist(docs, DOCUMENT_SCHEMA)``.

QA documents cycle through four RULER-style needle layouts:

``single``      one needle, one question
``multikey``    three needles for three cities, one question asking for all three numbers
``multiquery``  two needles, one question per needle (one compressed context, two answers)
``multivalue``  two numbers for the same city, one question asking for both

Needles read "The special magic number for <city> is <7-digit number>." (``multivalue``: "One of
the special magic numbers for ..."); filler prose contains no digits, so every number in a context
is an answer. References list every number a question asks for (score with "all contained").
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.schema import DOCUMENT_SCHEMA

CITIES = (
    "Lisbon",
    "Nairobi",
    "Osaka",
    "Reykjavik",
    "Montevideo",
    "Tbilisi",
    "Hanoi",
    "Quebec",
    "Marrakesh",
    "Tallinn",
    "Cusco",
    "Adelaide",
    "Bergen",
    "Valparaiso",
    "Kraków",
    "Lagos",
    "Santiago",
    "Helsinki",
    "Seville",
    "Kyoto",
    "Zanzibar",
    "Ljubljana",
    "Porto",
    "Anchorage",
)
_SUBJECTS = (
    "the committee",
    "a small team of researchers",
    "the old harbour",
    "most visitors",
    "the regional council",
    "a local historian",
    "the northern valley",
    "several farmers",
    "the museum",
    "an independent review",
    "the river",
    "our guide",
    "the village choir",
    "a travelling merchant",
    "the library",
    "the railway company",
    "a retired engineer",
    "the weather station",
    "the school board",
    "a group of volunteers",
)
_VERBS = (
    "described",
    "examined",
    "reconsidered",
    "documented",
    "celebrated",
    "questioned",
    "restored",
    "mapped",
    "compared",
    "recorded",
    "ignored",
    "praised",
    "revisited",
    "measured",
    "photographed",
    "debated",
    "catalogued",
    "explained",
    "admired",
    "rebuilt",
)
_OBJECTS = (
    "the changing seasons",
    "the quiet streets of the old town",
    "a collection of letters",
    "the history of the stone bridge",
    "patterns of bird migration",
    "the price of grain",
    "an abandoned lighthouse",
    "the colours of the autumn forest",
    "the tides along the coast",
    "a forgotten recipe for bread",
    "the rules of a local card game",
    "the architecture of the chapel",
    "the sound of distant bells",
    "the slow growth of the orchard",
    "a map of the hidden caves",
    "the customs of the spring festival",
    "the shape of the hills",
    "the rhythm of the market",
)
_ADVERBIALS = (
    "after a long winter",
    "during the early evening",
    "with great care",
    "without much fanfare",
    "over several decades",
    "in the spring",
    "before the first snow",
    "at the request of the mayor",
    "for the annual almanac",
    "despite the heavy rain",
    "in a small notebook",
    "under a clear sky",
)
_CONNECTORS = (
    "Meanwhile,",
    "In addition,",
    "By contrast,",
    "As a result,",
    "Later,",
    "For many years,",
    "Interestingly,",
    "Even so,",
    "At the same time,",
    "Eventually,",
)
_TEMPLATES = (
    "{S} {v} {o} {a}.",
    "{c} {s} {v} {o}.",
    "{S} {v} {o}, and {s2} {v2} {o2}.",
    "Few people expected that {s} would have {v} {o} {a}.",
    "{c} {s} {v} {o} {a}, while {s2} {v2} {o2}.",
    "It is often said that {s} {v} {o} better than anyone.",
    "{A}, {s} {v} {o}.",
)
_SECTIONS = ("Background", "Activities", "Findings", "Finances", "Outlook")
_ORG_A = ("Northbridge", "Silverlake", "Eastmoor", "Greenhollow", "Redcliff", "Westvale", "Ashford")
_ORG_B = (
    "Water Cooperative",
    "Rail Society",
    "Library Trust",
    "Farming Association",
    "Heritage Foundation",
    "Harbour Authority",
    "Weather Institute",
)
_REPORT_TEMPLATES = (
    "In {year}, the {org} recorded {n} new members, {pct} percent more than the year before.",
    "The {org} spent {n} thousand euros on {o}, mostly {a}.",
    "According to the board, the most important change of the year was that {s} {v} {o}.",
    "The {org} plans to expand its work on {o} and expects costs to rise by {pct} percent.",
    "A survey of {n} residents found that {pct} percent were satisfied with the {org}.",
)
SUMMARY_INSTRUCTION = "Summarize the document in a few sentences."


def _sentence(rng: random.Random, templates=_TEMPLATES, **extra) -> str:
    s, s2 = rng.sample(_SUBJECTS, 2)
    v, v2 = rng.sample(_VERBS, 2)
    o, o2 = rng.sample(_OBJECTS, 2)
    a = rng.choice(_ADVERBIALS)
    fields = dict(
        s=s,
        s2=s2,
        v=v,
        v2=v2,
        o=o,
        o2=o2,
        a=a,
        c=rng.choice(_CONNECTORS),
        S=s[0].upper() + s[1:],
        A=a[0].upper() + a[1:],
        **extra,
    )
    return rng.choice(templates).format(**fields)


def filler_paragraphs(rng: random.Random, target_words: int) -> list[list[str]]:
    """Paragraphs (lists of sentences) of varied digit-free prose, ``target_words`` words in all."""
    paragraphs, words = [], 0
    while words < target_words:
        paragraph = [_sentence(rng) for _ in range(rng.randint(4, 8))]
        words += sum(len(sentence.split()) for sentence in paragraph)
        paragraphs.append(paragraph)
    return paragraphs


def _insert(rng: random.Random, paragraphs: list[list[str]], needles: list[str]) -> str:
    """Insert each needle at its own depth between sentences and join the text."""
    depths = sorted(rng.uniform(0.05, 0.95) for _ in needles)
    for depth, needle in zip(depths, needles):
        paragraph = paragraphs[min(int(depth * len(paragraphs)), len(paragraphs) - 1)]
        paragraph.insert(rng.randint(0, len(paragraph)), needle)
    return "\n\n".join(" ".join(paragraph) for paragraph in paragraphs)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


QA_KINDS = ("single", "multikey", "multiquery", "multivalue")


def sample_qa_documents(n_docs: int = 4, target_words: int = 2000, seed: int = 0) -> list[dict]:
    """Needle-in-a-haystack QA documents (kinds cycle through :data:`QA_KINDS`).

    ``target_words`` is the approximate filler length per document (about 1.3 tokens a word).
    """
    if n_docs < 0 or target_words < 1:
        raise ValueError(f"n_docs must be >= 0 and target_words >= 1, got {n_docs}, {target_words}")
    rng = random.Random(seed)
    docs = []
    for index in range(n_docs):
        kind = QA_KINDS[index % len(QA_KINDS)]
        n_cities = {"single": 1, "multikey": 3, "multiquery": 2, "multivalue": 1}[kind]
        cities = rng.sample(CITIES, n_cities)
        numbers = [str(n) for n in rng.sample(range(1_000_000, 10_000_000), 3)]
        ask = " mentioned in the provided text"
        if kind == "multivalue":
            needles = [f"One of the special magic numbers for {cities[0]} is {n}." for n in numbers[:2]]
            questions = [f"What are all the special magic numbers for {cities[0]}{ask}?"]
            prefix, references = f"The special magic numbers for {cities[0]} are", [numbers[:2]]
        else:
            needles = [f"The special magic number for {c} is {n}." for c, n in zip(cities, numbers)]
            if kind == "multikey":
                questions = [f"What are the special magic numbers for {_and(cities)}{ask}?"]
                prefix, references = f"The special magic numbers for {_and(cities)} are", [numbers[:3]]
            elif kind == "multiquery":
                questions = [f"What is the special magic number for {c}{ask}?" for c in cities]
                prefix, references = "The special magic number is", [[n] for n in numbers[:2]]
            else:
                questions = [f"What is the special magic number for {cities[0]}{ask}?"]
                prefix, references = f"The special magic number for {cities[0]} is", [numbers[:1]]
        context = _insert(rng, filler_paragraphs(rng, target_words), needles)
        docs.append(
            _doc(
                f"qa-s{seed}-{index:04d}-{kind}",
                context,
                questions,
                prefix,
                references,
                16 * max(len(r) for r in references),
            )
        )
    return docs


def sample_summarization_documents(n_docs: int = 3, target_words: int = 1500, seed: int = 0) -> list[dict]:
    """Procedurally generated annual reports (title, numbered sections, several paragraphs each)
    with the instruction :data:`SUMMARY_INSTRUCTION` as the only question and no references."""
    if n_docs < 0 or target_words < 1:
        raise ValueError(f"n_docs must be >= 0 and target_words >= 1, got {n_docs}, {target_words}")
    rng = random.Random(seed)
    docs = []
    for index in range(n_docs):
        org, year = f"{rng.choice(_ORG_A)} {rng.choice(_ORG_B)}", rng.randint(1990, 2024)
        parts, per_section = [f"Annual report of the {org}, {year}"], max(1, target_words // len(_SECTIONS))
        for number, title in enumerate(_SECTIONS, start=1):
            parts.append(f"{number}. {title}")
            for paragraph in filler_paragraphs(rng, per_section):
                facts = [
                    _sentence(
                        rng, _REPORT_TEMPLATES, org=org, year=year, n=rng.randint(12, 950), pct=rng.randint(2, 60)
                    )
                    for _ in range(rng.randint(1, 2))
                ]
                for fact in facts:
                    paragraph.insert(rng.randint(0, len(paragraph)), fact)
                parts.append(" ".join(paragraph))
        docs.append(_doc(f"sum-s{seed}-{index:04d}", "\n\n".join(parts), [SUMMARY_INSTRUCTION], "Summary:", None, 128))
    return docs


def _doc(doc_id, context, questions, prefix, references, max_new_tokens) -> dict:
    return {
        "doc_id": doc_id,
        "context": context,
        "questions": questions,
        "question_ids": [str(i) for i in range(len(questions))],
        "answer_prefix": prefix,
        "references": references,
        "max_new_tokens": max_new_tokens,
        "input_error": None,
    }


def question_rows(docs: list[dict]) -> list[dict]:
    """The same documents flattened to one question per row (the ``question`` input shape)."""
    return [
        {
            "doc_id": doc["doc_id"],
            "context": doc["context"],
            "question": question,
            "question_id": qid,
            "answer_prefix": doc["answer_prefix"],
            "reference": doc["references"][i] if doc["references"] else None,
            "max_new_tokens": doc["max_new_tokens"],
        }
        for doc in docs
        for i, (question, qid) in enumerate(zip(doc["questions"], doc["question_ids"]))
    ]


def write_documents(docs: list[dict], path: str | Path, *, one_question_per_row: bool = False) -> Path:
    """Write documents as Parquet (``.parquet``) or JSON lines (``.jsonl``); returns the path.

    ``one_question_per_row`` writes the :func:`question_rows` shape instead of list columns.
    """
    path = Path(path)
    rows = question_rows(docs) if one_question_per_row else docs
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        schema = None if one_question_per_row else DOCUMENT_SCHEMA
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    elif path.suffix == ".jsonl":
        with path.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        raise ValueError(f"{path}: write .parquet or .jsonl, not {path.suffix!r}")
    return path
