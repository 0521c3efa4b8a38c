"""Each document's answers handed on as soon as they are all known, not when the whole call ends.

An actor call answers several documents through one continuous decode batch (:mod:`pipeline.engine
.continuous`); the last document may end long after the first. :meth:`Engine.generate` with an
``on_document(i, answers)`` callback calls it once per request, as soon as every row of that request
has its answers (a row leaves the decode loop, a row retried alone is answered, a batch of the
``--no-continuous`` path ends), so that a caller (the Ray actor) can hand the rows on at once: what a
crash loses is then the documents not yet finished, not the whole call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from .batching import Row
from .types import Answer

DocumentCallback = Callable[[int, list[Answer]], None]


class DocumentEmitter:
    """Calls ``on_document(i, answers)`` once per request index ``i`` of ``count``, with its answers in
    question order, when its rows (``rows``: (request index, row) pairs) are all answered."""

    def __init__(self, on_document: DocumentCallback, rows: list[tuple[int, Row]], count: int) -> None:
        self.on_document = on_document
        self.count = count
        self.pending = Counter(i for i, _ in rows)  # rows still unanswered, per request
        self.got: dict[int, dict[int, Answer]] = {}  # request -> question index -> answer
        self.by_row: dict[int, list[Answer]] = {}  # id(row) -> its answers (a row is answered once)
        self.emitted: set[int] = set()

    def row_callback(self, batch: list[tuple[int, Row]]) -> Callable[[int, list[Answer]], None]:
        """``on_row(k, answers)`` for the rows of one runner call (``k``: the row's place in ``batch``)."""
        return lambda k, answers: self.row_done(batch[k], answers)

    def row_done(self, item: tuple[int, Row], answers: list[Answer]) -> None:
        i, row = item
        if id(row) in self.by_row:
            return
        self.by_row[id(row)] = answers
        self.got.setdefault(i, {}).update(zip(row.question_indices, answers))
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self._emit(i, [self.got[i][q] for q in sorted(self.got[i])])

    def answers_of(self, item: tuple[int, Row]) -> list[Answer] | None:
        """The answers a row already has (handed on), else None."""
        return self.by_row.get(id(item[1]))

    def batch_done(self, batch: list[tuple[int, Row]], answers: dict) -> None:
        """Every row of a finished runner call, from the call's ``(variant, request, question)`` answers."""
        for i, row in batch:
            self.row_done((i, row), [answers[(0, i, q)] for q in row.question_indices])

    def finish(self, answers: dict) -> None:
        """The requests not handed on yet (e.g. those that failed before any row ran)."""
        for i in range(self.count):
            questions = sorted(q for v, r, q in answers if v == 0 and r == i)
            self._emit(i, [answers[(0, i, q)] for q in questions])

    def _emit(self, i: int, answers: list[Answer]) -> None:
        if i not in self.emitted:
            self.emitted.add(i)
            self.on_document(i, answers)
