#!/usr/bin/env bash
# Builds and installs the Python package into a virtualenv, then runs its tests (python/tests).
#
#   scripts/python-test.sh [VENV] [PYTEST_ARGS...]
#
# VENV (default build/python-venv) is created if missing, with $PYTHON (default python3). The
# package is built without build isolation, so the build folder (build/python/<wheel tag>) is
# reused and a second run only recompiles what changed; CMAKE_ARGS reaches CMake as usual
# (CMAKE_ARGS=-DKVTIER_WITH_CUDA=ON for the CUDA copier). PYTEST_ARGS replace the default
# selection (python/tests; its vllm/ folder only where vLLM is installed in VENV).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${1:-build/python-venv}
shift || true
if [ ! -x "$venv/bin/python" ]; then
  echo "== creating virtualenv $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"

echo "== installing build and test dependencies"
"$py" -m pip install -q --disable-pip-version-check "scikit-build-core>=0.10" "nanobind>=2.0" \
  pytest numpy
echo "== building and installing kvtier"
start=$(date +%s)
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps .
echo "built and installed in $(( $(date +%s) - start )) s"

echo "== python tests"
if [ $# -eq 0 ]; then
  set -- python/tests
  if ! "$py" -c "import vllm" 2>/dev/null; then
    echo "(vLLM is not installed in $venv: skipping python/tests/vllm)"
    set -- "$@" --ignore=python/tests/vllm
  fi
fi
# The CLI the wheel installed (`kvtier serve` for test_server.py) comes first on PATH.
PATH="$(cd "$venv/bin" && pwd):$PATH" exec "$py" -m pytest -q "$@"
