"""Run every benchmark in one go and collect their Markdown into ``benchmarks/results/``.

Runs, one after another with this Python (``make bench`` = this script, full sizes):

1. ``roofline``               this machine's memory bandwidth and fp32 matmul throughput
2. ``compression``            CriticalKV vs SnapKV prefill cost, kept bytes, decode (compression core)
3. ``pipeline_overhead``      Ray pipeline vs plain loop (skipped if the module is absent)
4. ``kvpress.vs_kvpress``     side by side with kvpress 0.5.5 (creates its venv on first use)
5. ``full_cache_scaling``     full cache vs criticalkv-adakv-snapkv as the context grows
6. ``ragged_decode``          a ragged cache's decode step, flat vs blocked kernel, vs a uniform cache
7. ``compile_probe``          torch.compile of transformers' static-cache decode step vs eager
8. ``prefill_memory``         peak RSS of one document, ours vs transformers' DynamicCache

Each script's stdout is shown live and saved to ``benchmarks/results/<name>.md`` (``--quick``:
``benchmarks/results/quick/``); everything is
also concatenated into ``benchmarks/results/ALL.md``. A failing script does not stop the others;
the exit status is non-zero if any failed. Sizes: ``--quick`` uses small contexts and one repeat (a
few minutes on 2 cores; for checking that everything runs, not for numbers). Flags are passed to
a module only if its ``--help`` lists them. ``benchmarks/gpu_check.sh`` (GPU machines) is separate.

Each runs as ``python -m benchmarks.<module>`` from the repository root.

Usage: python -m benchmarks.run_all [--quick] [--only vs_kvpress,full_cache_scaling] [--results DIR]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.roofline import RESULTS_DIR, header

REPO = Path(__file__).resolve().parents[1]
#: a benchmark's name (``--only``, the results file) -> its module, run with ``python -m``
MODULES = {"vs_kvpress": "benchmarks.kvpress.vs_kvpress"}


def module_of(name: str) -> str:
    return MODULES.get(name, f"benchmarks.{name}")


def module_exists(name: str) -> bool:
    return (REPO / (module_of(name).replace(".", "/") + ".py")).is_file()


FULL = {
    "roofline": {},
    "compression": {"--lengths": "2048,4096", "--repeats": "3"},
    "pipeline_overhead": {"--docs": "32", "--repeats": "2"},
    "vs_kvpress": {
        "--lengths": "2048,4096",
        "--faith-lengths": "2048,4096",
        "--repeats": "3",
        "--new-tokens": "32",
        "--out": "",
    },
    "full_cache_scaling": {
        "--lengths": "1024,2048,4096,8192",
        "--repeats": "3",
        "--prefill-repeats": "2",
        "--decode-steps": "16",
        "--out": "",
    },
    "ragged_decode": {"--lengths": "2048,4096,8192", "--out": ""},
    "compile_probe": {"--length": "2048", "--out": ""},
    "prefill_memory": {"--lengths": "2048,4096", "--repeats": "3", "--out": ""},
}
QUICK = {
    "roofline": {"--repeats": "3", "--bandwidth-mib": "256", "--matmul-n": "1024"},
    "compression": {"--lengths": "1024", "--repeats": "1", "--decode-steps": "4"},
    "pipeline_overhead": {"--docs": "2", "--words": "300", "--repeats": "1", "--max-new-tokens": "4"},
    "vs_kvpress": {
        "--lengths": "512",
        "--faith-lengths": "512",
        "--repeats": "1",
        "--new-tokens": "8",
        "--batch-length": "512",
        "--out": "",
    },
    "full_cache_scaling": {
        "--lengths": "512,1024",
        "--repeats": "1",
        "--prefill-repeats": "1",
        "--decode-steps": "4",
        "--out": "",
    },
    "ragged_decode": {"--lengths": "512", "--steps": "6", "--out": ""},
    "compile_probe": {"--length": "256", "--steps": "4", "--out": ""},
    "prefill_memory": {"--lengths": "512", "--repeats": "1", "--out": ""},
}


def supported_flags(name: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", module_of(name), "--help"], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    return proc.stdout


def has_flag(help_text: str, flag: str) -> bool:
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", help_text) is not None


def build_command(name: str, wanted: dict, results: Path) -> list[str]:
    help_text = supported_flags(name)
    cmd = [sys.executable, "-m", module_of(name)]
    for flag, value in wanted.items():
        if has_flag(help_text, flag):
            cmd += [flag, value]
    if name == "full_cache_scaling" and has_flag(help_text, "--plot"):
        cmd += ["--plot", str(results / "full_cache_scaling.png")]
    return cmd


def run(cmd: list[str], log_path: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, cwd=REPO)
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
        code = proc.wait()
    return code, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat (checks that all runs)")
    p.add_argument("--only", default="", help="comma-separated script names (default: all)")
    p.add_argument("--results", default=None, help="default benchmarks/results (quick: benchmarks/results/quick)")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    names = [n for n in (args.only.split(",") if args.only else preset) if n]
    results = Path(args.results) if args.results else (RESULTS_DIR / "quick" if args.quick else RESULTS_DIR)
    results.mkdir(parents=True, exist_ok=True)
    status = []
    started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    for name in names:
        if not module_exists(name):
            status.append((name, "absent (skipped)", 0.0))
            continue
        cmd = build_command(name, preset.get(name, {}), results)
        print(f"\n\n<!-- {' '.join(cmd)} -->\n", flush=True)
        code, seconds = run(cmd, results / f"{name}.md")
        status.append((name, "ok" if code == 0 else f"FAILED (exit {code})", seconds))
    summary = [
        header("All benchmarks" + (" (quick sizes: not for numbers)" if args.quick else "")),
        "",
        f"started {started}",
        "",
        "| script | status | wall s |",
        "|---|---|---:|",
    ]
    summary += [f"| {n} | {s} | {t:.0f} |" for n, s, t in status]
    parts = ["\n".join(summary)]
    for name, _state, _ in status:
        md = results / f"{name}.md"
        if md.is_file():
            parts.append(md.read_text())
    (results / "ALL.md").write_text("\n\n".join(parts) + "\n")
    print("\n" + "\n".join(summary))
    print(f"\n(results in {results}/, combined in {results / 'ALL.md'})", file=sys.stderr)
    return 0 if all(s in ("ok", "absent (skipped)") for _, s, _ in status) else 1


if __name__ == "__main__":
    sys.exit(main())
