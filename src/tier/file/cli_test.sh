#!/usr/bin/env bash
# End-to-end test of `kvtier fsck`, `kvtier stats`, `kvtier purge` and `kvtier bench tier`.
# Usage: cli_test.sh KVTIER_BINARY FILE_TIER_WORKER_BINARY
set -euo pipefail
KVTIER=$1
WORKER=$2
BASE=${KVTIER_TEST_TMPDIR:-${TMPDIR:-/tmp}}
T=$(mktemp -d "$BASE/kvtier-cli-XXXXXX")
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
# expect STATUS CMD...: runs CMD, checks its exit status, leaves its output in $T/out.
expect() {
  local want=$1; shift
  set +e; "$@" >"$T/out" 2>&1; local got=$?; set -e
  [ "$got" = "$want" ] || { cat "$T/out" >&2; fail "'$*' exited $got, expected $want"; }
}
json() { python3 -c "import json,sys; d=json.load(open('$T/out')); print($1)"; }

for c in "fsck" "stats" "purge" "bench tier"; do
  expect 0 "$KVTIER" $c --help
  grep -q "Usage" "$T/out" || fail "$c --help has no usage"
done

# Bad directories: clear errors, non-zero exits.
expect 2 "$KVTIER" stats "$T/missing"
grep -q "does not exist" "$T/out" || fail "stats of a missing directory"
mkdir "$T/plain"; echo keep > "$T/plain/precious"
expect 2 "$KVTIER" fsck "$T/plain"
grep -q "not a kvtier cache" "$T/out" || fail "fsck of a non-cache"
expect 2 "$KVTIER" purge "$T/plain" --yes
[ -f "$T/plain/precious" ] || fail "purge touched a non-cache directory"

# A cache with six chunks.
C="$T/cache"
printf 'write 0 6\nquit\n' | "$WORKER" serve "$C" 20000 0 > "$T/w.out"
grep -q "ok 6 0" "$T/w.out" || fail "worker could not write"
expect 0 "$KVTIER" stats "$C"
grep -q "6 chunks" "$T/out" || fail "stats does not count 6 chunks"
expect 0 "$KVTIER" stats "$C" --json
[ "$(json "d['chunks']")" = 6 ] || fail "stats --json chunks"
[ "$(json "d['namespaces'][0]['model_id']")" = "test/file-tier" ] || fail "stats names the model"
expect 0 "$KVTIER" fsck "$C"

# One flipped byte: found, named, exit 1; --repair removes it.
BAD=$(find "$C" -type f -regextype posix-extended -regex '.*/[0-9a-f]{64}' | sort | head -1)
python3 - "$BAD" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(4096 + 777); b = f.read(1); f.seek(4096 + 777); f.write(bytes([b[0] ^ 0x04]))
PY
expect 1 "$KVTIER" fsck "$C"
grep -q "corrupt.*$BAD" "$T/out" || fail "fsck does not name the corrupt file"
expect 1 "$KVTIER" fsck "$C" --json
[ "$(json "d['corrupt']")" = 1 ] || fail "fsck --json corrupt count"
[ "$(json "d['findings'][0]['path']")" = "$BAD" ] || fail "fsck --json names the file"
expect 0 "$KVTIER" fsck "$C" --repair
[ ! -e "$BAD" ] || fail "fsck --repair left the corrupt file"
expect 0 "$KVTIER" fsck "$C"
grep -q "5 good" "$T/out" || fail "five good chunks remain"

# A stale temporary file, as a crashed writer leaves it.
LEAF=$(dirname "$(find "$C" -type f -regextype posix-extended -regex '.*/[0-9a-f]{64}' | head -1)")
TMPF="$LEAF/$(printf '%064d' 0).tmp.host.1.0000000000000001"
echo partial > "$TMPF"; touch -d '2 hours ago' "$TMPF"
expect 1 "$KVTIER" fsck "$C"
grep -q "stale_temp" "$T/out" || fail "fsck does not report the stale temporary file"
expect 0 "$KVTIER" fsck "$C" --repair
[ ! -e "$TMPF" ] || fail "fsck --repair left the stale temporary file"

# Purge asks first, then empties the cache but keeps it a cache.
expect 1 "$KVTIER" purge "$C"
grep -q -- "--yes" "$T/out" || fail "purge without --yes does not ask for it"
expect 0 "$KVTIER" stats "$C" --json
[ "$(json "d['chunks']")" = 5 ] || fail "purge without --yes removed something"
expect 2 "$KVTIER" purge "$C" --namespace 0123456789abcdef --yes
expect 0 "$KVTIER" purge "$C" --yes
expect 0 "$KVTIER" stats "$C" --json
[ "$(json "d['chunks']")" = 0 ] || fail "purge --yes left chunks"

# bench tier: small run, JSON fields, o_direct on this filesystem; bad input refused.
expect 0 "$KVTIER" bench tier --dir "$T/bench" --chunk-mib 1 --chunks 4 --repeats 1 --json
sed -n '/^{/,$p' "$T/out" > "$T/bench.json"
python3 - "$T/bench.json" <<'PY' || fail "bench tier --json"
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("write_GBps", "read_GBps", "raw_write_GBps", "raw_read_GBps"):
    assert d[k] > 0, k
assert d["o_direct"] is True, "o_direct"
assert d["page_cache_resident_bytes"] == 0, "page cache"
PY
expect 0 "$KVTIER" stats "$T/bench" --json
[ "$(json "d['chunks']")" = 0 ] || fail "bench tier without --keep left chunks"
expect 0 "$KVTIER" bench tier --dir "$T/bench" --chunk-mib 1 --chunks 2 --repeats 1 --keep
expect 0 "$KVTIER" stats "$T/bench" --json
[ "$(json "d['chunks']")" = 2 ] || fail "bench tier --keep did not keep the chunks"
expect 1 "$KVTIER" bench tier --dir "$T/bench" --chunks 0
expect 1 "$KVTIER" bench tier --dir "$T/plain" --chunk-mib 1 --chunks 1
grep -q "not a kvtier cache" "$T/out" || fail "bench tier into a non-cache directory"
# bench tier on tmpfs: open accepts O_DIRECT (Linux 6.6 and later) but every byte stays in the
# page cache, so o_direct must be false, loudly, and the run must fail. (Older kernels refuse
# O_DIRECT on tmpfs, and the run fails before it has figures.)
if [ "$(stat -f -c %T /dev/shm 2>/dev/null)" = tmpfs ]; then
  SHM=$(mktemp -d /dev/shm/kvtier-cli-XXXXXX)
  set +e
  "$KVTIER" bench tier --dir "$SHM/bench" --chunk-mib 1 --chunks 2 --repeats 1 --json \
      >"$T/shm.json" 2>"$T/shm.err"
  got=$?
  set -e
  rm -rf "$SHM"
  [ "$got" = 1 ] || { cat "$T/shm.err" >&2; fail "bench tier on tmpfs exited $got, expected 1"; }
  if grep -q '"o_direct"' "$T/shm.json"; then
    python3 - "$T/shm.json" <<'PY' || fail "bench tier on tmpfs reported o_direct"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["o_direct"] is False, "o_direct"
assert d["page_cache_resident_bytes"] > 0, "page cache"
assert d["warnings"] and "not honoured" in d["warnings"][0], d["warnings"]
PY
    grep -q "WARNING: O_DIRECT was accepted but not honoured" "$T/shm.err" \
      || fail "bench tier on tmpfs did not warn"
  fi
fi
echo "cli_test: all passed"
