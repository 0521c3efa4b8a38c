"""Bad configuration fails before any actor starts, naming the field; CLI layering (no Ray)."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from pipeline.apps.batch_jobs import config_from_args
from pipeline.distributed import JobConfigError, run_job
from pipeline.distributed.config import JobConfig, SummarizeJob
from pipeline.kv.config import DEFAULT_CACHE_SIZE, DEFAULT_METHOD
from tests.distributed.conftest import ROOT, tiny_config


def _field_error(exc: ValidationError) -> str:
    return ".".join(str(p) for p in exc.errors()[0]["loc"])


def test_unknown_method_names_the_field(tmp_path):
    with pytest.raises(ValidationError) as info:
        JobConfig(output=tmp_path / "o", compression={"method": "fastkv"})
    assert _field_error(info.value) == "compression" and "method 'fastkv': unknown scorer" in str(info.value)


def test_missing_input_path_names_the_field(tmp_path):
    with pytest.raises(ValidationError) as info:
        JobConfig(output=tmp_path / "o", input=str(tmp_path / "missing.parquet"))
    assert _field_error(info.value) == "input" and "no such file" in str(info.value)


def test_output_that_is_a_file_names_the_field(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValidationError) as info:
        JobConfig(output=tmp_path / "file")
    assert _field_error(info.value) == "output" and "is a file" in str(info.value)
    with pytest.raises(ValidationError, match="min_actors"):
        JobConfig(output=tmp_path / "o", min_actors=3, max_actors=2)


def test_unknown_columns_fail_before_ray(tmp_path):
    pq.write_table(pa.table({"id": ["a"], "text": ["t"], "q": ["?"]}), tmp_path / "in.parquet")
    config = tiny_config(tmp_path / "out", input=str(tmp_path / "in.parquet"), columns={"context": "body"})
    with pytest.raises(JobConfigError) as info:
        run_job(config, echo=False)
    assert info.value.field == "columns" and "available columns: id, text, q" in str(info.value)
    assert not (tmp_path / "out").exists()  # nothing created, no actor started
    ray_mode = config.model_copy(update={"normalise": "ray"})
    with pytest.raises(JobConfigError, match="columns: .*context='body'"):
        run_job(ray_mode, echo=False)


def test_foreign_non_empty_output_directory_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(JobConfigError, match="output: .*not empty"):
        run_job(tiny_config(tmp_path / "out"), echo=False)


def test_yaml_then_flags_layering(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "compression: {method: snapkv, cache_size: 0.3, window: 8}\nmodel: {name: tiny-llama}\n"
        "max_actors: 3\ncolumns: {context: text}\n"
    )
    config = config_from_args(
        "longdoc_qa",
        [
            "--config",
            str(path),
            "--cache-size",
            "0.2",
            "--num-actors",
            "2",
            "--output",
            str(tmp_path / "o"),
            "--question-column",
            "q",
        ],
    )
    assert config.compression.method == "snapkv" and config.compression.cache_size == 0.2
    assert config.compression.window == 8 and config.model.name == "tiny-llama"
    assert (config.min_actors, config.max_actors) == (2, 2)
    assert config.columns.model_dump(exclude_unset=True) == {"context": "text", "question": "q"}


def test_job_defaults_and_fresh_output_dir():
    qa = config_from_args("longdoc_qa", [])
    assert qa.job == "longdoc_qa" and qa.input is None and qa.model.name == "smollm2"
    assert qa.compression.method == DEFAULT_METHOD == "criticalkv-shares-kvzap"
    assert qa.compression.cache_size == DEFAULT_CACHE_SIZE and str(qa.output).startswith("outputs/longdoc_qa-")
    summary = config_from_args("summarize", ["--max-new-tokens", "50"])
    assert summary.instruction and summary.generation.max_new_tokens == 50
    assert str(summary.output).startswith("outputs/summarize-")
    # a flag over the job's default method keeps the rest of it: selection stays criticalkv
    partial = config_from_args("longdoc_qa", ["--allocation", "adakv", "--cache-size", "0.3"])
    assert partial.compression.method == "criticalkv-adakv-kvzap" and partial.compression.cache_size == 0.3
    assert config_from_args("longdoc_qa", ["--method", "none"]).compression.method == "none"


def test_the_automatic_batch_size_fills_calls_without_idling_actors():
    """Without --batch-size a call holds up to 8 documents (a continuous decode batch), fewer when that
    would leave actors without a call; a sweep decodes its settings side by side, one document a call."""
    qa = config_from_args("longdoc_qa", [])
    assert qa.generation.batch_size is None
    assert [qa.batch_size_for(n) for n in (None, 1, 3, 8, 100)] == [8, 1, 3, 8, 8]
    pool = config_from_args("longdoc_qa", ["--num-actors", "4"])
    assert [pool.batch_size_for(n) for n in (4, 10, 33, 1000)] == [1, 3, 8, 8]
    assert config_from_args("longdoc_qa", ["--batch-size", "2"]).batch_size_for(100) == 2
    from pipeline.apps.eval_sweep import EvalJob

    assert EvalJob(output="o").batch_size_for(100) == 1
    assert config_from_args("summarize", ["--num-actors", "2"]).batch_size_for(5) == 3


def test_a_rerun_may_change_how_rows_are_computed_but_not_what_they_mean():
    """The fingerprint a resumed run must match ignores batching, the KV memory, the prefill pacing and
    the layerwise prefill's slicing (the same answers), and not the decoding limits or the method."""
    base = config_from_args("longdoc_qa", []).fingerprint()
    for flags in (
        ["--batch-size", "3"],
        ["--kv-memory", "64"],
        ["--no-continuous"],
        ["--decode-between-prefills", "0.5"],
        ["--layerwise-prefill", "512"],
    ):
        assert config_from_args("longdoc_qa", flags).fingerprint() == base, flags
    for flags in (["--max-new-tokens", "9"], ["--cache-size", "0.3"], ["--method", "none"]):
        assert config_from_args("longdoc_qa", flags).fingerprint() != base, flags


def test_method_parts_and_spelling_are_one_setting(tmp_path):
    by_parts = config_from_args("longdoc_qa", ["--scorer", "snapkv", "--allocation", "headkv", "--selection", "topk"])
    by_name = config_from_args("longdoc_qa", ["--method", "headkv-snapkv"])
    assert by_parts.compression == by_name.compression and by_name.compression.method == "headkv-snapkv"
    path = tmp_path / "job.yaml"
    path.write_text("compression: {method: adakv-snapkv}\n")
    layered = config_from_args("longdoc_qa", ["--config", str(path), "--selection", "criticalkv"])
    assert layered.compression.method == "criticalkv-adakv-snapkv"


def test_every_option_has_help_with_its_default():
    from pipeline.apps.batch_jobs import build_parser

    for job in ("longdoc_qa", "summarize"):
        parser = build_parser(job)
        for action in parser.parser._actions:
            if action.option_strings and action.dest not in ("help", "config"):
                assert action.help and ("default:" in action.help or "(required)" in action.help), action.dest
        text = parser.parser.format_help()
        assert "--method METHOD" in text and f"(default: {DEFAULT_METHOD})" in text
    assert "--question-column" in build_parser("longdoc_qa").parser.format_help()
    assert "--question-column" not in build_parser("summarize").parser.format_help()
    assert "--instruction" in build_parser("longdoc_qa").parser.format_help()  # one question for every document


def test_cli_reports_bad_values_with_exit_code_2(tmp_path, capsys):
    cases = [
        (["--method", "fastkv"], "invalid --method: method 'fastkv': unknown scorer"),
        (["--input", str(tmp_path / "nope.jsonl")], "invalid --input (input): no such file"),
        (["--cache-size", "1.5"], "invalid --cache-size (compression.cache_size)"),
        (["--method", "snapkv", "--selection", "criticalkv"], "it sets selection='topk', but selection='criticalkv'"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as info:
            config_from_args("longdoc_qa", argv + ["--output", str(tmp_path / "o")])
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_cli_subprocess_unknown_column_names_the_field(tmp_path):
    pq.write_table(pa.table({"doc_id": ["a"], "context": ["t"]}), tmp_path / "in.parquet")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "jobs" / "longdoc_qa.py"),
            "--input",
            str(tmp_path / "in.parquet"),
            "--output",
            str(tmp_path / "out"),
            "--question-column",
            "prompt",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "invalid columns" in proc.stderr and "question='prompt'" in proc.stderr, proc.stderr[-2000:]
    assert "Ray" not in proc.stderr and not (tmp_path / "out").exists()


def test_summarize_instruction_replaces_questions(tmp_path):
    from pipeline.distributed.inputs import load_documents

    rows = [{"doc_id": "a", "text": "Report one.", "summary": "ref"}, {"doc_id": "b", "text": "Report two."}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = JobConfig(
        job="summarize",
        output=tmp_path / "o",
        input=str(tmp_path / "in.jsonl"),
        instruction="Summarise.",
        columns={"context": "text", "reference": "summary"},
    )
    docs = load_documents(config).to_pylist()
    assert [(d["doc_id"], d["questions"], d["question_ids"]) for d in docs] == [
        ("a", ["Summarise."], ["0"]),
        ("b", ["Summarise."], ["0"]),
    ]
    assert docs[0]["references"] == [["ref"]] and docs[0]["input_error"] is None


def test_qa_instruction_asks_every_document_one_question(tmp_path):
    """--instruction on the QA job: each document (its own questions or none) gets that one question;
    the built-in samples too."""
    from pipeline.distributed.inputs import load_documents

    rows = [{"doc_id": "a", "text": "One.", "question": "Own?"}, {"doc_id": "a", "text": "One.", "question": "More?"}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = config_from_args(
        "longdoc_qa",
        ["--output", str(tmp_path / "o"), "--input", str(tmp_path / "in.jsonl"), "--context-column", "text"]
        + ["--instruction", "Who wrote it?"],
    )
    docs = load_documents(config).to_pylist()
    assert [(d["doc_id"], d["questions"], d["question_ids"]) for d in docs] == [("a", ["Who wrote it?"], ["0"])]
    samples = load_documents(config_from_args("longdoc_qa", ["--output", str(tmp_path / "s"), "--instruction", "Q?"]))
    assert samples.num_rows == 3 and all(q == ["Q?"] for q in samples.column("questions").to_pylist())


def test_every_job_offers_only_the_fields_that_apply_to_it(tmp_path):
    """Configs are composed, not trimmed: the sweep has no built-in samples, no method or budget of its
    own and no continuous batch; the summaries have no question columns; no config hides inherited fields."""
    from pipeline.apps.eval_sweep import EvalJob
    from pipeline.options import CommandLineConfig

    sweep = EvalJob(output=tmp_path / "o")
    assert not {"sample_docs", "sample_words", "sample_seed"} & set(EvalJob.model_fields)
    assert not {"scorer", "cache_size", "budget", "method"} & set(type(sweep.compression).model_fields)
    assert not {"continuous", "kv_memory"} & set(type(sweep.generation).model_fields)
    assert (
        "settings_per_decode"
        not in type(config_from_args("summarize", ["--output", str(tmp_path / "s")]).generation).model_fields
    )
    assert "question" not in type(SummarizeJob(output=tmp_path / "s").columns).model_fields
    assert not hasattr(CommandLineConfig, "cli_exclude")
    with pytest.raises(ValidationError, match="sample_docs"):
        EvalJob(output=tmp_path / "o", sample_docs=2)


def test_missing_model_file_fails_before_ray(tmp_path, monkeypatch):
    from pipeline.distributed.cluster import check_model

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = JobConfig(output=tmp_path / "o", model={"name": str(tmp_path / "missing.gguf")})
    with pytest.raises(JobConfigError) as info:
        check_model(config)
    assert info.value.field == "model.name" and "GGUF file not found" in str(info.value)
    check_model(config.model_copy(update={"ray_address": "ray://cluster:10001"}))  # may exist on the workers only


KVZAP = ["--method", "criticalkv-shares-kvzap"]


def test_a_kvzap_file_made_for_another_model_fails_before_ray_with_exit_code_2(tmp_path, capsys):
    from tests.tiny import tiny_kvzap_file, tiny_loaded

    path = tiny_kvzap_file(tiny_loaded("llama"), tmp_path)  # calibrated for "tiny-llama"
    cases = [
        (
            KVZAP + ["--kvzap-model", str(path)],
            "was calibrated for model 'tiny-llama', but this run uses model 'smollm2'",
        ),
        (KVZAP + ["--kvzap-model", str(tmp_path / "none.safetensors")], "kvzap_model: file not found"),
        (
            ["--model", str(tmp_path), "--method", "shares-snapkv", "--calibrate", "off"],
            f"none ships for model '{tmp_path}'",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as info:
            config_from_args("longdoc_qa", argv + ["--output", str(tmp_path / "o")])
        assert info.value.code == 2
        assert message in capsys.readouterr().err
    # without --calibrate off the job defers to a calibration on its own documents (test_self_calibration.py)
    assert config_from_args(
        "longdoc_qa", ["--model", str(tmp_path), "--method", "shares-snapkv", "--output", str(tmp_path / "o")]
    )
    # the learned method on the bundled model resolves the shipped file
    assert config_from_args("longdoc_qa", KVZAP + ["--output", str(tmp_path / "o")]).compression.kvzap_model is None


def _custom_code_model(directory, model_type="my_custom_lm"):
    directory.mkdir()
    auto_map = {"AutoConfig": "modeling.MyConfig", "AutoModelForCausalLM": "modeling.MyModel"}
    (directory / "config.json").write_text(json.dumps({"model_type": model_type, "auto_map": auto_map}))
    (directory / "model.safetensors").write_bytes(b"")
    return directory


def test_a_model_needing_its_own_code_fails_before_ray_naming_trust_remote_code(tmp_path, monkeypatch, capsys):
    import ray

    from pipeline.apps.batch_jobs import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = _custom_code_model(tmp_path / "custom")
    argv = ["--model", str(model), "--method", "snapkv", "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as info:
        main("longdoc_qa", argv)
    assert info.value.code == 2 and not ray.is_initialized()
    err = capsys.readouterr().err
    assert "invalid model.trust_remote_code" in err and "--trust-remote-code" in err and "modeling.MyModel" in err


def test_remote_code_check_lets_native_types_and_trusted_repositories_through(tmp_path):
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.loading import RemoteCodeRefused, check_remote_code

    custom = _custom_code_model(tmp_path / "custom") / "config.json"
    native = _custom_code_model(tmp_path / "native", model_type="llama") / "config.json"
    with pytest.raises(RemoteCodeRefused):
        check_remote_code(custom, ModelConfig(name="custom"))
    check_remote_code(custom, ModelConfig(name="custom", trust_remote_code=True))
    check_remote_code(native, ModelConfig(name="native"))  # transformers uses its own llama code


def test_an_optional_number_takes_none_on_the_command_line(tmp_path, capsys):
    out = ["--output", str(tmp_path / "o")] + KVZAP  # a one-pass scorer: it can be chunked
    chunked = config_from_args("longdoc_qa", ["--prefill-chunk", "512", "--budget", "64"] + out).compression
    assert (chunked.prefill_chunk, chunked.budget) == (512, 64)
    plain = config_from_args("longdoc_qa", ["--prefill-chunk", "none", "--budget", "None"] + out).compression
    assert (plain.prefill_chunk, plain.budget) == (None, None)
    with pytest.raises(SystemExit) as info:
        config_from_args("longdoc_qa", ["--prefill-chunk", "many"] + out)
    assert info.value.code == 2 and "invalid int or none value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize("job", ["summarize", "eval_compression"])
def test_an_empty_instruction_is_refused_for_every_job(job, tmp_path):
    """It used to be checked for summaries only (the base config compared its job name); a sweep of
    your own documents takes --instruction too."""
    with pytest.raises(ValueError, match="instruction must not be empty"):
        JobConfig(job=job, output=tmp_path / "o", instruction="  ")


def test_a_job_without_built_in_samples_asks_for_an_input(tmp_path):
    """The driver's JobConfig (what a sweep builds) has no sample documents: no input is a clear error."""
    from pipeline.distributed.inputs import load_documents

    with pytest.raises(JobConfigError, match="input: the eval_compression job has no built-in sample documents"):
        load_documents(JobConfig(job="eval_compression", output=tmp_path / "o"))
