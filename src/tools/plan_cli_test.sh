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
expect_refusal "cannot write" simulate "${COMMON[@]}" --context 2048 --qps 1 \
    --requests-csv "$T/no/such/dir/x.csv"
echo "plan_cli_test: ok"
