"""LongBench JSONL loader (arXiv 2308.14508) on small hand-written files."""

import json

import pytest

from pipeline.eval.longbench import LONGBENCH_DATASET_METRIC, LONGBENCH_MAX_NEW_TOKENS, load_longbench_jsonl
from pipeline.eval.metrics import METRICS, score
from pipeline.eval.metrics import load_longbench_jsonl as reexported


def _write(path, items):
    path.write_text("\n".join(json.dumps(i, ensure_ascii=False) if not isinstance(i, str) else i for i in items) + "\n")
    return path


def _item(**kw):
    base = {
        "input": "Who wrote it?",
        "context": "Passage 1: ... written by Ann.",
        "answers": ["Ann"],
        "length": 6,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "abc123",
    }
    base.update(kw)
    return base


def test_rows_have_the_pipeline_columns(tmp_path):
    rows = load_longbench_jsonl(_write(tmp_path / "hotpotqa.jsonl", [_item(), "", _item(_id="def456")]))
    assert reexported is load_longbench_jsonl
    assert len(rows) == 2  # blank line skipped
    row = rows[0]
    assert row == {
        "doc_id": "abc123",
        "task": "hotpotqa",
        "context": "Passage 1: ... written by Ann.",
        "question": "Who wrote it?",
        "answer_prefix": "",
        "reference": ["Ann"],
        "all_classes": None,
        "max_new_tokens": 32,
        "metric": "qa_f1",
    }
    assert score(row["metric"], "Ann.", row["reference"]) == 1.0


def test_dataset_to_metric_table(tmp_path):
    items = [
        _item(dataset="trec", answers=["LOC"], all_classes=["LOC", "NUM"], _id="t1"),
        _item(dataset="gov_report", input="", answers=["A summary."], _id="g1"),
        _item(dataset="passage_retrieval_en", answers=["Paragraph 4"], _id="p1"),
        _item(dataset="passage_count", answers=[7], _id="c1"),
        _item(dataset="lcc", answers=["return x"], _id="l1"),
        _item(dataset="samsum", answers=["They meet."], _id="s1"),
    ]
    rows = load_longbench_jsonl(_write(tmp_path / "mixed.jsonl", items))
    assert [r["metric"] for r in rows] == [
        "classification_score_first_line",
        "rouge_l",
        "retrieval_score",
        "count_score",
        "code_sim_score",
        "rouge_l_first_line",
    ]
    trec, gov, _, count, _, _ = rows
    assert trec["all_classes"] == ["LOC", "NUM"]
    assert score(trec["metric"], "LOC\nNUM", trec["reference"], all_classes=trec["all_classes"]) == 1.0
    assert gov["question"] == "" and gov["max_new_tokens"] == 512
    assert count["reference"] == ["7"]


def test_every_table_metric_is_registered():
    assert set(LONGBENCH_DATASET_METRIC) == set(LONGBENCH_MAX_NEW_TOKENS)
    assert len(LONGBENCH_DATASET_METRIC) == 21
    assert set(LONGBENCH_DATASET_METRIC.values()) <= set(METRICS)


def test_dataset_from_file_name_argument_and_longbench_e_suffix(tmp_path):
    item = _item(_id=None)
    del item["dataset"]
    rows = load_longbench_jsonl(_write(tmp_path / "qasper_e.jsonl", [item]))
    assert rows[0]["task"] == "qasper" and rows[0]["metric"] == "qa_f1"
    assert rows[0]["doc_id"] == "qasper-1"
    rows = load_longbench_jsonl(_write(tmp_path / "x.jsonl", [item]), dataset="triviaqa")
    assert rows[0]["metric"] == "qa_f1_first_line"


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"input": "q", "answers": ["a"], "dataset": "hotpotqa"}), "missing field"),
        (json.dumps(_item(answers=[])), "empty"),
        (json.dumps(_item(dataset="squad")), "unknown LongBench dataset 'squad'"),
    ],
)
def test_bad_lines_are_clear_errors(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_item()) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_longbench_jsonl(path)
    assert "bad.jsonl:2" in str(info.value)
