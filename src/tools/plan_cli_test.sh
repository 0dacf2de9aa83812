#!/usr/bin/env bash
# End-to-end checks of `kvtier plan` and `kvtier simulate` as a user calls them: --load sizes each
# arm from its own capacity (the paced method), --requests-csv logs every simulated request in
# the pacing bench qa uses, and bad inputs are refused with a message.
# Usage: plan_cli_test.sh KVTIER_BINARY
set -euo pipefail
KVTIER=$1
T=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-plan-cli-XXXXXX")
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
# A small engine: measured-style TTFT table with a per-request overhead, a measured decode step.
BASE=(--gpu-kv-gb 4GB --prefill-table 1024:0.1,4096:0.5 --step-overhead-ms 0 --users 4 --rounds 3 --system-prompt 200
        --question-tokens 20 --answer-tokens 16 --duration 60s --tier cpu:1GiB:10GB/s)
COMMON=("${BASE[@]}" --request-overhead-ms 20 --decode-step-ms 10 --capacity-stage-time 20s)

"$KVTIER" plan "${COMMON[@]}" --context 2048 --json --no-sensitivity > "$T/plan.json" \
    2> "$T/plan.err" || { cat "$T/plan.err" >&2; fail "plan --load"; }
python3 - "$T/plan.json" <<'PY' || fail "plan --json"
import json, sys
p = json.load(open(sys.argv[1]))["points"][0]
for arm in ("baseline", "offload"):
    a = p[arm]
    assert a["service_rate_rps"] > 0, arm
    # 0.65 of its own capacity, in the pacing's terms: sends = qps x rounds / (rounds - 1)
    assert abs(a["qps"] * 3 / 2 - 0.65 * a["service_rate_rps"]) < 1e-6 * a["qps"], (arm, a)
    assert abs(sum(a["token_share"].values()) - 1) < 1e-9, a["token_share"]
    assert a["mean_ttft_s"] >= 0.020, "every TTFT holds the per-request overhead"
PY

# Cost-aware lookups (the connector's default): a disk far slower than recomputing is never read;
# --no-cost-aware models a connector that loads every hit, and it is.
for mode in aware all; do
  flag=(); [ "$mode" = all ] && flag=(--no-cost-aware)
  "$KVTIER" plan --gpu-kv-gb 1GB --prefill-table 1024:0.1,4096:0.5 --step-overhead-ms 0 \
      --users 4 --rounds 3 --system-prompt 200 --question-tokens 20 --answer-tokens 16 \
      --duration 60s --request-overhead-ms 20 --decode-step-ms 10 --tier cpu:256MiB:10GB/s \
      --tier disk:10GB:0.2GB/s --context 4096 --qps 0.5 --json --no-sensitivity "${flag[@]}" \
      > "$T/cost-$mode.json" 2> "$T/cost.err" || { cat "$T/cost.err" >&2; fail "plan $mode"; }
done
python3 - "$T/cost-aware.json" "$T/cost-all.json" <<'PY' || fail "plan --no-cost-aware"
import json, sys
aware, every = (json.load(open(f))["points"][0]["offload"] for f in sys.argv[1:])
assert aware["bytes_read"]["disk"] == 0, aware["bytes_read"]
assert every["bytes_read"]["disk"] > 0, every["bytes_read"]
assert every["mean_ttft_s"] > aware["mean_ttft_s"], (every["mean_ttft_s"], aware["mean_ttft_s"])
PY

# The published experiment (docs/planner.md, "The published experiment, predicted from its own
# inputs"): LMCache on an A100-40GB, 19 GB of KV, an 8 GB CPU tier and NFS at 3.55 GB/s, every
# hit loaded, each arm at 65 % of its own capacity. It measured +8.9 % at 8k (written, never
# read) and -59 % at 24k; the planner, given only those inputs, must land near both and in
# regimes 1 and 3.
"$KVTIER" plan --gpu A100-40GB --gpu-kv-gb 19GB --users 8 --rounds 20 --context 8k,24k \
    --tier cpu:8GB:20GB/s --tier nfs:200GB:3.55GB/s --no-cost-aware --duration 20m --json \
    --no-sensitivity > "$T/published.json" 2> "$T/published.err" \
    || { cat "$T/published.err" >&2; fail "plan of the published experiment"; }
python3 - "$T/published.json" <<'PY' || fail "plan of the published experiment: figures"
import json, sys
p = json.load(open(sys.argv[1]))["points"]
change = [pt["offload"]["mean_ttft_s"] / pt["baseline"]["mean_ttft_s"] - 1 for pt in p]
assert [pt["regime"] for pt in p] == [1, 3], [pt["regime"] for pt in p]
assert 0.04 <= change[0] <= 0.14, f"8k: {change[0]:+.1%}, published +8.9 %"
assert -0.66 <= change[1] <= -0.52, f"24k: {change[1]:+.1%}, published -59 %"
PY

"$KVTIER" simulate "${COMMON[@]}" --context 2048 --qps 1 --requests-csv "$T/req.csv" \
    > "$T/sim.txt" 2>&1 || { cat "$T/sim.txt" >&2; fail "simulate --requests-csv"; }
python3 - "$T/req.csv" <<'PY' || fail "simulate --requests-csv content"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
arms = {r["arm"] for r in rows}
assert arms == {"no-offload", "offload"}, arms
base = [r for r in rows if r["arm"] == "no-offload"]
# bench qa's pacing at --qps 1, 4 users, 3 rounds: a send every 4 s per user, a user joining every
# 2 s, steady state from the start; about qps x rounds / (rounds - 1) = 1.5 requests/s.
sends = sorted(float(r["launch_time"]) for r in base)
assert sends[0] == 0 and 80 <= len(sends) <= 95, len(sends)
for r in rows:
    t = int(r["gpu_tokens"]) + int(r["cpu_tokens"]) + int(r["recomputed_tokens"])
    assert t == int(r["prompt_tokens"]), r
    assert float(r["finish_time"]) >= float(r["launch_time"]) + float(r["ttft"]) - 1e-9, r
PY

expect_refusal() {  # expect_refusal MESSAGE ARGS...
  local msg=$1; shift
  if "$KVTIER" "$@" > "$T/out" 2>&1; then fail "accepted: $*"; fi
  grep -q -- "$msg" "$T/out" || { cat "$T/out" >&2; fail "no '$msg' for: $*"; }
}
expect_refusal "unknown method" plan "${COMMON[@]}" --context 2048 --capacity-method fastest
expect_refusal "is not above --request-overhead-ms" plan "${BASE[@]}" --context 2048 \
    --request-overhead-ms 200
expect_refusal "must be >= 1 s" plan "${BASE[@]}" --context 2048 --capacity-stage-time 0.5s
expect_refusal "must be > 0" simulate "${BASE[@]}" --context 2048 --decode-step-ms 0 --qps 1
expect_refusal "--load-blocking must be in \[0, 1\]" simulate "${BASE[@]}" --context 2048 --qps 1 \
    --load-blocking 2
expect_refusal "--load-blocking 'sync' does not start with a number" plan "${BASE[@]}" \
    --context 2048 --load-blocking sync
expect_refusal "cannot write" simulate "${COMMON[@]}" --context 2048 --qps 1 \
    --requests-csv "$T/no/such/dir/x.csv"
# --from-log: bench qa's CSV format (4 users, 3 rounds, 60 conversations), gzip'd, one line cut.
python3 - "$T/qa.csv" <<'PY'
import sys
rows = []
for c in range(60):
    for r in range(3):
        t = 1735689600 + c * 2.0 + r * 4.0  # a new user every 2 s, asking every 4 s: 4 at once
        rows.append((t, f"{500 + r * 120 + c % 5},40,0.1,0.2,{c},{r + 1},{t:.3f},{t + 0.3:.3f}"))
rows.sort()
with open(sys.argv[1], "w") as f:
    f.write("prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,"
            "launch_time,finish_time\n")
    f.write("".join(line + "\n" for _, line in rows))
    f.write("12,oops\n")
PY
gzip -k "$T/qa.csv"
"$KVTIER" plan --from-log "$T/qa.csv.gz" --fast --gpu-kv-gb 4GB --json --no-sensitivity \
    --max-model-len 700 > "$T/from-log.json" 2> "$T/from-log.err" \
    || { cat "$T/from-log.err" >&2; fail "plan --from-log"; }
python3 - "$T/from-log.json" <<'PY' || fail "plan --from-log --json"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["read"]["records"] == 180 and j["read"]["malformed"] == 1, j["read"]
t = j["traffic"]
d = t["derived"]
assert (d["users"], d["rounds"], d["answer_tokens"], d["question_tokens"]) == (4, 3, 40, 80), d
assert t["first_round_prompt"]["median"] == 502, t["first_round_prompt"]
assert t["window_overflows"] == 60, t["window_overflows"]  # every peak is 780 + 40 > 700
assert [p["at"] for p in j["points"]] == ["median", "p90", "peak"]
assert j["plan"]["points"], "no plan"
PY
"$KVTIER" plan --from-log "$T/qa.csv" --fast --gpu-kv-gb 4GB --no-sensitivity > "$T/from-log.txt" \
    2>&1 || fail "plan --from-log (text)"
grep -q "Distribution of conversation peaks" "$T/from-log.txt" || fail "no context plot"
grep -q "WARNING" "$T/from-log.txt" && fail "a window warning without a window overflow"
expect_refusal "cannot open" plan --from-log "$T/absent.jsonl" --fast
printf 'a,b\n1,2\n' > "$T/nocol.csv"
expect_refusal "log-fields prompt=" plan --from-log "$T/nocol.csv" --log-format csv --fast
expect_refusal "log-fields prompt=COLUMN" plan --from-log "$T/nocol.csv" --fast
printf 'not a request\n' > "$T/empty.log"
expect_refusal "no request records" plan --from-log "$T/empty.log" --fast
expect_refusal "unknown field" plan --from-log "$T/qa.csv" --log-fields colour=x --fast
expect_refusal "not both" plan --from-log "$T/qa.csv" --from-metrics http://127.0.0.1:1 --fast

# --from-metrics: a port nobody answers on, an HTML page, and a vLLM-like endpoint.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
expect_refusal "did not answer" plan --from-metrics "http://127.0.0.1:$port/metrics" --fast \
    --scrape-timeout 2s
mkdir -p "$T/www"
cat > "$T/www/metrics" <<'PROM'
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 40000
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 20
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 40000
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30000
vllm:num_preemptions_total{engine="0",model_name="m"} 0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 40000
vllm:request_prompt_tokens_count{engine="0",model_name="m"} 20
PROM
echo '<html><body>hello</body></html>' > "$T/www/index.html"
(cd "$T/www" && exec python3 -m http.server "$port" --bind 127.0.0.1 > /dev/null 2>&1) &
server=$!
trap 'kill $server 2>/dev/null || true; rm -rf "$T"' EXIT
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$port/metrics" > /dev/null && break; sleep 0.1; done
expect_refusal "not Prometheus text" plan --from-metrics "http://127.0.0.1:$port/index.html" --fast
expect_refusal "answered HTTP 404" plan --from-metrics "http://127.0.0.1:$port/nothing" --fast
"$KVTIER" plan --from-metrics "http://127.0.0.1:$port" --fast --gpu-kv-gb 4GB --json \
    > "$T/live.json" 2> "$T/live.err" || { cat "$T/live.err" >&2; fail "plan --from-metrics"; }
python3 - "$T/live.json" <<'PY' || fail "plan --from-metrics --json"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["vllm"]["mean_prompt_tokens"] == 2000, j["vllm"]
assert abs(j["hit_shares"]["gpu"] - 0.75) < 1e-9, j["hit_shares"]
assert j["measured_regime"] == 1, j
assert j["predicted"]["more_users"]["users"] == 2 * j["predicted"]["now"]["users"]
PY
kill $server 2>/dev/null || true
echo "plan_cli_test: ok"
