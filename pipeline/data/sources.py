"""Read documents from Parquet, JSONL, ``datasets`` directories or the Hugging Face hub.

``read_documents(path_or_name, mapping)`` is ``normalise_batch(read_table(path_or_name), mapping)``
followed by :func:`check_duplicate_ids`; the Ray driver can do the same in two steps (read with
``read_table`` or Ray's own readers, then ``map_batches(normalise_batch, ...)``).

What ``path_or_name`` may be, tried in this order:

* a ``.parquet`` file, or a directory holding ``*.parquet`` files (searched recursively, read in
  sorted path order, schemas unified);
* a directory written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
* a ``.jsonl`` / ``.ndjson`` / ``.json`` file of JSON objects, one per line (a ``.json`` file
  holding a single JSON array is accepted too). A line that is not valid UTF-8, not valid JSON or
  not an object becomes a row with only ``input_error`` set ("line 7: invalid JSON: ..."), and a
  field whose JSON type differs from the other lines' is nulled with such a message, so one bad
  line never stops a run;
* otherwise, when the string is not an existing path and does not look like one, a hub dataset
  name (``datasets.load_dataset(name, config, split=...)``); failures become :class:`DataSourceError`.

``s3://`` and ``gs://`` URIs (see :mod:`pipeline.data.locations`) name a Parquet or JSON-lines object, or a
prefix of Parquet objects, read through pyarrow's filesystems; ``datasets`` directories are read
from local paths only.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from collections.abc import Collection
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.data.locations import Location, StorageError, is_uri, resolve
from pipeline.data.normalise import ColumnMapping, check_duplicate_ids, normalise_batch

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DataSourceError(ValueError):
    """An input could not be opened or read as a whole (as opposed to one bad row)."""


def _kind(value: object) -> str:
    """The JSON type of a parsed value, with its article ("a string", "an object")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _column(name: str, values: list, lines: list[int], errors: list[list[str]], strict: bool) -> pa.Array:
    """An Arrow column from JSON values; values of a minority JSON type are nulled and reported."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        pass
    kinds = Counter(_kind(v) for v in values if v is not None)
    main = kinds.most_common(1)[0][0]
    kept = []
    for i, value in enumerate(values):
        if value is not None and _kind(value) != main:
            if strict:
                errors[i].append(
                    f"line {lines[i]}: field {name!r} is {_a(_kind(value))}, expected {_a(main)} like the other lines"
                )
            value = None
        kept.append(value)
    try:
        return pa.array(kept)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # e.g. nested lists of mixed types
        return pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())


def read_jsonl(path: str | os.PathLike | Location, fields: Collection[str] | None = None) -> pa.Table:
    """Read JSON lines into a raw Arrow table with an ``input_error`` column (null on good lines).

    An ``input_line`` column holds each row's line number, so later messages can name the line.

    ``fields``: the columns that matter downstream; a type clash in another column only turns that
    column into JSON text instead of flagging the rows. None means every column matters.
    """
    location = resolve(path)
    data = location.read_bytes()
    if location.suffix == ".json" and data.lstrip()[:1] == b"[":
        try:
            records = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataSourceError(f"{path}: not a valid JSON array file: {exc}") from None
        items = [(i + 1, rec, None) for i, rec in enumerate(records)]
    else:
        items = []
        for number, raw in enumerate(data.split(b"\n"), start=1):
            if not raw.strip():
                continue
            try:
                items.append((number, json.loads(raw.decode("utf-8")), None))
            except UnicodeDecodeError as exc:
                items.append((number, None, f"invalid UTF-8 ({exc.reason} at byte {exc.start})"))
            except json.JSONDecodeError as exc:
                items.append((number, None, f"invalid JSON ({exc.msg} at column {exc.colno})"))
    rows, lines, errors = [], [], []
    for number, record, problem in items:
        if problem is None and not isinstance(record, dict):
            problem = f"expected a JSON object, got {_a(_kind(record))}"
        if problem is None:
            try:
                json.dumps(record, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                problem = "invalid Unicode (a lone surrogate \\u escape)"
        rows.append(record if problem is None else {})
        lines.append(number)
        errors.append([] if problem is None else [f"line {number}: {problem}"])
        if problem is None and isinstance(record.get("input_error"), str):  # a normalised file
            errors[-1].append(record["input_error"])
    names = list(dict.fromkeys(k for row in rows for k in row if k not in ("input_error", "input_line")))
    arrays = [
        _column(name, [row.get(name) for row in rows], lines, errors, fields is None or name in fields)
        for name in names
    ]
    error_col = pa.array(["; ".join(e) if e else None for e in errors], pa.string())
    line_col = pa.array(lines, pa.int64())
    return pa.Table.from_arrays(arrays + [error_col, line_col], names=names + ["input_error", "input_line"])


def is_datasets_dir(location: Location) -> bool:
    """A directory written by ``datasets``' ``save_to_disk``."""
    return location.child("dataset_info.json").is_file() or location.child("dataset_dict.json").is_file()


def parquet_files(location: Location) -> list[pafs.FileInfo]:
    """The Parquet files under a directory or prefix (recursive, sorted by path), skipping names
    that start with ``.`` or ``_`` at any level (temporary files, ``_SUCCESS`` markers)."""
    listed = [
        i
        for i in location.files(recursive=True)
        if i.extension in ("parquet", "pq")
        and not any(part.startswith((".", "_")) for part in location.relative(i).parts)
    ]
    return sorted(listed, key=lambda i: i.path)


def _read_parquet_file(location: Location) -> pa.Table:
    try:
        return pq.read_table(location.path, filesystem=location.fs)
    except (pa.ArrowInvalid, OSError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataSourceError(f"{location}: not a readable Parquet file ({detail})") from None


def directory_files(location: Location) -> tuple[list[pafs.FileInfo], list[pafs.FileInfo]]:
    """(readable input files, other files) under a directory or prefix, recursive and sorted by path,
    skipping names that start with ``.`` or ``_`` at any level (temporary files, ``_SUCCESS``)."""
    listed = [
        i
        for i in location.files(recursive=True)
        if not any(part.startswith((".", "_")) for part in location.relative(i).parts)
    ]
    listed.sort(key=lambda i: i.path)
    readable = tuple(s.lstrip(".") for s in PARQUET_SUFFIXES + JSONL_SUFFIXES)
    return [i for i in listed if i.extension in readable], [i for i in listed if i.extension not in readable]


def _read_directory(location: Location, fields: Collection[str] | None, ignore_unknown_files: bool) -> pa.Table:
    """Every Parquet and JSON-lines file of a directory, concatenated (columns unified). Other files
    are refused, or skipped with a warning that lists them."""
    files, unknown = directory_files(location)
    if unknown:
        names = ", ".join(location.relative(i).as_posix() for i in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        if not ignore_unknown_files:
            raise DataSourceError(
                f"{location}: {len(unknown)} file(s) that are neither Parquet nor JSON lines ({names}); remove "
                "them or pass ignore_unknown_files (--ignore-unknown-files) to skip them"
            )
        warnings.warn(
            f"skipping {len(unknown)} file(s) of {location} that are neither Parquet nor JSON lines: {names}",
            stacklevel=2,
        )
    if not files:
        raise DataSourceError(
            f"{location}: directory holds no Parquet or JSON-lines files and is not a datasets directory"
        )
    tables = []
    for info in files:
        table = _read_file(location.at(info), fields)
        if "input_error" in table.column_names:  # JSON lines: say which file a "line N" is in
            errors = table.column("input_error").to_pylist()
            named = [None if e is None else f"{location.relative(info).as_posix()} {e}" for e in errors]
            table = table.set_column(
                table.column_names.index("input_error"), "input_error", pa.array(named, pa.string())
            )
        tables.append(table)
    return pa.concat_tables(tables, promote_options="permissive")


def _read_file(location: Location, fields: Collection[str] | None) -> pa.Table:
    if location.suffix in PARQUET_SUFFIXES:
        return _read_parquet_file(location)
    if location.suffix in JSONL_SUFFIXES:
        return read_jsonl(location, fields)
    raise DataSourceError(
        f"{location}: unsupported file type {location.suffix!r}; use Parquet ({', '.join(PARQUET_SUFFIXES)}) "
        f"or JSON lines ({', '.join(JSONL_SUFFIXES)})"
    )


def _read_object_store(uri: str, fields: Collection[str] | None, ignore_unknown_files: bool) -> pa.Table:
    try:
        location = resolve(uri)
    except StorageError as exc:
        raise DataSourceError(str(exc)) from exc
    try:
        info = location.info()
        if info.type == pafs.FileType.File:
            return _read_file(location, fields)
        if info.type == pafs.FileType.Directory:
            return _read_directory(location, fields, ignore_unknown_files)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataSourceError(f"{location}: cannot read ({type(exc).__name__}: {exc})") from exc
    raise FileNotFoundError(f"input not found: {location}")


def _pick_split(dataset, split: str | None, where: str):
    import datasets  # slow to import; only datasets directories and hub names need it

    if isinstance(dataset, datasets.DatasetDict):
        names = list(dataset)
        if split is None:
            split = "train" if "train" in names else (names[0] if len(names) == 1 else None)
        if split not in dataset:
            raise DataSourceError(f"{where}: choose a split with split=...; available splits: {', '.join(names)}")
        dataset = dataset[split]
    return dataset.with_format("arrow")[:]


def looks_like_path(text: str) -> bool:
    """Hub names are ``name`` or ``owner/name``; anything else is meant as a local path."""
    return (
        text.startswith((".", "/", "~"))
        or "\\" in text
        or text.count("/") > 1
        or text.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)
    )


def read_table(
    path_or_name: str | os.PathLike,
    *,
    split: str | None = None,
    config: str | None = None,
    fields: Collection[str] | None = None,
    ignore_unknown_files: bool = False,
) -> pa.Table:
    """Read an input as a raw Arrow table (columns as stored; see the module docstring).

    ``split``: which split of a saved ``DatasetDict`` or hub dataset (default ``train`` when there,
    or the only split). ``config``: hub dataset configuration name. ``fields``: see :func:`read_jsonl`.
    ``ignore_unknown_files``: skip (with a warning) files of an input directory that are neither
    Parquet nor JSON lines, instead of refusing the directory.
    """
    if is_uri(path_or_name):
        return _read_object_store(path_or_name, fields, ignore_unknown_files)
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        if is_datasets_dir(resolve(path)):
            import datasets  # slow to import; only datasets directories and hub names need it

            try:
                loaded = datasets.load_from_disk(str(path))
            except Exception as exc:  # noqa: BLE001 - any failure here is an unreadable directory
                raise DataSourceError(f"{path}: could not load the saved datasets directory: {exc}") from exc
            return _pick_split(loaded, split, str(path))
        return _read_directory(resolve(path), fields, ignore_unknown_files)
    if path.is_file():
        return _read_file(resolve(path), fields)
    name = str(path_or_name)
    if looks_like_path(name):
        raise FileNotFoundError(f"input not found: {name}")
    try:
        import datasets  # slow to import; only datasets directories and hub names need it

        loaded = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - hub/network/format failures all mean the same to a user
        raise DataSourceError(
            f"{name!r} is not an existing file or directory, and loading it as a Hugging Face hub "
            f"dataset failed ({type(exc).__name__}: {exc})"
        ) from exc
    return _pick_split(loaded, split, name)


def read_documents(
    path_or_name: str | os.PathLike,
    columns: ColumnMapping | None = None,
    *,
    split: str | None = None,
    config: str | None = None,
    check_duplicates: bool = True,
) -> pa.Table:
    """Read an input and normalise it to ``DOCUMENT_SCHEMA`` (one row per document).

    Bad rows are kept with ``input_error`` set (see :mod:`pipeline.data.normalise`); a missing
    required column raises ``ValueError`` listing the available ones; with ``check_duplicates``
    two documents sharing a ``doc_id`` raise ``ValueError`` naming them.
    """
    columns = columns or ColumnMapping()
    fields = [c for c in columns.model_dump().values() if c] + [
        "doc_id",
        "question",
        "questions",
        "question_id",
        "question_ids",
        "reference",
        "references",
        "answer_prefix",
        "max_new_tokens",
    ]
    table = normalise_batch(read_table(path_or_name, split=split, config=config, fields=fields), columns, row_offset=0)
    if check_duplicates:
        check_duplicate_ids(table)
    return table
