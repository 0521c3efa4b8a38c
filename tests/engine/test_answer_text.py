"""The text of an answer from its tokens: multi-byte characters cut by the token limit."""

from pipeline.engine.decoding import answer_text
from tests.tiny import tiny_tokenizer


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_limit_inside_a_multibyte_character_leaves_it_out():
    tok = tiny_tokenizer()  # byte level: one token per UTF-8 byte
    ids = _ids(tok, "Zürich 東京")
    assert len(ids) == len("Zürich 東京".encode())
    cut = ids[:-1]  # the last character's third byte is missing
    assert tok.decode(cut).endswith("\ufffd")  # what used to be stored
    assert answer_text(tok, cut, cut=True) == ("Zürich 東", "length")
    assert answer_text(tok, ids[:2], cut=True) == ("Z", "length")  # inside the two-byte ü
    assert answer_text(tok, ids, cut=False) == ("Zürich 東京", "stop")


def test_an_answer_ended_by_eos_is_decoded_as_is_and_sentences_apply_to_cut_answers_only():
    tok = tiny_tokenizer()
    ids = _ids(tok, "One. Two and thr")
    assert answer_text(tok, ids, cut=False, end_at_sentence=True) == ("One. Two and thr", "stop")
    assert answer_text(tok, ids, cut=True, end_at_sentence=True) == ("One.", "sentence")
    assert answer_text(tok, ids, cut=True) == ("One. Two and thr", "length")


def test_a_cut_summary_without_a_complete_sentence_is_marked_a_fragment():
    """It used to be kept as it was with nothing marking it: finish_reason says length, not sentence."""
    tok = tiny_tokenizer()
    assert answer_text(tok, _ids(tok, "The report covers three"), cut=True, end_at_sentence=True) == (
        "The report covers three",
        "length",
    )
