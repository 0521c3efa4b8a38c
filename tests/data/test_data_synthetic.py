"""Built-in synthetic documents: deterministic, needles really present, usable as inputs."""

import re

import pyarrow as pa

from pipeline.data import (
    DOCUMENT_SCHEMA,
    QA_KINDS,
    SUMMARY_INSTRUCTION,
    read_documents,
    sample_qa_documents,
    sample_summarization_documents,
    write_documents,
)


def test_qa_documents_are_deterministic_and_seed_dependent():
    assert sample_qa_documents(4, 500, seed=3) == sample_qa_documents(4, 500, seed=3)
    assert sample_qa_documents(4, 500, seed=3) != sample_qa_documents(4, 500, seed=4)
    assert sample_summarization_documents(2, 400, seed=1) == sample_summarization_documents(2, 400, seed=1)


def test_needle_answers_are_in_the_context_exactly_once():
    docs = sample_qa_documents(n_docs=8, target_words=800, seed=0)
    assert [d["doc_id"].rsplit("-", 1)[1] for d in docs] == list(QA_KINDS) * 2
    for doc in docs:
        context = doc["context"]
        numbers = re.findall(r"\d+", context)
        answers = [n for refs in doc["references"] for n in refs]
        assert sorted(numbers) == sorted(answers), doc["doc_id"]  # filler holds no digits
        assert 1 <= len(answers) <= 3
        assert len(doc["references"]) == len(doc["questions"]) == len(doc["question_ids"])
        for number in answers:
            assert context.count(number) == 1
            sentence = re.search(rf"[^.]*\b{number}\.", context).group(0).strip()
            assert "special magic number" in sentence
            city = re.search(r"for (.+?) is", sentence).group(1)
            assert any(city in q for q in doc["questions"])
        assert doc["answer_prefix"].startswith("The special magic number")
        assert len(context.split()) >= 800


def test_single_needle_sentence_and_prefix_match():
    doc = sample_qa_documents(1, 300, seed=5)[0]
    (number,) = doc["references"][0]
    prefix = doc["answer_prefix"]
    assert re.fullmatch(r"The special magic number for .+ is", prefix)
    assert f"{prefix} {number}." in doc["context"]


def test_filler_is_varied_prose_not_one_repeated_sentence():
    context = sample_qa_documents(1, 2000, seed=0)[0]["context"]
    sentences = [s for s in re.split(r"(?<=\.)\s+", context) if s]
    assert len(set(sentences)) > 0.8 * len(sentences)
    assert context.count("\n\n") >= 10  # paragraphs


def test_summarization_documents_shape():
    docs = sample_summarization_documents(n_docs=3, seed=0)
    assert len(docs) == 3 and len({d["doc_id"] for d in docs}) == 3
    for doc in docs:
        assert doc["questions"] == [SUMMARY_INSTRUCTION] and doc["references"] is None
        assert doc["context"].startswith("Annual report of the ")
        assert "\n\n1. Background\n\n" in doc["context"] and "5. Outlook" in doc["context"]
        assert len(doc["context"].split()) >= 1000
    assert pa.Table.from_pylist(docs, schema=DOCUMENT_SCHEMA).num_rows == 3


def test_written_files_read_back_as_the_same_documents(tmp_path):
    docs = sample_qa_documents(4, 300) + sample_summarization_documents(1, 300)
    expected = pa.Table.from_pylist(docs, schema=DOCUMENT_SCHEMA)
    for name, per_row in [("d.parquet", False), ("d.jsonl", False), ("q.parquet", True), ("q.jsonl", True)]:
        path = write_documents(docs, tmp_path / name, one_question_per_row=per_row)
        assert read_documents(path).equals(expected), name
