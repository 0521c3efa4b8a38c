"""Physical limits of this machine and roofline-style bounds, plus the small reporting helpers the
benchmark scripts share (run header, Markdown tables, documents of a given token length).

Limits measured here (best of repeated runs: a limit is what the machine can do, and other
processes can only slow a run down; nothing taken from a datasheet):

* memory bandwidth: ``dst.copy_(src)`` of a large fp32 tensor (bytes read + bytes written per
  second) and ``src.sum()`` (bytes read per second); the bound uses the higher of the two, so the
  achieved fraction is never flattered;
* fp32 matmul throughput: ``torch.matmul`` of two square matrices (2 n^3 FLOP per product).

Bounds derived from them:

* decode: every step reads every weight once (a tied embedding / LM head counted once; an untied
  input embedding not at all) and every
  KV entry held for the row once; FLOPs are ~2 per weight plus 4 * D per KV entry and query head
  sharing it. ``bound = max(bytes / bandwidth, flops / matmul rate)``;
* CriticalKV norms: exact L1 norms actually computed (``NormStats.exact`` entries, each a
  (1 x D) @ (D x G*hidden) product: 2 * D * G * hidden FLOP) plus the cheap Gram upper bound for
  every entry (2 * D^2 + 2 * D FLOP) over the measured matmul rate;
* prefill: 2 FLOP per non-embedding weight per token + causal attention (2 * n^2 * D * H_q per
  layer) + LM head for one token, over the matmul rate.

Usage: python -m benchmarks.roofline [--repeats 7] [--bandwidth-mib 512] [--matmul-n 2048]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.engine.memory import proc_status_bytes

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"


# ---------------------------------------------------------------------------------- reporting
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def machine_description() -> str:
    mem = total_memory_gib()
    parts = [cpu_model(), f"{os.cpu_count()} cores"]
    if mem:
        parts.append(f"{mem:.0f} GiB RAM")
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name(0)}")
    parts.append(f"Python {platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    try:
        import transformers

        parts.append(f"transformers {transformers.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        return rev.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def header(title: str) -> str:
    """Markdown block naming what was measured, when, where and with which command."""
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            f"# {title}",
            "",
            f"- date: {now}",
            f"- machine: {machine_description()}",
            f"- command: `{command}`",
            f"- code: git {git_revision()}",
        ]
    )


def table(columns: list[str], rows: list[list], align: str | None = None) -> str:
    """Markdown table; ``align`` is one char per column ('l' or 'r', default: l then r...)."""
    align = align or ("l" + "r" * (len(columns) - 1))
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def write_report(text: str, out: str | None) -> None:
    """Print a finished Markdown report and write it to ``out`` (run_all.py passes "" and keeps
    stdout itself)."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        print(f"(written to {out})")


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def fmt_ratio(a: float, b: float, digits: int = 2) -> str:
    if not b or b != b or a != a:
        return "n/a"
    return f"{a / b:.{digits}f}"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def document_of_tokens(tokenizer, n_tokens: int, seed: int = 0) -> dict:
    """A built-in sample QA document whose context is about ``n_tokens`` tokens of text.

    Returns ``{"context", "question", "answer_prefix"}``. The text is cut at a token boundary and
    decoded; re-encoding may differ by a token or two (the engine reports the real count).
    """
    from pipeline.data.synthetic import sample_qa_documents

    doc = sample_qa_documents(1, target_words=max(200, n_tokens), seed=seed)[0]
    ids: list[int] = []
    extra = 0
    while len(ids) < n_tokens:
        more = sample_qa_documents(1, target_words=max(200, n_tokens), seed=seed + 1000 + extra)[0] if ids else doc
        ids += tokenizer(("\n\n" if ids else "") + more["context"], add_special_tokens=False)["input_ids"]
        extra += 1
    text = tokenizer.decode(ids[:n_tokens], skip_special_tokens=True)
    return {"context": text, "question": doc["questions"][0], "answer_prefix": doc.get("answer_prefix") or ""}


class PeakRSS:
    """Peak resident memory of this process during a block, above the level at its start (CPU).

    Resets the kernel's high-water mark (``/proc/self/clear_refs``) on entry; ``delta_bytes`` is
    ``VmHWM - VmRSS(at entry)`` (None where the mark cannot be reset).
    """

    def __enter__(self) -> PeakRSS:
        self.start = proc_status_bytes("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.ok = self.start is not None
        except OSError:
            self.ok = False
        return self

    def __exit__(self, *exc) -> None:
        peak = proc_status_bytes("VmHWM")
        # clamp: pages of the starting RSS that get dropped during the block can push the mark below it
        self.delta_bytes = max(0, peak - self.start) if (self.ok and peak is not None) else None


# ---------------------------------------------------------------------------------- limits
@dataclass
class Limits:
    copy_gbs: float  # (read + write) GB/s of a large copy
    read_gbs: float  # read GB/s of a large reduction
    matmul_gflops: float  # fp32 square matmul GFLOP/s
    bandwidth_mib: int
    matmul_n: int

    def best(self, other: Limits | None) -> Limits:
        """Element-wise best of two measurements (e.g. at the start and at the end of a run, so
        that load from other processes at one moment does not lower the bound)."""
        if other is None:
            return self
        return Limits(
            max(self.copy_gbs, other.copy_gbs),
            max(self.read_gbs, other.read_gbs),
            max(self.matmul_gflops, other.matmul_gflops),
            self.bandwidth_mib,
            self.matmul_n,
        )

    @property
    def bandwidth_gbs(self) -> float:
        """The bandwidth used for bounds: the higher of copy and read (tightest bound)."""
        return max(self.copy_gbs, self.read_gbs)

    def rows(self) -> list[list]:
        return [
            [
                "memory bandwidth, copy (read + write)",
                f"{self.copy_gbs:.1f} GB/s",
                f"dst.copy_(src), {self.bandwidth_mib} MiB fp32, best run",
            ],
            [
                "memory bandwidth, read",
                f"{self.read_gbs:.1f} GB/s",
                f"src.sum(), {self.bandwidth_mib} MiB fp32, best run",
            ],
            [
                "fp32 matmul",
                f"{self.matmul_gflops:.1f} GFLOP/s",
                f"torch.matmul {self.matmul_n}x{self.matmul_n}, best run",
            ],
        ]


def _timed(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_bandwidth(mib: int = 512, repeats: int = 5) -> tuple[float, float]:
    """(copy GB/s counting read + write, read GB/s) of an fp32 tensor of ``mib`` MiB."""
    n = mib * 2**20 // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), repeats)
    read_s = _timed(lambda: src.sum(), repeats)
    nbytes = n * 4
    return 2 * nbytes / copy_s / 1e9, nbytes / read_s / 1e9


def measure_matmul(n: int = 2048, repeats: int = 5) -> float:
    """fp32 GFLOP/s of ``torch.matmul`` of two n x n matrices."""
    a, b = torch.rand(n, n), torch.rand(n, n)
    seconds = _timed(lambda: torch.matmul(a, b), repeats)
    return 2 * n**3 / seconds / 1e9


def measure_limits(bandwidth_mib: int = 512, matmul_n: int = 2048, repeats: int = 7) -> Limits:
    with torch.inference_mode():
        copy_gbs, read_gbs = measure_bandwidth(bandwidth_mib, repeats)
        gflops = measure_matmul(matmul_n, repeats)
    return Limits(copy_gbs, read_gbs, gflops, bandwidth_mib, matmul_n)


# ---------------------------------------------------------------------------------- model costs
@dataclass
class ModelShape:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    weight_bytes: int  # unique parameter storage (tied embeddings counted once)
    weight_params: int
    embed_params: int  # input embedding parameters (a row lookup, not a matmul)
    tied: bool

    @property
    def groups(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def kv_entry_bytes_fp32(self) -> int:
        return 2 * self.head_dim * 4


def model_shape(model) -> ModelShape:
    cfg = model.config
    seen, nbytes, nparams = set(), 0, 0
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        nbytes += p.numel() * p.element_size()
        nparams += p.numel()
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelShape(
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        q_heads=cfg.num_attention_heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        vocab=cfg.vocab_size,
        weight_bytes=nbytes,
        weight_params=nparams,
        embed_params=emb.numel(),
        tied=tied,
    )


def decode_bound_s(
    shape: ModelShape, kv_entries_read: float, limits: Limits, kv_bytes_per_entry: float | None = None, batch: int = 1
) -> tuple[float, float, float]:
    """(bound seconds per decode step, bytes read, FLOPs) for a batch of rows.

    ``kv_entries_read``: KV entries (one K + one V vector of one KV head) read per step, summed
    over layers, heads and rows. Weights are read once per step whatever the batch size.
    """
    per_entry = kv_bytes_per_entry if kv_bytes_per_entry is not None else shape.kv_entry_bytes_fp32
    matmul_params = shape.weight_params - (0 if shape.tied else shape.embed_params)
    # an untied input embedding is a row lookup: only its matmul-used share of the weights is read
    weight_read = shape.weight_bytes * matmul_params / shape.weight_params
    nbytes = weight_read + kv_entries_read * per_entry
    flops = batch * 2 * matmul_params + kv_entries_read * 4 * shape.head_dim * shape.groups
    return max(nbytes / (limits.bandwidth_gbs * 1e9), flops / (limits.matmul_gflops * 1e9)), nbytes, flops


def prefill_flops(shape: ModelShape, n: int, batch: int = 1) -> float:
    """FLOPs of a causal prefill of ``n`` tokens per row (projections, MLP, attention, 1 LM-head row)."""
    body = shape.weight_params - shape.embed_params - (0 if shape.tied else shape.vocab * shape.hidden)
    attention = shape.layers * 2 * n * n * shape.head_dim * shape.q_heads  # QK^T + PV, causal half
    return batch * (2 * body * n + attention + 2 * shape.vocab * shape.hidden)


def exact_norm_flops(shape: ModelShape, exact_entries: int) -> float:
    """FLOPs of ``exact_entries`` exact projected L1 norms (each over the G query heads of a KV head)."""
    return exact_entries * (2 * shape.head_dim * shape.groups * shape.hidden + 2 * shape.groups * shape.hidden)


def bound_norm_flops(shape: ModelShape, entries: int) -> float:
    """FLOPs of the Gram-matrix upper bound for ``entries`` (layer x head x token) entries."""
    return entries * (2 * shape.head_dim**2 + 2 * shape.head_dim)


def full_norm_flops(shape: ModelShape, n: int, batch: int = 1) -> float:
    """FLOPs of exact norms for every entry of every layer (what kvpress computes)."""
    return exact_norm_flops(shape, batch * n * shape.kv_heads * shape.layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--matmul-n", type=int, default=2048)
    args = p.parse_args()
    print(header("Machine limits (roofline inputs)"))
    limits = measure_limits(args.bandwidth_mib, args.matmul_n, args.repeats)
    print(f"\nBest of {args.repeats} runs each.\n")
    print(table(["limit", "measured", "how"], limits.rows(), "lrl"))


if __name__ == "__main__":
    main()
