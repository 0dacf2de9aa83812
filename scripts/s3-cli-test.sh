#!/usr/bin/env bash
# End-to-end test of the kvtier commands on an s3:// directory: bench tier (--keep), stats,
# fsck (a corrupted object found, named and repaired), purge, kvtier serve with an S3 L2, and the
# errors for a wrong secret and a missing bucket.
# Usage: s3-cli-test.sh KVTIER_BINARY s3://BUCKET/PREFIX   (with the AWS_* variables of
# `eval "$(scripts/s3-server.sh env)"`; the prefix is removed afterwards)
set -euo pipefail
KVTIER=$1
URL=$2
PY=${KVTIER_S3_VENV:-/opt/kvtier-s3-venv}/bin/python  # boto3, to touch objects from the side
T=$(mktemp -d /tmp/kvtier-s3-cli-XXXXXX)
trap '"$KVTIER" purge "$URL" --yes >/dev/null 2>&1 || true; [ -n "${SERVER:-}" ] && kill "$SERVER" 2>/dev/null; rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
expect() {  # expect STATUS CMD...: runs CMD, checks its exit status; stdout in $T/out, both in $T/all
  local want=$1; shift
  set +e; "$@" >"$T/out" 2>"$T/err"; local got=$?; set -e
  cat "$T/out" "$T/err" >"$T/all"
  [ "$got" = "$want" ] || { cat "$T/all" >&2; fail "'$*' exited $got, expected $want"; }
}
json() { python3 -c "import json,sys; d=json.load(open('$T/out')); print($1)"; }

# Chunks written through the tier and kept.
expect 0 "$KVTIER" bench tier --dir "$URL" --chunk-mib 1 --chunks 6 --repeats 1 --readers 2 \
  --writers 2 --keep --json
[ "$(json "d['reference']")" = "raw libcurl" ] || fail "bench tier's reference is plain libcurl"
expect 0 "$KVTIER" stats "$URL" --json
[ "$(json "d['chunks']")" = 6 ] || fail "stats counts 6 chunks"
NS=$(json "d['namespaces'][0]['id']")
expect 0 "$KVTIER" fsck "$URL"

# One flipped payload byte in one object, rewritten from the side: found, named, repaired.
OBJ=$("$PY" - "$URL" "$NS" <<'PY'
import os, sys, boto3
bucket, _, prefix = sys.argv[1][5:].partition("/")
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{sys.argv[2]}/")["Contents"]
              if len(o["Key"].rsplit("/", 1)[1]) == 64)
body = bytearray(s3.get_object(Bucket=bucket, Key=keys[0])["Body"].read())
body[4096 + 777] ^= 0x04
s3.put_object(Bucket=bucket, Key=keys[0], Body=bytes(body))
print(f"s3://{bucket}/{keys[0]}")
PY
)
expect 1 "$KVTIER" fsck "$URL"
grep -q "corrupt.*$OBJ" "$T/all" || { cat "$T/all"; fail "fsck does not name $OBJ"; }
expect 0 "$KVTIER" fsck "$URL" --repair
expect 0 "$KVTIER" fsck "$URL"
grep -q "5 good" "$T/all" || fail "five good chunks remain"

# kvtier serve with an S3 L2: starts, says where its L2 is, drains on SIGTERM.
"$KVTIER" serve --l1-size-gb 0.25 --socket "$T/sock" --http-port -1 \
  --l2 "{\"type\":\"s3\",\"url\":\"$URL/serve\",\"max_size_gb\":1}" >"$T/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do [ -S "$T/sock" ] && break; sleep 0.1; done
[ -S "$T/sock" ] || { cat "$T/serve.log"; fail "serve with an S3 L2 did not start"; }
grep -q "file tier at $URL/serve" "$T/serve.log" || fail "serve does not name its S3 L2"
kill -TERM "$SERVER"; wait "$SERVER" || fail "serve did not exit cleanly"; SERVER=

# Errors: a wrong secret, a missing bucket, a malformed URL; nothing is touched.
expect 2 env AWS_SECRET_ACCESS_KEY=wrong "$KVTIER" stats "$URL"
grep -q "SignatureDoesNotMatch" "$T/all" || fail "a wrong secret is not named"
expect 1 env AWS_SECRET_ACCESS_KEY=wrong "$KVTIER" serve --socket "$T/sock2" --http-port -1 \
  --l2 "{\"type\":\"s3\",\"url\":\"$URL/serve\"}"
grep -q "AWS_SECRET_ACCESS_KEY" "$T/all" || fail "serve does not say which credential is wrong"
expect 2 "$KVTIER" fsck s3://kvtier-no-such-bucket/kv
grep -q "bucket does not exist" "$T/all" || fail "a missing bucket is not named"
expect 1 "$KVTIER" serve --socket "$T/sock3" --http-port -1 --l2 '{"type":"s3","url":"/tmp/x"}'
grep -q "s3://BUCKET" "$T/all" || fail "an s3 tier with a path is not refused"

expect 0 "$KVTIER" purge "$URL" --yes
expect 0 "$KVTIER" stats "$URL" --json
[ "$(json "d['chunks']")" = 0 ] || fail "purge left chunks"
echo "s3 cli test: ok"
