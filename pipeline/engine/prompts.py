"""Turning (context, question, answer prefix) into the two token chunks the engine prefills.

With a chat template the user turn is ``context + "\\n\\n" + question``; the rendered template is
split around the context and the question so that

    context chunk  = template head + context + "\\n\\n"
    question chunk = question + template tail (end of user turn, assistant header) + answer prefix

The context chunk is prefilled (and compressed) before the question is seen; the question chunk
is positioned after the full original context. Without a chat template the tail is ``"\\n"``.
Truncation of over-long contexts cuts the context body only (middle by default, as LongBench does).
"""

from __future__ import annotations

from dataclasses import dataclass

_CTX = "\u2063CTX\u2063"
_QST = "\u2063QST\u2063"
SEPARATOR = "\n\n"


class ContextTooLongError(ValueError):
    """Raised with ``truncate='error'`` when context + question + answer do not fit the model."""


@dataclass
class EncodedPrompt:
    """context_ids = prefix (BOS + template head, ``prefix_tokens`` of them) + body + separator."""

    context_ids: list[int]
    question_ids: list[list[int]]
    truncated_tokens: int
    prefix_tokens: int = 0


class PromptBuilder:
    """Encodes prompts for one tokenizer; chat template used when the tokenizer has one."""

    def __init__(self, tokenizer, use_chat_template: bool = True) -> None:
        self.tokenizer = tokenizer
        self.head, self.tail = "", "\n"
        self.bos: list[int] = []
        if use_chat_template and getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": _CTX + SEPARATOR + _QST}], tokenize=False, add_generation_prompt=True
            )
            head, rest = rendered.split(_CTX, 1)
            _, tail = rest.split(_QST, 1)
            self.head, self.tail = head, tail
        else:  # whatever special prefix (BOS) the tokenizer itself adds to a sequence
            self.bos = list(tokenizer("", add_special_tokens=True)["input_ids"])

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def text_ids(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""
        return self._ids(text)

    def tail_ids(self) -> list[int]:
        """The template tail that follows the user's text: end of user turn + assistant header."""
        return self._ids(self.tail)

    def encode(
        self,
        context: str,
        questions: list[str],
        answer_prefix: str = "",
        max_total_tokens: int | None = None,
        reserve_tokens: int = 0,
        truncate: str = "middle",
    ) -> EncodedPrompt:
        """Token ids of the context chunk and of each question chunk.

        ``max_total_tokens``: the model window; the context body is cut so that the context chunk,
        the longest question chunk and ``reserve_tokens`` (generation room) fit.
        """
        head, body, sep = self._ids(self.head), self._ids(context), self._ids(SEPARATOR)
        question_ids = [self._ids(q + self.tail) + self._ids(answer_prefix) for q in questions]
        truncated = 0
        if max_total_tokens is not None:
            fixed = len(self.bos) + len(head) + len(sep) + max((len(q) for q in question_ids), default=0)
            room = max_total_tokens - fixed - reserve_tokens
            if len(body) > room:
                if truncate == "error" or room <= 0:
                    raise ContextTooLongError(
                        f"context has {len(body)} tokens but only {max(room, 0)} fit the model window of "
                        f"{max_total_tokens} (question and {reserve_tokens} generated tokens reserved)"
                    )
                truncated = len(body) - room
                if truncate == "left":
                    body = body[-room:]
                else:
                    half = room // 2
                    body = body[:half] + body[len(body) - (room - half) :]
        return EncodedPrompt(self.bos + head + body + sep, question_ids, truncated, len(self.bos) + len(head))
