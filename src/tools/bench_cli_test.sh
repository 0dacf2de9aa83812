#!/usr/bin/env bash
# End-to-end checks of `kvtier bench engine` and `kvtier bench server` on small runs: that each
# compares itself with a limit measured on equal terms (memcpy on as many threads as the engine's
# workers, interleaved pass by pass; the bare Unix-socket round trip of the same clients on the
# same schedule), and reports latency per operation.
# Usage: bench_cli_test.sh KVTIER_BINARY
set -euo pipefail
KVTIER=$1
T=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-bench-cli-XXXXXX")
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$KVTIER" bench engine --chunk-mib 1 --chunks 8 --threads 2 --repeats 3 --json \
    > "$T/engine.json" 2> "$T/engine.err" || { cat "$T/engine.err" >&2; fail "bench engine"; }
python3 - "$T/engine.json" <<'PY' || fail "bench engine --json"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["memcpy_threads"] == d["threads"] == 2, "memcpy on the workers' thread count"
assert d["interleaved"] is True
for k in ("memcpy", "store", "load"):
    assert len(d[f"{k}_GBps_passes"]) == 3 and all(v > 0 for v in d[f"{k}_GBps_passes"]), k
# The chained SHA-256 derivation of 1,000 keys costs far more than the lookup itself.
assert d["lookup_1000_with_key_derivation_us"] > d["lookup_1000_us"] > 0, "lookup times"
PY

"$KVTIER" bench server --clients 2 --chunk-mib 1 --chunks 2 --repeats 1 --rpc-rounds 200 \
    --rpc-interval-us 200 --json > "$T/server.json" 2> "$T/server.err" \
    || { cat "$T/server.err" >&2; fail "bench server"; }
python3 - "$T/server.json" <<'PY' || fail "bench server --json"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["rpc_paced_timed_from"] == "scheduled send time"
assert d["rpc_floor_p50_us"] > 0 and d["rpc_saturated_floor_p50_us"] > 0, "floor measured"
assert d["rpc_floor_followup_p50_us"] > 0, "floor follow-up trips measured"
assert d["rpc_send_late_p50_us"] >= 0
for op, count in (("lookup", 400), ("prepare_load", 200), ("release", 200)):
    assert d[f"rpc_{op}_count"] == count, (op, d[f"rpc_{op}_count"])
    assert d[f"rpc_{op}_p99_us"] >= d[f"rpc_{op}_p50_us"] > 0, op
    floor = d["rpc_floor_p50_us"] if op == "lookup" else d["rpc_floor_followup_p50_us"]
    ratio = d[f"rpc_{op}_p50_us"] / floor
    assert abs(d[f"rpc_{op}_p50_vs_floor"] - ratio) < 1e-6 * ratio, op
assert "rpc_p50_us" not in d, "a pooled figure is back"
met = all(d[f"rpc_{op}_p50_vs_floor"] <= 1.5 for op in ("lookup", "prepare_load", "release"))
assert d["rpc_goal_met"] is met
PY
"$KVTIER" bench server --clients 1 --chunk-mib 1 --chunks 2 --repeats 1 --rpc-rounds 50 \
    > "$T/server.txt" 2>&1 || { cat "$T/server.txt" >&2; fail "bench server (text)"; }
grep -q "floor: bare socket, first of round" "$T/server.txt" || fail "no floor line"
grep -Eq "^goal .*: (met|NOT met)$" "$T/server.txt" || fail "no goal verdict"
# Steady state: a file tier under the pool, L1 full after the warm-up, one run per write policy.
mkdir "$T/l2"
"$KVTIER" bench server --clients 2 --chunk-mib 1 --chunks 4 --repeats 2 --rpc-rounds 20 \
    --l2 "$T/l2" --json > "$T/steady.json" 2> "$T/steady.err" \
    || { cat "$T/steady.err" >&2; fail "bench server --l2"; }
python3 - "$T/steady.json" <<'PY' || fail "bench server --l2 --json"
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
assert [r["steady_state"]["write_policy"] for r in runs] == ["write_back", "write_through", "none"]
for r in runs:
    s = r["steady_state"]
    assert r["warmup_passes"] == 2
    assert s["l1_evictions"] > 0, "the pool is full in the measured passes"
    assert s["raw_o_direct_write_GBps"] > 0 and s["l2_errors"] == 0
    # Write-through refuses stores while L1 holds only chunks the disk has not taken (it keeps
    # every acknowledged one); the others never refuse here.
    if s["write_policy"] == "write_through":
        assert s["dirty_evictions"] == 0, s["dirty_evictions"]
        assert r["store_refused_chunks"] == 0 or s["dirty_refusals"] > 0, s
    else:
        assert r["store_refused_chunks"] == 0, r["store_refused_chunks"]
    if s["write_policy"] == "none":
        assert s["l2_bytes_written"] == 0 and s["write_backs"] == 0
    else:
        assert s["l2_bytes_written"] > 0 and s["l2_write_GBps"] > 0
        # Every eviction found a clean chunk (written by the flusher or by write-through) or
        # was counted as lost.
        assert s["write_backs"] + s["dirty_evictions"] > 0 or s["write_policy"] == "write_through"
PY
[ -z "$(ls -A "$T/l2")" ] || fail "bench server --l2 left files behind: $(ls -A "$T/l2")"
# Isolated clients: the shared pool and private windows, same chunks, both moved in full.
"$KVTIER" bench server --clients 2 --chunk-mib 1 --chunks 4 --repeats 1 --rpc-rounds 20 \
    --isolate-clients --json > "$T/isolated.json" 2> "$T/isolated.err" \
    || { cat "$T/isolated.err" >&2; fail "bench server --isolate-clients"; }
python3 - "$T/isolated.json" <<'PY' || fail "bench server --isolate-clients --json"
import json, sys
doc = json.load(open(sys.argv[1]))
runs = doc["runs"]
assert [r["isolate_clients"] for r in runs] == [False, True]
for r in runs:
    assert r["store_refused_chunks"] == 0 and r["load_missed_chunks"] == 0, r
    assert r["store_GBps"] > 0 and r["load_GBps"] > 0
assert doc["isolation_cost"]["store_isolated_vs_shared"] > 0
PY
for bad in "--l2 $T/missing" "--write-policy write_back" "--l2 $T/l2 --write-policy sometimes" \
           "--isolate-clients --socket $T/none.sock" "--isolate-clients --l2 $T/l2"; do
  # shellcheck disable=SC2086
  if "$KVTIER" bench server --clients 1 --repeats 1 $bad > "$T/bad.txt" 2>&1; then
    fail "bench server $bad was accepted"
  fi
  grep -q "error" "$T/bad.txt" || fail "bench server $bad: no error message"
done
# A stream that cannot be written (a full disk under a redirected log): exit code 1, not an abort.
rc=0
"$KVTIER" bench engine --chunk-mib 1 --chunks 2 --repeats 1 2>/dev/full >/dev/null || rc=$?
[ "$rc" -eq 1 ] || fail "bench engine with stderr on a full device exited $rc, not 1"
echo "bench_cli_test: all passed"
