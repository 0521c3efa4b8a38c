"""Shared by the kvpress comparison (``benchmarks/kvpress/vs_kvpress.py``): the kvpress virtual environment
(made on first use, guarded by a lock), the client of the kvpress process (``benchmarks/kvpress/side.py``),
the matched method names and settings, and the Markdown report writer."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIDE_MODULE = "benchmarks.kvpress.side"  # run with -m from the repository root (REPO)
TORCH_VERSION = "2.13.0"


KVPRESS_REQUIREMENTS = ["kvpress==0.5.5", "transformers==5.2.0", "pandas<3"]


METHODS_UNIFORM = ("snapkv", "criticalkv-snapkv")


METHODS_HEADWISE = ("adakv-snapkv", "criticalkv-adakv-snapkv")


KVPRESS_NAMES = {
    "none": "no press (full cache)",
    "snapkv": "SnapKVPress",
    "criticalkv-snapkv": "CriticalKVPress(SnapKVPress)",
    "adakv-snapkv": "AdaKVPress(SnapKVPress)",
    "criticalkv-adakv-snapkv": "CriticalAdaKVPress(SnapKVPress)",
}


MATCHED = dict(window=64, kernel=5, pooling="avg", first_stage_ratio=0.5, epsilon=1e-4, alpha_safeguard=0.2)


def default_venv_dir() -> Path:
    from pipeline.engine.loading import default_cache_dir

    return default_cache_dir() / "kvpress-venv"


def venv_spec() -> str:
    return json.dumps({"torch": TORCH_VERSION, "requirements": KVPRESS_REQUIREMENTS, "python": sys.version_info[:2]})


def venv_stamp(venv: Path) -> Path:
    return venv / f".ckv-kvpress-{hashlib.sha256(venv_spec().encode()).hexdigest()[:12]}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_commands(venv: Path, base_python: str, constraint: Path) -> list[list[str]]:
    """The commands that build the kvpress venv (torch first, then kvpress with torch held)."""
    pip = [str(venv_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    return [
        [base_python, "-m", "venv", str(venv)],
        pip + [f"torch=={TORCH_VERSION}"],
        pip + ["-c", str(constraint), *KVPRESS_REQUIREMENTS],
        [str(venv_python(venv)), "-m", "pip", "check"],
    ]


def _base_python() -> str:
    """A Python that can make venvs: the interpreter this project's venv was built from."""
    return getattr(sys, "_base_executable", None) or sys.executable


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def ensure_kvpress_venv(venv: Path | None = None, log=None) -> dict:
    """Create the kvpress venv if it is missing or incomplete; return {python, created, seconds, size}.

    Idempotent: a stamp file naming the exact spec marks a finished install; a lock file makes
    concurrent callers wait for one install.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    venv = Path(venv or default_venv_dir()).expanduser()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if venv_stamp(venv).is_file() and venv_python(venv).exists():
            return {"python": str(venv_python(venv)), "created": False, "seconds": 0.0, "size": None}
        if venv.exists():
            log(f"kvpress venv at {venv} is incomplete; rebuilding it")
            shutil.rmtree(venv)
        log(f"creating the kvpress venv at {venv} (torch {TORCH_VERSION}, {' '.join(KVPRESS_REQUIREMENTS)})")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            constraint = Path(tmp) / "constraints.txt"
            for i, cmd in enumerate(venv_commands(venv, _base_python(), constraint)):
                if i == 2:  # hold whatever torch build step 2 installed (e.g. 2.13.0+cpu)
                    frozen = subprocess.run(
                        [str(venv_python(venv)), "-m", "pip", "freeze"], capture_output=True, text=True, check=True
                    )
                    pins = [line for line in frozen.stdout.splitlines() if line.lower().startswith("torch==")]
                    constraint.write_text("\n".join(pins or [f"torch=={TORCH_VERSION}"]) + "\n")
                log("  $ " + " ".join(cmd))
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
                    raise RuntimeError(f"building the kvpress venv failed at: {' '.join(cmd)}\n{tail}")
        venv_stamp(venv).write_text(venv_spec() + "\n")
        seconds = time.perf_counter() - t0
        size = dir_size(venv)
        log(f"kvpress venv ready in {seconds:.0f} s, {size / 2**30:.2f} GiB")
        return {"python": str(venv_python(venv)), "created": True, "seconds": seconds, "size": size}


class KvpressSide:
    """The kvpress side process (``benchmarks/kvpress/side.py``): one JSON request per line, one JSON reply per line."""

    def __init__(self, python: str, model_dir: str, threads: int, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [python, "-m", SIDE_MODULE, "--model", model_dir, "--threads", str(threads)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"kvpress side did not start: {ready}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._log.flush()
            tail = "\n".join(Path(self.log_path).read_text().splitlines()[-30:])
            raise RuntimeError(f"kvpress side exited (code {self.proc.poll()}); log tail:\n{tail}")
        return json.loads(line)

    def request(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise RuntimeError(f"kvpress side failed on {op}: {reply.get('error')} (log: {self.log_path})")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("quit")
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.proc.returncode == 0:  # keep the log only when something went wrong
            Path(self.log_path).unlink(missing_ok=True)

    def __enter__(self) -> KvpressSide:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def press_spec(method: str, cache_size: float) -> dict | None:
    if method == "none":
        return None
    return {
        "name": method,
        "cache_size": cache_size,
        "window": MATCHED["window"],
        "kernel": MATCHED["kernel"],
        "epsilon": MATCHED["epsilon"],
        "first_stage_ratio": MATCHED["first_stage_ratio"],
        "alpha_safeguard": MATCHED["alpha_safeguard"],
    }


class Report:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.parts.append(text)

    def write(self, path: Path | None) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(self.parts) + "\n")
        print(f"\n(written to {path})", file=sys.stderr)


def load_model_dtype(dtype: str):
    """SmolLM2 in ``dtype`` on CPU with our attention registered (for the bf16 faithfulness rows)."""
    from pipeline.engine.config import ModelConfig
    from pipeline.engine.loading import load_model
    from pipeline.kv.attention.registered import register

    loaded = load_model(ModelConfig(name="smollm2", device="cpu", dtype=dtype))
    loaded.model.set_attn_implementation(register())
    return loaded.model
