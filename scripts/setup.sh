#!/usr/bin/env bash
# Create .venv with torch and the project installed (editable) with its test extras.
# Prints what it is doing: the torch and dependency steps take a few minutes.
#   TORCH_VERSION=2.x.y     install that torch instead of the pinned one (below)
#   TORCH_INDEX_URL=URL     where step 3 takes torch from, e.g. https://download.pytorch.org/whl/cpu (the CPU build)
# A Python that already has torch (a GPU machine's own build) keeps it: .venv sees its packages, unless
# TORCH_VERSION asks for another.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_PIN=2.13.0  # the version CI runs (scripts/check_public_resolution.sh resolves it against PyPI)
step() { echo "==> [setup $1/4] $2 ($(date +%H:%M:%S))"; }
has_torch() { "$1" -c "import torch" >/dev/null 2>&1; }
describe_torch() {
    .venv/bin/python -c "import torch; v = torch.version.cuda; print(torch.__version__, f'(CUDA {v} build)' if v else '(CPU build)')"
}
step 1 "virtual environment .venv"
if [ ! -x .venv/bin/python ]; then
    if [ -z "${TORCH_VERSION:-}" ] && has_torch "$PY"; then
        "$PY" -m venv --system-site-packages .venv  # sees this Python's torch, downloads no other
    else
        "$PY" -m venv .venv
    fi
fi
step 2 "pip"
.venv/bin/python -m pip install -q --upgrade pip
if [ -z "${TORCH_VERSION:-}" ] && has_torch .venv/bin/python; then
    step 3 "torch: keeping the installed $(describe_torch)"
    .venv/bin/python -c "import torch; raise SystemExit(torch.__version__.split('+')[0] != '$TORCH_PIN')" \
        || echo "    (CI runs $TORCH_PIN: TORCH_VERSION=$TORCH_PIN bash scripts/setup.sh installs it)"
else
    TORCH="torch==${TORCH_VERSION:-$TORCH_PIN}"
    TORCH_INDEX=()
    [ -z "${TORCH_INDEX_URL:-}" ] || TORCH_INDEX=(--index-url "$TORCH_INDEX_URL")
    # No fallback to an unpinned "pip install torch". Which build comes is the index's choice: PyPI's Linux wheel is the
    # CUDA build (2.7 GB with the NVIDIA libraries it pulls; it runs on a CPU too), PyTorch's CPU index has the CPU
    # build (190 MB). On the project's machines a CPU wheel lies on local disk.
    step 3 "$TORCH from ${TORCH_INDEX_URL:-the pip index} (the largest download: PyPI's Linux wheel is the CUDA build, 2.7 GB)"
    [ -n "${TORCH_INDEX_URL:-}" ] || echo "    for the 190 MB CPU build: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh"
    if ! .venv/bin/python -m pip install --progress-bar on ${TORCH_INDEX[@]+"${TORCH_INDEX[@]}"} "$TORCH"; then
        echo "setup.sh: could not install $TORCH. Take it from PyTorch's CPU index:" >&2
        echo "  TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh" >&2
        echo "or pick a version your index has: TORCH_VERSION=2.x.y bash scripts/setup.sh" >&2
        exit 1
    fi
    echo "    installed torch $(describe_torch)"
fi
step 4 "diffusers-trtllm (editable) with its test extras: diffusers, transformers, triton, pytest, ..."
.venv/bin/python -m pip install --progress-bar on -e ".[test]"
echo "==> done: run the demo with .venv/bin/python -m diffusers_trtllm, the tests with bash scripts/test.sh"
