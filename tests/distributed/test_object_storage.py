"""``s3://`` inputs and outputs, end to end against a local S3 server (moto), and URI parsing.

The S3 tests talk to a real S3 API over HTTP (moto's server on 127.0.0.1), through pyarrow's
``S3FileSystem`` configured by the standard ``AWS_*`` environment variables, exactly as a job on a
cluster would; Ray's workers get the same variables. Nothing reaches the internet.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from pipeline.data import read_table, rows_to_table, write_documents
from pipeline.data.locations import StorageError, is_uri, resolve, s3_options
from pipeline.distributed import JobConfigError, run_job, sink
from pipeline.report.tables import read_outputs
from tests.distributed.conftest import ROOT, small_docs, tiny_config
from tests.s3_server import s3_server

BUCKET = "criticalkv-test"


# ---------------------------------------------------------------------- parsing (offline)
def test_local_paths_and_file_uris_resolve_to_the_local_filesystem(tmp_path):
    assert not is_uri(str(tmp_path)) and not is_uri("org/dataset") and is_uri("s3://b/k")
    loc = resolve(tmp_path / "out")
    assert loc.is_local and loc.uri == str(tmp_path / "out") and os.fspath(loc) == str(tmp_path / "out")
    assert resolve(f"file://{tmp_path}/out") == loc
    assert loc.child("data", "x.parquet").uri == str(tmp_path / "out" / "data" / "x.parquet")


def test_object_store_uris_are_canonicalised_without_network():
    s3 = resolve("s3://bucket//runs/a/")
    assert (s3.uri, s3.path, s3.is_local) == ("s3://bucket/runs/a", "bucket/runs/a", False)
    assert isinstance(s3.fs, pafs.S3FileSystem)
    assert s3.child("data").uri == "s3://bucket/runs/a/data" and s3.child("data").path == "bucket/runs/a/data"
    with pytest.raises(TypeError, match="object storage"):
        os.fspath(s3)
    gs = resolve("gcs://bucket/x")
    assert gs.uri == "gs://bucket/x" and isinstance(gs.fs, pafs.GcsFileSystem)


def test_s3_region_and_endpoint_come_from_the_aws_variables():
    assert s3_options({}) == {}
    assert s3_options({"AWS_DEFAULT_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://minio:9000"}) == {
        "region": "eu-west-1",
        "scheme": "http",
        "endpoint_override": "minio:9000",
    }
    assert s3_options(
        {
            "AWS_REGION": "us-west-2",
            "AWS_DEFAULT_REGION": "eu-west-1",
            "AWS_ENDPOINT_URL_S3": "https://s3.example.com/",
            "AWS_ENDPOINT_URL": "http://x",
        }
    ) == {"region": "us-west-2", "scheme": "https", "endpoint_override": "s3.example.com"}
    with pytest.raises(StorageError, match="AWS_ENDPOINT_URL='minio:9000'"):
        s3_options({"AWS_ENDPOINT_URL": "minio:9000"})


@pytest.mark.parametrize(
    "uri, message",
    [
        ("ftp://host/x", "unsupported URI scheme 'ftp'"),
        ("s3://", "no bucket"),
        ("s3://bucket/x?endpoint_override=y", "query strings are not supported"),
        ("file://relative/x", "absolute path"),
    ],
)
def test_bad_uris_are_refused_with_the_reason(uri, message):
    with pytest.raises(StorageError, match=message):
        resolve(uri)


def test_job_config_keeps_uris_and_names_the_field_of_a_bad_one(tmp_path):
    config = tiny_config("s3://bucket/out/", input="gs://bucket/in/docs.parquet")
    assert config.output == "s3://bucket/out" and config.input == "gs://bucket/in/docs.parquet"
    assert tiny_config(tmp_path / "o").output == str(tmp_path / "o")  # Path objects are accepted as text
    with pytest.raises(ValidationError, match=r"output\n.*unsupported URI scheme 'hdfs'"):
        tiny_config("hdfs://namenode/out")
    with pytest.raises(ValidationError, match=r"input\n.*no bucket"):
        tiny_config(tmp_path / "o", input="s3://")


# ---------------------------------------------------------------------- a local S3 server
@pytest.fixture(scope="module")
def s3_env():
    """moto's S3 server on 127.0.0.1 and the AWS_* variables pointing at it (restored afterwards)."""
    with s3_server(BUCKET) as env:
        yield env


@pytest.fixture(scope="module")
def s3_ray(s3_env):
    """A local Ray whose workers (actors, write tasks, read tasks) see the same S3 settings."""
    import ray  # a hard dependency: missing, the test must fail, not skip

    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **s3_env}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _put(uri: str, data: bytes) -> None:
    resolve(uri).write_bytes(data)


def _parquet_bytes(table: pa.Table) -> bytes:
    out = pa.BufferOutputStream()
    pq.write_table(table, out)
    return out.getvalue().to_pybytes()


def _keys(table: pa.Table) -> Counter:
    return Counter(zip(table.column("doc_id").to_pylist(), table.column("question_id").to_pylist()))


def _rows(*keys, run="r1", error=None) -> pa.Table:
    return rows_to_table([{"doc_id": d, "question_id": q, "run_id": run, "error": error} for d, q in keys])


def test_location_reads_writes_lists_and_deletes_objects(s3_env):
    loc = resolve(f"s3://{BUCKET}/unit/a.txt")
    assert not loc.exists()
    loc.write_bytes(b"hello")
    assert loc.is_file() and loc.read_bytes() == b"hello" and loc.size() == 5
    parent = resolve(f"s3://{BUCKET}/unit")
    assert parent.is_dir() and [parent.at(i) for i in parent.files()] == [loc]
    loc.delete()
    loc.delete()  # already gone: not an error
    assert not loc.exists()


def test_sink_commits_dedupes_and_reads_back_on_s3(s3_env):
    data = resolve(f"s3://{BUCKET}/sink/data")
    first = sink.commit_table(_rows(("a", "0"), ("b", "0"), error="OOM"), data, "r1")
    again = sink.commit_table(_rows(("a", "0"), ("b", "0"), error="OOM"), data, "r1")  # a retried write
    assert first == again and first.uri.startswith(f"s3://{BUCKET}/sink/data/part-r1-")
    sink.commit_table(_rows(("a", "0"), ("b", "0"), ("c", "0"), run="r2"), data, "r2")
    assert len(sink.committed_files(data)) == 2 and sink.remove_debris(data) == 0
    assert sink.dedupe(data, "r3") == 2
    table = sink.read_committed(data)
    assert _keys(table) == Counter({("a", "0"): 1, ("b", "0"): 1, ("c", "0"): 1})
    assert all(e is None for e in table.column("error").to_pylist())  # rows without error win
    assert sink.read_committed(data, "r2").num_rows == 3


def test_inputs_are_read_from_s3_objects_and_prefixes(s3_env, tmp_path):
    docs = small_docs(3)
    local = write_documents(docs, tmp_path / "docs.parquet")
    _put(f"s3://{BUCKET}/inputs/one.parquet", local.read_bytes())
    _put(f"s3://{BUCKET}/inputs/dir/part-0.parquet", local.read_bytes())
    _put(f"s3://{BUCKET}/inputs/dir/_SUCCESS", b"")
    lines = [json.dumps({"context": "some text", "question": "q?"}), "{not json"]
    _put(f"s3://{BUCKET}/inputs/rows.jsonl", "\n".join(lines).encode())
    assert read_table(f"s3://{BUCKET}/inputs/one.parquet").num_rows == 3
    assert read_table(f"s3://{BUCKET}/inputs/dir").num_rows == 3
    raw = read_table(f"s3://{BUCKET}/inputs/rows.jsonl")
    assert raw.num_rows == 2 and raw.column("input_error").to_pylist()[1].startswith("line 2: invalid JSON")
    with pytest.raises(FileNotFoundError, match=f"input not found: s3://{BUCKET}/inputs/missing.parquet"):
        read_table(f"s3://{BUCKET}/inputs/missing.parquet")


def test_job_reads_and_writes_s3_and_resumes(s3_ray, tmp_path):
    docs = small_docs(4)
    local = write_documents(docs, tmp_path / "in.parquet", one_question_per_row=True)
    _put(f"s3://{BUCKET}/job/in.parquet", local.read_bytes())
    config = tiny_config(f"s3://{BUCKET}/job/out", input=f"s3://{BUCKET}/job/in.parquet")
    result = run_job(config, echo=False)
    expected = Counter((d["doc_id"], q) for d in docs for q in d["question_ids"])
    assert result.data_dir == f"s3://{BUCKET}/job/out/data" and result.missing_rows == 0
    table = sink.read_committed(result.data_dir)
    assert _keys(table) == expected and all(e is None for e in table.column("error").to_pylist())
    manifest = json.loads(resolve(result.manifest_path).read_bytes())
    assert manifest["output"] == f"s3://{BUCKET}/job/out" and manifest["runs"][-1]["status"] == "completed"
    names = [i.base_name for i in resolve(f"s3://{BUCKET}/job/out/data").files()]
    assert names and all(n.startswith("part-") for n in names)  # no temporary objects on S3

    again = run_job(config, echo=False)
    assert again.docs_skipped == len(docs) and again.rows_written == 0
    assert _keys(sink.read_committed(result.data_dir)) == expected
    assert read_outputs([f"s3://{BUCKET}/job/out"]).num_rows == sum(expected.values())  # the report reads URIs


def test_job_normalising_in_ray_reads_an_s3_prefix(s3_ray, tmp_path):
    docs = small_docs(3, seed=5)
    local = write_documents(docs, tmp_path / "in.parquet")
    _put(f"s3://{BUCKET}/rayjob/in/part-0.parquet", local.read_bytes())
    config = tiny_config(f"s3://{BUCKET}/rayjob/out", input=f"s3://{BUCKET}/rayjob/in", normalise="ray")
    result = run_job(config, echo=False)
    assert result.extra["normalise"] == "ray"
    assert _keys(sink.read_committed(result.data_dir)) == Counter(
        (d["doc_id"], q) for d in docs for q in d["question_ids"]
    )


def test_missing_bucket_and_missing_input_fail_before_ray_naming_the_field(s3_env, tmp_path):
    with pytest.raises(JobConfigError, match=r"^output: cannot access s3://no-such-bucket/out"):
        run_job(tiny_config("s3://no-such-bucket/out"), echo=False)
    with pytest.raises(JobConfigError, match=r"^input: input not found: s3://"):
        run_job(tiny_config(tmp_path / "o", input=f"s3://{BUCKET}/nothing/here.parquet"), echo=False)


def test_foreign_objects_under_an_output_prefix_are_refused(s3_env):
    _put(f"s3://{BUCKET}/foreign/notes.txt", b"someone else's")
    with pytest.raises(JobConfigError, match="not empty and holds no manifest.json"):
        run_job(tiny_config(f"s3://{BUCKET}/foreign"), echo=False)
