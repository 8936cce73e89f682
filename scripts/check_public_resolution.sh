#!/usr/bin/env bash
# Resolve what scripts/setup.sh installs (torch at its pinned version, then this package with its test extras)
# against the public index alone, as pip on a plain Linux machine sees it: a dry run, nothing installed.
# No pip configuration, environment variable, local wheel folder or constraint file takes part
# (PIP_CONFIG_FILE=/dev/null and --isolated). Needs network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY="${PYTHON:-python3}"
INDEX="${PUBLIC_INDEX_URL:-https://pypi.org/simple}"
TORCH_PIN=$(sed -n 's/^TORCH_PIN=\([0-9][0-9.]*\).*/\1/p' scripts/setup.sh)
[ -n "$TORCH_PIN" ] || { echo "check_public_resolution.sh: no TORCH_PIN=... line in scripts/setup.sh" >&2; exit 2; }
# Only the wheels' metadata is read: PEP 658 files where the index serves them, else HTTP range requests (fast-deps),
# not the 2.7 GB of CUDA torch's wheels.
FAST=()
PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated --help | grep -q fast-deps && FAST=(--use-feature=fast-deps)
echo "==> resolving torch==$TORCH_PIN and -e .[test] against $INDEX alone (dry run)"
report=$(mktemp)
log=$(mktemp)
trap 'rm -f "$report" "$log"' EXIT
if ! PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated --dry-run --ignore-installed ${FAST[@]+"${FAST[@]}"} \
        --index-url "$INDEX" --report "$report" "torch==$TORCH_PIN" -e ".[test]" >"$log" 2>&1; then
    tail -n 25 "$log" >&2
    echo "FAILED: pip could not resolve setup.sh's requirements against $INDEX alone (above: a conflict, or no" >&2
    echo "access to the index). A conflict means 'bash scripts/setup.sh' fails on a machine whose pip sees only" >&2
    echo "the public index: loosen the range pip names above (pyproject.toml)." >&2
    exit 1
fi
"$PY" - "$report" <<'PY'
import json, sys
chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
print("ok: resolves with " + ", ".join(f"{n} {chosen[n]}" for n in ("torch", "triton", "nvidia-cuda-nvrtc", "diffusers")
                                       if n in chosen))
PY
