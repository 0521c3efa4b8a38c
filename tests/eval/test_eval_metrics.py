"""Metrics of pipeline.eval.metrics against hand-computed values (RULER arXiv 2404.06654,
LongBench arXiv 2308.14508)."""

import pytest

from pipeline.eval import metrics as m
from pipeline.eval.metrics import METRICS, score

# ------------------------------------------------------------------------------------ RULER


def test_string_match_all_fraction_case_insensitive():
    assert m.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert m.string_match_all("Answer: ABC-def", ["abc-DEF"]) == 1.0
    assert m.string_match_all("nothing here", ["123"]) == 0.0


def test_string_match_all_single_string_reference_and_empty_prediction():
    assert m.string_match_all("it is 42", "42") == 1.0
    assert m.string_match_all("", ["42"]) == 0.0
    assert m.string_match_all(None, ["42"]) == 0.0


def test_string_match_part_any_reference():
    assert m.string_match_part("Paris is the capital", ["London", "paris"]) == 1.0
    assert m.string_match_part("Rome", ["London", "Paris"]) == 0.0
    assert m.string_match_part("", ["x"]) == 0.0


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_rejects_empty_references(name):
    with pytest.raises(ValueError, match="at least one"):
        score(name, "some prediction", [])


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_scores_empty_prediction_zero(name):
    refs = ["Paragraph 3"] if name == "retrieval_score" else ["12"] if name == "count_score" else ["abc"]
    assert score(name, "", refs) == 0.0
    assert score(name, None, refs) == 0.0


# ------------------------------------------------------------------------------- LongBench QA


def test_normalize_answer_removes_case_punctuation_articles_and_spaces():
    assert m.normalize_answer("  The Cat,  a dog; an Apple!  ") == "cat dog apple"
    # articles only as whole words
    assert m.normalize_answer("Theatre and Anthem") == "theatre and anthem"


def test_qa_f1_hand_computed():
    assert m.qa_f1("The Eiffel Tower.", ["eiffel tower"]) == 1.0
    # pred {paris, france} vs ref {paris}: P = 1/2, R = 1 -> F1 = 2/3
    assert m.qa_f1("Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    # multiset overlap: "cat cat" vs "cat": P = 1/2, R = 1
    assert m.qa_f1("cat cat", "cat") == pytest.approx(2 / 3)
    assert m.qa_f1("dog", ["cat"]) == 0.0


def test_qa_f1_max_over_references():
    # vs "red": 0; vs "blue sky": P = 1, R = 1/2 -> 2/3; vs "Blue!": 1
    assert m.qa_f1("blue", ["red", "blue sky"]) == pytest.approx(2 / 3)
    assert m.qa_f1("blue", ["red", "blue sky", "Blue!"]) == 1.0


def test_qa_f1_prediction_of_only_articles_and_punctuation_is_zero():
    assert m.qa_f1("The, a, an...", ["the answer"]) == 0.0


def test_qa_f1_zh_character_tokens():
    # pred [北, 京] vs ref [北, 京, 市]: P = 1, R = 2/3 -> 0.8; punctuation dropped
    assert m.qa_f1_zh("北京。", ["北京市"]) == pytest.approx(0.8)


# ------------------------------------------------------------------------------------ ROUGE-L


def test_lcs_length():
    assert m.lcs_length("a b c d e".split(), "a x c y e".split()) == 3
    assert m.lcs_length([], ["a"]) == 0
    assert m.lcs_length(list("abcbdab"), list("bdcaba")) == 4


def test_rouge_l_hand_computed():
    # LCS("the cat sat on the mat", "the cat on mat") = 4: P = 4/6, R = 4/4 -> F = 0.8
    assert m.rouge_l("the cat sat on the mat", ["the cat on mat"]) == pytest.approx(0.8)
    # non-contiguous LCS of 3 over 5 and 5 tokens -> 0.6
    assert m.rouge_l("a b c d e", "a x c y e") == pytest.approx(0.6)
    assert m.rouge_l("same words here", "same words here") == 1.0
    assert m.rouge_l("nothing shared", "completely different") == 0.0


def test_rouge_l_periods_separate_tokens_and_max_over_references():
    assert m.rouge_l("cat sat.", ["cat sat"]) == 1.0
    assert m.rouge_l("one. two", ["two", "one two"]) == 1.0
    assert m.rouge_l("x y", ["x z", "q"]) == pytest.approx(0.5)


def test_rouge_l_zh():
    # [我, 爱, 北, 京] vs [我, 爱, 上, 海]: LCS 2 -> P = R = 1/2
    assert m.rouge_l_zh("我爱北京", "我爱上海") == pytest.approx(0.5)


# --------------------------------------------------------------------------- classification


def test_classification_score_longbench_rules():
    classes = ["LOC", "NUM", "HUM"]
    assert m.classification_score("Type: LOC", ["LOC"], all_classes=classes) == 1.0
    assert m.classification_score("LOC or NUM", ["LOC"], all_classes=classes) == 0.5
    assert m.classification_score("HUM", ["LOC"], all_classes=classes) == 0.0
    assert m.classification_score("no class", ["LOC"], all_classes=classes) == 0.0


def test_classification_score_drops_substrings_of_the_reference():
    classes = ["city", "city name", "country"]
    # "city" is inside "city name" and is not counted against the right answer
    assert m.classification_score("It is a city name", ["city name"], all_classes=classes) == 1.0
    assert m.classification_score("city name or country", ["city name"], all_classes=classes) == 0.5


def test_classification_score_without_all_classes_uses_references():
    assert m.classification_score("LOC", ["LOC"]) == 1.0
    assert score("classification_score", "NUM", ["LOC"]) == 0.0
    assert score("classification_score", "LOC or NUM", ["LOC"], all_classes=["LOC", "NUM"]) == 0.5


# ----------------------------------------------------------------------- retrieval and count


def test_retrieval_score_paragraph_numbers():
    assert m.retrieval_score("Paragraph 3", ["Paragraph 3"]) == 1.0
    assert m.retrieval_score("Paragraph 3, maybe Paragraph 12", ["Paragraph 3"]) == 0.5
    assert m.retrieval_score("Paragraph 13", ["Paragraph 3"]) == 0.0  # whole numbers only
    assert m.retrieval_score("I do not know", ["Paragraph 3"]) == 0.0
    assert m.retrieval_score("段落5", ["段落5"]) == 1.0
    assert m.retrieval_score("7", ["Paragraph 3", "Paragraph 7"]) == 1.0


def test_retrieval_score_reference_without_number_is_an_error():
    with pytest.raises(ValueError, match="paragraph"):
        m.retrieval_score("Paragraph 1", ["no number"])


def test_count_score():
    assert m.count_score("There are 12 unique paragraphs.", ["12"]) == 1.0
    assert m.count_score("12 or 13", "12") == 0.5
    assert m.count_score("112", "12") == 0.0
    assert m.count_score("none", "12") == 0.0


# ------------------------------------------------------------------------------ code similarity


def test_code_sim_skips_fences_and_comments():
    pred = "```python\n# add them\n// also a comment\nreturn a + b\n```"
    assert m.code_sim_score(pred, ["return a + b"]) == 1.0


def test_code_sim_ratio_hand_computed():
    # SequenceMatcher("abcd", "abce"): 3 matching chars of 8 -> 2*3/8 = 0.75
    assert m.code_sim_score("abcd", ["abce"]) == pytest.approx(0.75)
    assert m.fuzzy_ratio("abcd", "abce") == 75
    assert m.code_sim_score("abcd", ["zzzz", "abcd"]) == 1.0
    assert m.code_sim_score("# only a comment", ["x = 1"]) == 0.0


# ---------------------------------------------------------------------- first line, registry


def test_first_line_variants_score_only_the_first_line():
    pred = "\nParis\nSome other text: London"
    assert m.qa_f1(pred, ["London"]) > 0
    assert score("qa_f1_first_line", pred, ["London"]) == 0.0
    assert score("qa_f1_first_line", pred, ["Paris"]) == 1.0
    assert score("classification_score_first_line", "LOC\nNUM", ["LOC"], all_classes=["LOC", "NUM"]) == 1.0
    assert score("rouge_l_first_line", "a b\nc d", ["a b"]) == 1.0


def test_registry_names_and_score_dispatch():
    required = {
        "string_match_all",
        "string_match_part",
        "qa_f1",
        "rouge_l",
        "classification_score",
        "retrieval_score",
        "count_score",
        "code_sim_score",
    }
    assert required <= set(METRICS)
    assert all(callable(f) for f in METRICS.values())
    assert score("string_match_all", "a b", ["A", "c"]) == 0.5
    assert isinstance(score("qa_f1", "x", ["x"]), float)


def test_unknown_metric_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown metric 'bleu'.*string_match_all"):
        score("bleu", "x", ["x"])
