#!/usr/bin/env bash
# The GPU check of issue #17, on a machine with one CUDA GPU (written for an H200; ~10 minutes there):
#   1. environment: torch with CUDA must be there already; pagellm runs from this checkout (PYTHONPATH, no
#      install); its small pure-Python dependencies and triton are pip-installed only if missing (nothing
#      heavy: no torch, no model weights; where there is no network a missing one stops the check here);
#   2. the `cuda` tests (tests/test_cuda.py: the engine on the GPU against the CPU) and the Triton kernels'
#      tests on the GPU (tests/test_triton_attention.py), output in benchmarks/results/gpu/tests_*.log;
#   3. benchmarks/gpu_check.py: the GPU's measured limits, the attention paths alone (benchmarks/gpu_attention.py),
#      random-weight Llama-3 1B and 8B shapes, W1 and a W2-style run, one JSON in benchmarks/results/gpu/.
#
#   bash benchmarks/gpu_check.sh [gpu_check.py options, e.g. --models llama3-1b --w2-requests 256]
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh   # the interpreter with torch (default: python3)
# Results go to $OUT when it is set (a lent device machine hands back what is under it), else to
# benchmarks/results/gpu. Where one call may run at most 10 minutes, split it: GPU_CHECK_TESTS_ONLY=1 for steps
# 1-2, then GPU_CHECK_SKIP_TESTS=1 (with e.g. --child-timeout 120) for step 3.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: $PY has no torch that sees a CUDA GPU (set PYTHON=...)" >&2
    exit 2
fi

missing() {  # the modules of "$@" that this Python cannot import
    "$PY" -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' "$@"
}
# import name -> pip name: yaml is gguf's, pytest_timeout the tests' per-test limit
declare -A PIP=([numpy]=numpy [safetensors]=safetensors [tokenizers]=tokenizers [gguf]=gguf [jinja2]=jinja2
                [tqdm]=tqdm [yaml]=pyyaml [triton]=triton [pytest]=pytest [pytest_timeout]=pytest-timeout)
need=$(missing numpy safetensors tokenizers gguf jinja2 tqdm yaml triton pytest pytest_timeout)
if [ -n "$need" ]; then
    pkgs=$(for m in $need; do printf '%s ' "${PIP[$m]}"; done)
    echo "gpu_check: installing what is missing: $pkgs"
    # fail fast where there is no network (pip otherwise retries for minutes)
    timeout 120 "$PY" -m pip install -q --retries 0 --timeout 10 $pkgs || echo "gpu_check: pip could not install $pkgs" >&2
fi
still=$(missing numpy safetensors tokenizers gguf jinja2 tqdm yaml)
if [ -n "$still" ]; then
    echo "gpu_check: pagellm needs $still and they could not be installed" >&2
    exit 2
fi
[ -n "$(missing triton)" ] && echo "gpu_check: no triton: attention runs on torch SDPA, without CUDA graphs" >&2

# the platform's description without the CLI (whose parser imports the server: fastapi is not needed here)
"$PY" -c 'from pagellm.platforms import get_platform; [print(f"{k}: {v}") for k, v in get_platform("cuda").describe().items()]'
# Triton compiles a small C launcher on first use: without a C compiler and Python headers every kernel fails
if [ -z "$(missing triton)" ] && ! "$PY" - <<'PYEOF'
import torch, triton, triton.language as tl

@triton.jit
def _add_one(x):
    tl.store(x + tl.arange(0, 16), tl.load(x + tl.arange(0, 16)) + 1)

x = torch.zeros(16, device="cuda")
_add_one[(1,)](x)
assert x.sum().item() == 16
PYEOF
then
    echo "gpu_check: triton cannot launch a kernel here (a C compiler and Python headers are needed);" \
         "attention falls back only with --attention-backend torch_sdpa_batched" >&2
fi

LOG="$OUT/tests_$STAMP.log"
if [ -n "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    echo "GPU_CHECK_SKIP_TESTS: tests not run" | tee "$LOG"
    TESTS_RC=0
elif [ -z "$(missing pytest)" ]; then
    echo "gpu_check: cuda tests -> $LOG"
    timeout 480 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_triton_attention.py \
        -rs 2>&1 | tee "$LOG"
    TESTS_RC=${PIPESTATUS[0]}
else
    echo "pytest is not installed: tests not run" | tee "$LOG"
    TESTS_RC=127
fi

[ -n "${GPU_CHECK_TESTS_ONLY:-}" ] && exit "$TESTS_RC"
"$PY" benchmarks/gpu_check.py --out "$OUT" --tests-log "$LOG" --tests-rc "$TESTS_RC" "$@"
CHECK_RC=$?
echo "gpu_check: tests exit code $TESTS_RC, benchmarks exit code $CHECK_RC"
[ "$TESTS_RC" -eq 0 ] && [ "$CHECK_RC" -eq 0 ]
