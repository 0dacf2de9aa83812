#!/usr/bin/env bash
# The file tier on S3, measured: `kvtier bench tier --dir s3://...` (the tier beside plain
# libcurl, one whole-object PUT or GET per thread, interleaved in the same run) at 1, 4 and 8
# threads, and boto3 with the same object size and thread count (scripts/s3-reference.py) as a
# second, independent reference. Against the loopback S3 server of scripts/s3-server.sh (started
# here if none is up, stopped again afterwards).
#
#   scripts/bench-s3.sh [OUT_DIR]       (default build/bench-s3; JSON and logs go there)
#
# Environment: KVTIER (the kvtier binary, default build/release/kvtier), S3_STATE (the server's
# state directory, default /tmp/kvtier-s3), THREADS (default "1 4 8"), CHUNK_MIB (36: a Qwen3-8B
# chunk of 256 tokens), CHUNKS (16), REPEATS (4).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/bench-s3}
kvtier=${KVTIER:-build/release/kvtier}
state=${S3_STATE:-/tmp/kvtier-s3}
threads_list=${THREADS:-1 4 8}
chunk_mib=${CHUNK_MIB:-36}
chunks=${CHUNKS:-16}
repeats=${REPEATS:-4}
[ -x "$kvtier" ] || { echo "no kvtier binary at $kvtier (build first, or set KVTIER)" >&2; exit 1; }
mkdir -p "$out"

started=0
if ! ./scripts/s3-server.sh status "$state" >/dev/null 2>&1; then
  ./scripts/s3-server.sh start "$state"
  started=1
fi
trap '[ "$started" = 1 ] && ./scripts/s3-server.sh stop "$state"' EXIT
eval "$(./scripts/s3-server.sh env "$state")"
py=${KVTIER_S3_VENV:-/opt/kvtier-s3-venv}/bin/python

field() { python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(j$2)" "$1"; }

echo "S3 at $AWS_ENDPOINT_URL, $chunks objects of $chunk_mib MiB, $repeats repeats; GB/s"
printf '%-8s %10s %10s %7s %10s %10s %7s %10s %10s\n' threads "tier wr" "curl wr" ratio \
  "tier rd" "curl rd" ratio "boto3 wr" "boto3 rd"
for t in $threads_list; do
  f=$out/tier-$t.json
  "$kvtier" bench tier --dir "$KVTIER_TEST_S3_URL/bench-s3" --chunk-mib "$chunk_mib" \
    --chunks "$chunks" --repeats "$repeats" --readers "$t" --writers "$t" --json \
    >"$f" 2>"$out/tier-$t.log"
  b=$out/boto3-$t.json
  "$py" scripts/s3-reference.py --url "$KVTIER_TEST_S3_URL" --objects "$chunks" \
    --size "${chunk_mib}MiB" --threads "$t" --json >"$b" 2>"$out/boto3-$t.log"
  printf '%-8s %10.2f %10.2f %7.2f %10.2f %10.2f %7.2f %10.2f %10.2f\n' "$t" \
    "$(field "$f" "['write_GBps']")" "$(field "$f" "['raw_write_GBps']")" \
    "$(field "$f" "['write_ratio']")" "$(field "$f" "['read_GBps']")" \
    "$(field "$f" "['raw_read_GBps']")" "$(field "$f" "['read_ratio']")" \
    "$(field "$b" "['phases']['put']['gb_per_s']")" "$(field "$b" "['phases']['get']['gb_per_s']")"
done
