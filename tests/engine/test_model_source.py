"""Models from where users keep them: a Hub id (a local server plays the Hub), an ``s3://`` directory
(moto), the node-wide download lock, offline use of a complete cache only, and the pre-flight's
one-sentence errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from pipeline.data.locations import resolve
from pipeline.engine.config import ModelConfig
from pipeline.engine.loading import RemoteCodeRefused, load_model
from pipeline.engine.model_source import (
    ModelNotFoundError,
    check_hub,
    check_object_store,
    fetch_hub,
    fetch_object_store,
    kind_of,
    missing_files,
)
from tests.hub_server import HubServer, Repo, repo_from_directory
from tests.s3_server import s3_server
from tests.tiny import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def save_tiny(directory: Path, seed: int = 0) -> Path:
    """The tiny Llama and its tokenizer as a safetensors model directory."""
    tiny_model("llama", seed=seed).cpu().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def hub_repos(tmp: Path) -> dict[str, Repo]:
    tiny = repo_from_directory(save_tiny(tmp / "tiny"))
    tiny.files["pytorch_model.bin"] = b"pickled weights are never fetched"
    tiny.files["README.md"] = b"# tiny"
    other = repo_from_directory(save_tiny(tmp / "other", seed=1))
    tiny.branches["v1"] = tiny.commit
    custom = json.loads(tiny.files["config.json"])
    custom.update(model_type="my-own-arch", auto_map={"AutoModelForCausalLM": "modeling_mine.MyModel"})
    return {
        "org/tiny": tiny,
        "org/other": other,
        "org/gated": Repo(dict(tiny.files), gated=True),
        "org/pickled": Repo({"config.json": tiny.files["config.json"], "pytorch_model.bin": b"x"}),
        "org/custom": Repo({**tiny.files, "config.json": json.dumps(custom).encode()}),
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with HubServer(hub_repos(tmp_path_factory.mktemp("repos"))) as server:
        yield server


@pytest.fixture
def hub_env(hub, tmp_path, monkeypatch):
    """This process talks to the test Hub, with an empty Hugging Face cache and no token."""
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub.downloads.clear()
    return tmp_path


def test_names_are_told_apart_without_network():
    short = {"smollm2": ()}
    assert kind_of("smollm2", short) == "bundled" and kind_of("SmolLM2", short) == "bundled"
    assert kind_of("meta-llama/Llama-3.1-8B-Instruct", short) == "hub" and kind_of("gpt2", short) == "hub"
    assert kind_of("s3://bucket/models/llama", short) == kind_of("gs://b/m", short) == "object_store"
    assert kind_of("./model", short) == kind_of("/abs/model", short) == "directory"
    assert kind_of("model.Q4.gguf", short) == "gguf"


def test_hub_model_is_downloaded_once_with_only_safetensors_files_and_loads(hub, hub_env):
    facts = check_hub("org/tiny", None, False)
    assert facts["commit"] == hub.repos["org/tiny"].commit and Path(facts["config_file"]).is_file()
    loaded = load_model(ModelConfig(name="org/tiny", cache_dir=hub_env / "ck"))
    again = load_model(ModelConfig(name="org/tiny", revision="v1", cache_dir=hub_env / "ck"))
    fetched = {k.split("/", 2)[2] for k in hub.downloads}
    assert "pytorch_model.bin" not in fetched and "README.md" not in fetched and "model.safetensors" in fetched
    assert max(hub.downloads.values()) == 1  # the second load (same commit) downloaded nothing
    ids = torch.tensor([[1, 2, 3, 4]])
    reference = tiny_model("llama").cpu()(ids).logits
    for model in (loaded.model, again.model):
        assert torch.allclose(model(ids).logits, reference, atol=1e-5)  # column weight layout: rounding


@pytest.mark.parametrize(
    "name, revision, message",
    [
        ("org/missing", None, "no model 'org/missing' on the Hub"),
        ("org/tiny", "v9", "has no revision 'v9'"),
        ("org/gated", None, "is gated and this token has no access"),
        ("org/pickled", None, "no *.safetensors weights on the Hub"),
    ],
)
def test_hub_preflight_names_the_problem_in_one_sentence(hub_env, name, revision, message):
    with pytest.raises(ModelNotFoundError) as caught:
        check_hub(name, revision, False)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_gated_repo_downloads_with_a_token(hub_env, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert check_hub("org/gated", None, False)["commit"]
    assert (fetch_hub("org/gated", None, False, hub_env / "ck") / "model.safetensors").is_file()


def test_custom_code_model_is_refused_before_loading(hub_env):
    with pytest.raises(RemoteCodeRefused, match="--trust-remote-code"):
        load_model(ModelConfig(name="org/custom", cache_dir=hub_env / "ck"))


def test_offline_uses_only_a_complete_cached_copy(hub, hub_env, monkeypatch):
    path = fetch_hub("org/tiny", None, False, hub_env / "ck")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: no network used
    assert check_hub("org/tiny", None, False)["commit"] == path.name
    assert fetch_hub("org/tiny", None, False, hub_env / "ck") == path
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache .* and HF_HUB_OFFLINE is set"):
        check_hub("org/other", None, False)
    (path / "model.safetensors").unlink()  # a download cut short
    assert missing_files(path) == ["*.safetensors"]
    with pytest.raises(ModelNotFoundError, match="incomplete"):
        fetch_hub("org/tiny", None, False, hub_env / "ck")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    assert (fetch_hub("org/tiny", None, False, hub_env / "ck") / "model.safetensors").is_file()  # finished online


def test_two_processes_on_one_node_download_each_file_once(hub, hub_env):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(hub_env / "hf"), "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_OFFLINE", None)
    code = (
        "import sys; from pathlib import Path; from pipeline.engine.model_source import fetch_hub; "
        f"print(fetch_hub('org/other', None, False, Path({str(hub_env / 'ck')!r})))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    assert missing_files(Path(paths.pop())) == []
    assert hub.downloads and set(hub.downloads.values()) == {1}


# ---------------------------------------------------------------------- s3://
@pytest.fixture
def s3_model(tmp_path):
    """The tiny model under s3://models/tiny on a local moto server (AWS_* variables set)."""
    with s3_server("models"):
        for path in save_tiny(tmp_path / "tiny").iterdir():
            resolve(f"s3://models/tiny/{path.name}").write_bytes(path.read_bytes())
        resolve("s3://models/tiny/pytorch_model.bin").write_bytes(b"never fetched")
        yield "s3://models/tiny"


def test_s3_model_directory_is_fetched_once_and_again_when_it_changed(s3_model, tmp_path):
    facts = check_object_store(s3_model, False)
    assert facts["kind"] == "object_store" and facts["config"]["model_type"] == "llama"
    local = fetch_object_store(s3_model, False, tmp_path / "ck")
    assert not (local / "pytorch_model.bin").exists() and missing_files(local) == []
    stamp = (local / "model.safetensors").stat().st_mtime_ns
    assert fetch_object_store(s3_model, False, tmp_path / "ck") == local
    assert (local / "model.safetensors").stat().st_mtime_ns == stamp  # the same listing: not downloaded again
    loaded = load_model(ModelConfig(name=s3_model, cache_dir=tmp_path / "ck"))
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(loaded.model(ids).logits, tiny_model("llama").cpu()(ids).logits, atol=1e-5)
    resolve(f"{s3_model}/config.json").write_bytes((local / "config.json").read_bytes() + b"\n")
    assert fetch_object_store(s3_model, False, tmp_path / "ck") == local
    assert (local / "model.safetensors").stat().st_mtime_ns != stamp  # the listing changed: fetched again
    assert not list(local.parent.glob("*.tmp-*")) and not list(local.parent.glob("*.old"))


def test_s3_preflight_names_a_missing_directory_and_missing_weights(s3_model):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        check_object_store("s3://models/nothing-here", False)
    with pytest.raises(ModelNotFoundError, match="could not be read"):
        check_object_store("s3://no-such-bucket/tiny", False)


def test_offline_driver_of_a_remote_cluster_leaves_the_check_to_the_workers(monkeypatch, tmp_path):
    from pipeline.distributed.cluster import check_model_source
    from pipeline.distributed.rundir import JobConfigError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    facts = check_model_source(ModelConfig(name="org/only-on-the-workers"), remote=True)
    assert facts["checked"] is False and facts["offline"] is True
    with pytest.raises(JobConfigError, match="HF_HUB_OFFLINE"):  # a local Ray: this machine is where it runs
        check_model_source(ModelConfig(name="org/only-on-the-workers"), remote=False)
