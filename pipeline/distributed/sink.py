"""Committed output files: the driver's atomic Parquet commits and the resume bookkeeping.

Layout of ``OUT/data/``:

* ``part-<settings>-<digest>.parquet``: committed files, by default one per document, committed as
  the document is answered (so a killed driver or node loses at most the documents not finished yet;
  with inputs normalised in Ray tasks, one per actor call); ``rows_per_file`` bundles more rows per file,
  and ``python -m pipeline.compact OUT`` merges a finished run's files). On a local filesystem each
  is written completely under a hidden temporary name (``.tmp-...``) in the same directory, flushed
  to disk and then renamed, so a file with a committed name is always whole. On object storage
  (``s3://``, ``gs://``; see :mod:`pipeline.data.locations`) the file is uploaded under its final key
  in one request: an object appears whole when its upload completes, or not at all, so no temporary
  name is needed. The name is **idempotent**: ``<settings>`` is the job's settings fingerprint (the
  same for every run into one output) and ``<digest>`` hashes the sorted (doc_id, question_id) keys
  the file holds, so a batch that Ray retries, or that a rerun redoes after its driver died, lands on
  the name it already has and replaces it instead of adding a second copy.
* ``.tmp-*``: a write in progress, or debris of a write killed part-way. Readers ignore names
  starting with ``.`` or ``_`` (pyarrow datasets, ``pipeline.data.read_table``, Ray's
  ``read_parquet``); the next run deletes them while it holds the output lock.

A Predictor returns all rows of a document in one table, and the driver commits whole tables
(:class:`BatchCommitter`), so every committed file holds complete documents. :func:`dedupe` is
the safety net for anything else (a commit that lands after a rerun already redid the document, a
batch that Ray retried after its first result had been committed):
it keeps one row per (doc_id, question_id) -- the earliest committed one, preferring rows without
``error`` -- and rewrites the other files without the duplicates, again atomically.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from pipeline.data.locations import TMP_PREFIX, Location, fsync_directory, resolve
from pipeline.data.normalise import question_hashes
from pipeline.data.schema import OUTPUT_COLUMNS, OUTPUT_SCHEMA
from pipeline.distributed.rows import unpack
from pipeline.engine.types import row_question_ids

PART_PREFIX = "part-"


def conform(table: pa.Table) -> pa.Table:
    """``table`` with exactly the output columns, types and schema metadata (version)."""
    return table.select(list(OUTPUT_COLUMNS)).cast(OUTPUT_SCHEMA)


def key_digest(table: pa.Table) -> str:
    keys = sorted(zip(table.column("doc_id").to_pylist(), table.column("question_id").to_pylist()))
    h = hashlib.sha1()
    for doc_id, qid in keys:
        h.update(doc_id.encode("utf-8", "surrogatepass") + b"\0" + qid.encode("utf-8", "surrogatepass") + b"\n")
    return h.hexdigest()[:20]


def commit_table(table: pa.Table, data_dir: str | os.PathLike | Location, settings_id: str) -> Location:
    """Write ``table`` as one committed file named by ``settings_id`` and its keys (see the module
    docstring); returns its location."""
    data = resolve(data_dir)
    table = conform(table)
    final = data.child(f"{PART_PREFIX}{settings_id}-{key_digest(table)}.parquet")
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    final.write_bytes(buffer.getvalue().to_pybytes())  # atomic: temp name + fsync + rename, or one upload
    return final


class BatchCommitter:
    """Commits the actors' output tables as they reach the driver (see the module docstring).

    ``add(table)`` takes one actor output block (whole documents, packed or not); with ``rows_per_file`` tables
    are held until they reach that many rows, otherwise each is committed at once. ``flush()``
    commits what is held. ``on_commit(table, rows)`` is called after each commit with the file's
    rows and the rows committed so far (progress).

    Why the driver and not Ray Data write tasks: the files land on the driver's machine, where the
    next run looks for them (a local ``OUT`` on a multi-node cluster, or the head with
    ``ray job submit``), and no extra worker process is needed. Ray kills an idle worker after about
    a second, so with one write task per batch every batch started a fresh Python worker (importing
    Ray Data and pyarrow, about 2 s of a core) next to the actor's compute threads; on a 2-core
    machine that made each document up to 1.7x slower (``benchmarks/pipeline_overhead.py``).
    Results are small (text and numbers), so pulling them to the driver costs little next to
    generation.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | Location,
        settings_id: str,
        rows_per_file: int | None = None,
        on_commit: Callable[[pa.Table, int], None] | None = None,
    ) -> None:
        self.data_dir = resolve(data_dir)
        self.data_dir.makedirs()
        self.settings_id = settings_id
        self.rows_per_file = rows_per_file
        self.on_commit = on_commit
        self.held: list[pa.Table] = []
        self.held_rows = 0
        self.files = 0
        self.rows = 0

    def add(self, table: pa.Table) -> None:
        table = unpack(table)  # an actor's output block: its documents' rows, packed one document a row
        if table.num_rows:
            self.held.append(table)
            self.held_rows += table.num_rows
        if self.held_rows >= (self.rows_per_file or 1):
            self.flush()

    def flush(self) -> None:
        if not self.held:
            return
        table = pa.concat_tables([conform(t) for t in self.held])
        commit_table(table, self.data_dir, self.settings_id)
        self.held, self.held_rows = [], 0
        self.files += 1
        self.rows += table.num_rows
        if self.on_commit is not None:
            self.on_commit(table, self.rows)

    def commit_all(self, tables: Iterable[pa.Table]) -> None:
        """Commit every table as it arrives, then what is held. On a failure (the pipeline's, or a
        commit's own such as a full disk) the rows already received are committed when they can be,
        and the iterator is closed before the error propagates: Ray Data stops its executor in the
        iterator's ``finally``, and an iterator left to the garbage collector outlives
        ``ray.shutdown()``, so Ray's core worker printed after the driver's last sentence."""
        batches = iter(tables)
        try:
            for table in batches:
                self.add(table)
        except BaseException:
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        finally:
            close = getattr(batches, "close", None)  # generators have it; a plain list iterator not
            if close is not None:
                close()
        self.flush()


# ---------------------------------------------------------------------- bookkeeping (driver)
def uncommitted(docs: pa.Table, committed: Committed, settings: list, retry_errors: bool) -> pa.Table:
    """The documents of ``docs`` (normalised) that are not done in ``committed``: some row key of theirs
    has no committed row (with ``retry_errors``: no row without ``error``)."""
    keys = [row_question_ids(qs, settings) for qs in docs.column("question_ids").to_pylist()]
    ids = docs.column("doc_id").to_pylist()
    keep = [not committed.done(d, ks, retry_errors) for d, ks in zip(ids, keys)]
    return docs.filter(pa.array(keep, pa.bool_()))


def committed_files(data_dir: str | os.PathLike | Location) -> list[Location]:
    """Committed result files, oldest first (modification time, then name)."""
    data = resolve(data_dir)
    files = [i for i in data.files() if i.base_name.startswith(PART_PREFIX) and i.base_name.endswith(".parquet")]
    files.sort(key=lambda i: (i.mtime_ns or 0, i.base_name))
    return [data.at(i) for i in files]


def remove_debris(data_dir: str | os.PathLike | Location) -> int:
    """Delete temporary files left by killed writes (call only while holding the output lock).
    Object storage has none: an interrupted upload never becomes an object."""
    data = resolve(data_dir)
    debris = [data.at(i) for i in data.files() if i.base_name.startswith(TMP_PREFIX)]
    for location in debris:
        location.delete()
    return len(debris)


KEY_COLUMNS = ["doc_id", "question_id", "error", "input_hash"]


def read_keys(data_dir: str | os.PathLike | Location) -> pa.Table:
    """(doc_id, question_id, error, file index) of every committed row."""
    return _keys_of(committed_files(data_dir))


def _keys_of(files: list[Location]) -> pa.Table:
    """:func:`read_keys` over an already listed ``committed_files``; ``file`` indexes ``files``."""
    parts = []
    for index, location in enumerate(files):
        table = pq.read_table(location.path, columns=KEY_COLUMNS, filesystem=location.fs)
        parts.append(table.append_column("file", pa.array([index] * table.num_rows, pa.int32())))
    if not parts:
        return pa.table(
            {
                "doc_id": pa.array([], pa.string()),
                "question_id": pa.array([], pa.string()),
                "error": pa.array([], pa.string()),
                "input_hash": pa.array([], pa.string()),
                "file": pa.array([], pa.int32()),
            }
        )
    return pa.concat_tables(parts)


@dataclass
class Committed:
    """What the output directory already holds, per document."""

    answered: dict[str, set[str]]  # doc_id -> question ids with a row (any row, error or not)
    succeeded: dict[str, set[str]]  # doc_id -> question ids with a row without error
    rows: int  # rows in committed files (a duplicate counts twice)
    inputs: dict[str, set[str]] = field(default_factory=dict)  # doc_id -> input_hash of its rows

    @property
    def keys(self) -> int:
        """Distinct (doc_id, question_id) keys with a row."""
        return sum(len(q) for q in self.answered.values())

    def done(self, doc_id: str, question_ids: list[str], retry_errors: bool = False) -> bool:
        have = (self.succeeded if retry_errors else self.answered).get(doc_id)
        return have is not None and set(question_ids) <= have


def committed_state(data_dir: str | os.PathLike | Location) -> Committed:
    keys = read_keys(data_dir)
    answered: dict[str, set[str]] = defaultdict(set)
    succeeded: dict[str, set[str]] = defaultdict(set)
    inputs: dict[str, set[str]] = defaultdict(set)
    for doc_id, qid, error, digest in zip(*(keys.column(c).to_pylist() for c in KEY_COLUMNS)):
        answered[doc_id].add(qid)
        if error is None:
            succeeded[doc_id].add(qid)
        if digest is not None:
            inputs[doc_id].add(digest)
    return Committed(dict(answered), dict(succeeded), keys.num_rows, dict(inputs))


def changed_inputs(docs: pa.Table, committed: Committed) -> list[str]:
    """Ids of the normalised ``docs`` whose committed rows were computed from other content: a row's
    ``input_hash`` that none of the document's questions has now (a changed context, question,
    answer prefix or limit under the same doc_id). Their old rows would otherwise be kept silently."""
    if not committed.inputs:
        return []
    columns = ["doc_id", "context", "questions", "question_ids", "answer_prefix", "max_new_tokens"]
    answered = docs.filter(pc.is_in(docs.column("doc_id"), pa.array(list(committed.inputs), pa.string())))
    return [  # only documents with committed rows are read into Python and hashed
        doc["doc_id"]
        for doc in answered.select(columns).to_pylist()
        if not committed.inputs[doc["doc_id"]] <= set(question_hashes(doc).values())
    ]


def dedupe(data_dir: str | os.PathLike | Location, settings_id: str) -> int:
    """Keep one row per (doc_id, question_id); returns the number of rows removed.

    The kept row is the first committed one without ``error``, else the first committed one. Files
    losing rows are rewritten under a new committed name (atomic), then the old file is deleted;
    a crash in between leaves duplicates that the next run removes, never a loss.
    """
    data_dir = resolve(data_dir)
    files = committed_files(data_dir)
    keys = _keys_of(files)  # the same listing: file indices must match ``files``
    if keys.num_rows == 0:
        return 0
    best: dict[tuple[str, str], tuple[bool, int, int]] = {}
    rows = zip(
        keys.column("doc_id").to_pylist(),
        keys.column("question_id").to_pylist(),
        keys.column("error").to_pylist(),
        keys.column("file").to_pylist(),
    )
    position = defaultdict(int)
    drop: dict[int, set[int]] = defaultdict(set)  # file index -> row positions to drop
    for doc_id, qid, error, file in rows:
        pos = position[file]
        position[file] += 1
        rank = (error is not None, file, pos)
        key = (doc_id, qid)
        if key not in best:
            best[key] = rank
        elif rank < best[key]:
            drop[best[key][1]].add(best[key][2])
            best[key] = rank
        else:
            drop[file].add(pos)
    removed = 0
    for file, positions in drop.items():
        location = files[file]
        table = pq.read_table(location.path, filesystem=location.fs)
        mask = pa.array([i not in positions for i in range(table.num_rows)])
        kept = table.filter(mask)
        removed += table.num_rows - kept.num_rows
        if kept.num_rows:
            new = commit_table(kept, data_dir, settings_id)
            if new != location:
                location.delete()
        else:
            location.delete()
    if removed and data_dir.is_local:
        fsync_directory(data_dir.path)
    return removed


def read_committed(data_dir: str | os.PathLike | Location, run_id: str | None = None) -> pa.Table:
    """All committed rows (optionally only those of one run) as an output-schema table."""
    locations = committed_files(data_dir)
    if not locations:
        return OUTPUT_SCHEMA.empty_table()
    dataset = pads.dataset(
        [loc.path for loc in locations], schema=OUTPUT_SCHEMA, format="parquet", filesystem=locations[0].fs
    )
    table = dataset.to_table(filter=None if run_id is None else pc.field("run_id") == run_id)
    return conform(table)
