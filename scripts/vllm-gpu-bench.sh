#!/usr/bin/env bash
# kvtier serving vLLM on a CUDA GPU, end to end: builds the kvtier package with the CUDA copier,
# writes a Qwen3-8B-shaped model with seeded random weights, checks that the connector imports
# under the installed vLLM, and runs python -m kvtier.bench.vllm_ttft (every arm against vLLM's
# prefix cache and native offloading, each hit's answer checked against vLLM's own).
#
#   scripts/vllm-gpu-bench.sh build            # the package, with CUDA, into $KVTIER_SITE
#   scripts/vllm-gpu-bench.sh model            # the model directory, $MODEL_DIR
#   scripts/vllm-gpu-bench.sh bench [ARGS...]  # vllm_ttft with ARGS (default: every arm, 8k-32k)
#   scripts/vllm-gpu-bench.sh all [ARGS...]    # the three in a row
#   scripts/vllm-gpu-bench.sh multiround [ARGS...]  # the multi-round experiment against kvtier
#       plan (python -m kvtier.bench.multiround, state in $OUT/multiround; exit status 3: stopped
#       at --budget-s with work left, run the same command again; docs/planner.md)
#
# Needs: vLLM (0.26-0.34) and PyTorch with CUDA in the default python3; nvcc; the C++ build
# dependencies of the project (scripts/install-deps.sh, or CMAKE_ARGS pointing at them).
# Output: $OUT (default build/vllm-gpu-bench): logs, one JSON per context, ttft.json, ttft.svg.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/vllm-gpu-bench}
KVTIER_SITE=${KVTIER_SITE:-$PWD/build/vllm-gpu-site}
MODEL_DIR=${MODEL_DIR:-$PWD/build/qwen3-8b-random}
mkdir -p "$OUT"
export PYTHONPATH=$KVTIER_SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$KVTIER_SITE/bin:$PATH

build() {
  local start=$SECONDS
  CMAKE_ARGS="${CMAKE_ARGS:-} -DKVTIER_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}" \
    python3 -m pip install -q --no-build-isolation --no-deps --target "$KVTIER_SITE" --upgrade . \
    2>&1 | tail -n 20
  python3 -c "import kvtier; assert kvtier.cuda_built(), 'built without CUDA'; print('kvtier', kvtier.__file__, 'with CUDA')"
  echo "built in $((SECONDS - start)) s"
}

model() {
  [ -f "$MODEL_DIR/model.safetensors.index.json" ] && { echo "model in $MODEL_DIR"; return; }
  python3 -m kvtier.bench.vllm_ttft --make-model "$MODEL_DIR"
}

bench() {
  # The connector must import under this vLLM (the version check and every interface it uses).
  python3 -c "import vllm; from kvtier.vllm import KvtierConnector; from kvtier.vllm import compat; \
print('vllm', vllm.__version__, 'connector OK:', compat.features())"
  PYTHONUNBUFFERED=1 python3 -m kvtier.bench.vllm_ttft --model "$MODEL_DIR" --out "$OUT" \
    --json "$OUT/ttft.json" --plot "$OUT/ttft.svg" "$@" 2>&1 | tee "$OUT/bench.log"
}

multiround() {
  # Resumable: the settings and every finished phase are in the state directory, so each
  # command of at most 10 minutes goes on where the previous one stopped.
  python3 -c "import vllm; from kvtier.vllm import KvtierConnector; print('vllm', vllm.__version__)"
  local rc=0
  PYTHONUNBUFFERED=1 python3 -m kvtier.bench.multiround --state "${STATE:-$OUT/multiround}" \
    "$@" 2>&1 | tee -a "$OUT/multiround.log" || rc=${PIPESTATUS[0]}
  return "$rc"
}

case "${1:-}" in
  build|model) "$1" ;;
  bench) shift; bench "$@" ;;
  multiround) shift; multiround "$@" ;;
  all) shift; build; model; bench "$@" ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
