#!/usr/bin/env bash
# One-shot check of a single-GPU machine without network access; finishes inside 8 minutes.
#
#   bash benchmarks/gpu_check.sh [--smoke] [--skip-tests] [--out DIR] [--lengths 8192,32768] [...]
#
# 1. Preflight: python with CUDA torch, transformers, accelerate (what such a machine has). Nothing
#    is installed from the network; the project runs from this checkout through PYTHONPATH. A module
#    that is missing is installed only from local wheels ($GPU_CHECK_WHEELS, default ./wheels) with
#    `pip install --no-index`.
# 2. benchmarks/gpu_check.py: random Llama-3.1-8B-shaped model, 8K and 32K tokens, prefill of
#    none / snapkv / criticalkv-snapkv / criticalkv-adakv-snapkv / criticalkv-layer-kvzip (best answers) /
#    kvzip / the default criticalkv-shares-kvzap, one pass and chunked, decode full vs 20 % cache
#    (uniform and ragged), kept KV bytes, peak memory, and decode
#    tokens/s at the largest batch that fits 40 GiB of KV; Markdown tables. At most
#    $GPU_CHECK_BENCH_BUDGET_S seconds (default 235; it starts no measurement in the last 45).
# 3. benchmarks/compile_probe.py: the same random 8B shape in bf16, transformers' static-cache decode
#    step at 8K tokens, eager vs torch.compile(mode="reduce-overhead") (CUDA graphs); compile time and
#    ms per step. Budget $GPU_CHECK_COMPILE_BUDGET_S (default 70; 0 skips it). With --smoke: the tiny
#    shape and the "eager" backend (tracing only), so CPU runs check the plumbing.
# 4. benchmarks/gpu_decode_ab.py: decode steps of the full, a 20 % uniform and a 20 % ragged cache
#    interleaved round by round (a host-bound step on a drifting host compares only that way) at the
#    largest length, one row and nine. Budget $GPU_CHECK_AB_BUDGET_S (default 50; 0 skips it).
# 5. The compression test suite (tests/kv) with CRITICALKV_TEST_DEVICE=cuda (cpu with --smoke on a
#    machine without GPU), with pytest-xdist's $GPU_CHECK_TEST_WORKERS (default 4) workers where it
#    is installed, in what is left of $GPU_CHECK_BUDGET_S (default 470; at least
#    $GPU_CHECK_TEST_MIN_S, default 60). Last, so that a slow suite cannot cost the tables.
#
# Options: --smoke (tiny sizes, CPU is fine), --skip-tests, --out DIR (log, table, JSON, test log),
# anything else is passed to gpu_check.py. Environment: PYTHON (interpreter), the budgets above,
# GPU_CHECK_WHEELS. Exit status: 0 when the tests passed (or were skipped on request) and the
# benchmark, the compile probe and the interleaved decode ran.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

SMOKE=0
SKIP_TESTS=0
OUT=""
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1; PASS+=("--smoke") ;;
        --skip-tests) SKIP_TESTS=1 ;;
        --out) OUT="$2"; shift ;;
        --out=*) OUT="${1#--out=}" ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) PASS+=("$1") ;;
    esac
    shift
done

TOTAL_BUDGET="${GPU_CHECK_BUDGET_S:-470}"
BENCH_LIMIT="${GPU_CHECK_BENCH_BUDGET_S:-235}"
COMPILE_BUDGET="${GPU_CHECK_COMPILE_BUDGET_S:-70}"
AB_BUDGET="${GPU_CHECK_AB_BUDGET_S:-50}"
TEST_MIN="${GPU_CHECK_TEST_MIN_S:-60}"
WHEELS="${GPU_CHECK_WHEELS:-$REPO/wheels}"
START=$SECONDS

if [ -n "$OUT" ]; then
    mkdir -p "$OUT"
    OUT="$(cd "$OUT" && pwd)"
    exec > >(tee "$OUT/gpu_check.log") 2>&1
fi

# No network: never reach a hub or an index, whatever a library would like to do.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [ -z "${PYTHON:-}" ]; then
    # first a python whose torch sees a GPU (the machine's CUDA torch), then any python with torch
    # (a CPU-only .venv is a last resort, for --smoke)
    for probe in "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" "import torch"; do
        for candidate in python python3 "$REPO/.venv/bin/python"; do
            if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$probe" >/dev/null 2>&1; then
                PYTHON="$candidate"; break 2
            fi
        done
    done
fi
if [ -z "${PYTHON:-}" ]; then
    echo "gpu_check: no python with torch found (set PYTHON=/path/to/python)"; exit 2
fi

echo "== gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), repo $REPO, python $PYTHON"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
fi

# ---- 1. preflight --------------------------------------------------------------------------
missing() {
    "$PYTHON" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}
NEEDED="torch transformers accelerate pydantic yaml numpy"
MISSING="$(missing $NEEDED pytest)"
if [ -n "$MISSING" ] && [ -d "$WHEELS" ]; then
    echo "== installing from local wheels in $WHEELS (no index): $MISSING"
    declare -A PIPNAME=([yaml]=pyyaml)
    for m in $MISSING; do
        "$PYTHON" -m pip install --no-index --find-links "$WHEELS" "${PIPNAME[$m]:-$m}" || true
    done
    MISSING="$(missing $NEEDED pytest)"
fi
for m in $MISSING; do
    if [ "$m" != "pytest" ]; then
        echo "gpu_check: python module '$m' is missing and no local wheel provides it ($WHEELS)"; exit 2
    fi
done

DEVICE="$("$PYTHON" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")"
"$PYTHON" - <<'EOF'
import torch, transformers, accelerate
cuda = torch.cuda.is_available()
print(f"== torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}; device: {torch.cuda.get_device_name(0) if cuda else 'cpu'}")
if cuda:
    free, total = torch.cuda.mem_get_info()
    print(f"== GPU memory free {free / 2**30:.1f} / {total / 2**30:.1f} GiB, capability {torch.cuda.get_device_capability(0)}, bf16 {torch.cuda.is_bf16_supported()}")
EOF
if ! "$PYTHON" -c "import pipeline.kv.storage.cache, pipeline.kv.compress, pipeline.kv.attention" 2>/tmp/gpu_check_import.err; then
    echo "gpu_check: the project does not import from $REPO:"; cat /tmp/gpu_check_import.err; exit 2
fi
if [ "$DEVICE" != "cuda" ] && [ "$SMOKE" != "1" ]; then
    echo "gpu_check: no CUDA device visible; run with --smoke for a CPU check"; exit 2
fi

# ---- 2. benchmark ----------------------------------------------------------------------------
LEFT="$BENCH_LIMIT"
BENCH_BUDGET=$((LEFT - 45))       # stop starting measurements with time left to finish one and print
echo "== benchmark (budget ${BENCH_BUDGET}s to start measurements, hard limit ${LEFT}s)"
BENCH_ARGS=(--budget-s "$BENCH_BUDGET")
if [ -n "$OUT" ]; then BENCH_ARGS+=(--out "$OUT"); fi
timeout --signal=INT --kill-after=15 "$LEFT" "$PYTHON" -m benchmarks.gpu_check "${BENCH_ARGS[@]}" ${PASS[@]+"${PASS[@]}"}
BENCH_RC=$?

# ---- 3. compiled vs eager decode ---------------------------------------------------------------
COMPILE_RC=0
COMPILE_SUMMARY="skipped (GPU_CHECK_COMPILE_BUDGET_S=0)"
if [ "$COMPILE_BUDGET" -gt 0 ]; then
    if [ "$SMOKE" = "1" ]; then
        COMPILE_ARGS=(--model random-tiny --length 96 --steps 2 --backend eager)
    else
        COMPILE_ARGS=(--model random-llama-8b --dtype bfloat16 --length 8192 --steps 12 --mode reduce-overhead)
    fi
    echo "== compile probe (at most ${COMPILE_BUDGET}s): ${COMPILE_ARGS[*]}"
    timeout --signal=INT --kill-after=15 "$COMPILE_BUDGET" "$PYTHON" -m benchmarks.compile_probe \
        "${COMPILE_ARGS[@]}" --out "${OUT:-/tmp}/compile_probe.md"
    COMPILE_RC=$?
    COMPILE_SUMMARY="exit status $COMPILE_RC"
    if [ "$COMPILE_RC" = "124" ] || [ "$COMPILE_RC" = "130" ]; then
        COMPILE_SUMMARY="timed out after ${COMPILE_BUDGET}s"
    fi
fi

# ---- 4. interleaved decode steps --------------------------------------------------------------
AB_RC=0
AB_SUMMARY="skipped (GPU_CHECK_AB_BUDGET_S=0)"
if [ "$AB_BUDGET" -gt 0 ]; then
    if [ "$SMOKE" = "1" ]; then
        AB_ARGS=(--smoke --batches 1,2 --rounds 3 --warmup 1)
    else
        AB_ARGS=(--length 32768 --batches 1,9 --rounds 16)
    fi
    echo "== interleaved decode (at most ${AB_BUDGET}s): ${AB_ARGS[*]}"
    timeout --signal=INT --kill-after=15 "$AB_BUDGET" "$PYTHON" -m benchmarks.gpu_decode_ab \
        --device "$DEVICE" "${AB_ARGS[@]}" --out "${OUT:-/tmp}"
    AB_RC=$?
    AB_SUMMARY="exit status $AB_RC"
    if [ "$AB_RC" = "124" ] || [ "$AB_RC" = "130" ]; then
        AB_SUMMARY="timed out after ${AB_BUDGET}s"
    fi
fi

# ---- 5. compression tests on the device, with the time that is left ------------------------------------------------------
TEST_RC=0
TEST_SUMMARY="skipped (--skip-tests)"
if [ "$SKIP_TESTS" = "1" ]; then
    :
elif [[ " $MISSING " == *" pytest "* ]]; then
    TEST_SUMMARY="skipped (pytest not installed and no local wheel)"
    TEST_RC=1
else
    TEST_BUDGET=$((TOTAL_BUDGET - (SECONDS - START)))
    if [ "$TEST_BUDGET" -lt "$TEST_MIN" ]; then TEST_BUDGET="$TEST_MIN"; fi
    XDIST=()
    if "$PYTHON" -c "import xdist" >/dev/null 2>&1; then XDIST=(-n "${GPU_CHECK_TEST_WORKERS:-4}"); fi
    echo "== tests/kv with CRITICALKV_TEST_DEVICE=$DEVICE (at most ${TEST_BUDGET}s) ${XDIST[*]}"
    TEST_LOG="${OUT:-/tmp}/gpu_check_tests.log"
    CRITICALKV_TEST_DEVICE="$DEVICE" timeout --signal=INT --kill-after=15 "$TEST_BUDGET" \
        "$PYTHON" -m pytest -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} tests/kv 2>&1 | tee "$TEST_LOG" | tail -n 25
    TEST_RC=${PIPESTATUS[0]}
    TEST_SUMMARY="$(grep -E '(passed|failed|error|no tests ran)' "$TEST_LOG" | tail -n 1)"
    if [ "$TEST_RC" = "124" ] || [ "$TEST_RC" = "130" ]; then
        TEST_SUMMARY="timed out after ${TEST_BUDGET}s: ${TEST_SUMMARY:-no summary}"
    fi
    TEST_SUMMARY="${TEST_SUMMARY:-exit $TEST_RC}"
fi

echo
echo "== tests/kv on $DEVICE: $TEST_SUMMARY"
echo "== benchmark exit status: $BENCH_RC; compile probe: $COMPILE_SUMMARY; interleaved decode: $AB_SUMMARY; total $((SECONDS - START))s"
if [ "$TEST_RC" != "0" ] || [ "$BENCH_RC" != "0" ] || [ "$COMPILE_RC" != "0" ] || [ "$AB_RC" != "0" ]; then
    exit 1
fi
exit 0
