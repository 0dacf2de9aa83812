#!/usr/bin/env bash
# NFS without a mount, measured: `kvtier bench storage` and `kvtier bench tier` on nfs:// with 1,
# 8 and 16 connections, beside the local disk the export lives on and beside libnfs's own
# `nfs-cp` (1 and N copies at once, one connection each). Against the loopback NFS server of
# scripts/nfs-server.sh (started here if none is up, stopped again afterwards).
#
#   scripts/bench-nfs.sh [OUT_DIR]       (default build/bench-nfs; JSON and logs go there)
#
# Environment: KVTIER (the kvtier binary, default build/release/kvtier), NFS_STATE (the server's
# state directory, default /tmp/kvtier-nfs), CONNECTIONS (default "1 8 16"), CHUNK_MIB (32),
# CHUNKS (32), REPEATS (2), LOCAL_DIR (a directory on the export's disk, default
# $NFS_STATE/local-bench), NFSCP_MIB (size of each nfs-cp file, 1024).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/bench-nfs}
kvtier=${KVTIER:-build/release/kvtier}
state=${NFS_STATE:-/tmp/kvtier-nfs}
connections=${CONNECTIONS:-1 8 16}
chunk_mib=${CHUNK_MIB:-32}
chunks=${CHUNKS:-32}
repeats=${REPEATS:-2}
nfscp_mib=${NFSCP_MIB:-1024}
local_dir=${LOCAL_DIR:-$state/local-bench}
[ -x "$kvtier" ] || { echo "no kvtier binary at $kvtier (build first, or set KVTIER)" >&2; exit 1; }
mkdir -p "$out"

started=0
if ! ./scripts/nfs-server.sh status "$state" >/dev/null 2>&1; then
  ./scripts/nfs-server.sh start "$state"
  started=1
fi
eval "$(./scripts/nfs-server.sh env "$state")"
url=$KVTIER_TEST_NFS_URL/bench-nfs
scratch=$KVTIER_TEST_NFS_EXPORT_DIR/bench-nfs
cleanup() {
  rm -rf "$scratch" "$local_dir" /dev/shm/kvtier-bench-nfs.*
  if [ "$started" = 1 ]; then ./scripts/nfs-server.sh stop "$state"; fi
}
trap cleanup EXIT
mkdir -p "$scratch/probe" "$local_dir"

field() { python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(j$2)" "$1"; }

# bench_tier LABEL NAME DIR THREADS: one `bench tier` run, its JSON in $out/NAME.json, one row.
bench_tier() {
  local f=$out/$2.json
  "$kvtier" bench tier --dir "$3" --chunk-mib "$chunk_mib" --chunks "$chunks" \
    --repeats "$repeats" --readers "$4" --writers "$4" --json >"$f" 2>"$out/$2.log"
  printf '%-22s %10.2f %10.2f %7.2f %10.2f %10.2f %7.2f\n' "$1" \
    "$(field "$f" "['write_GBps']")" "$(field "$f" "['raw_write_GBps']")" \
    "$(field "$f" "['write_ratio']")" "$(field "$f" "['read_GBps']")" \
    "$(field "$f" "['raw_read_GBps']")" "$(field "$f" "['read_ratio']")"
}

echo "== kvtier bench tier: nfs:// vs plain libnfs, and the local disk vs plain O_DIRECT"
printf '%-22s %10s %10s %7s %10s %10s %7s\n' where write ref ratio read ref ratio
for c in $connections; do bench_tier "nfs, $c connections" "tier-nfs-$c" "$url/tier" "$c"; done
for c in 1 8; do bench_tier "local disk, $c threads" "tier-local-$c" "$local_dir/tier" "$c"; done

echo "== kvtier bench storage (the probe): nfs:// with C connections and C readers, local disk"
printf '%-22s %10s %10s %10s\n' where read write control
for c in $connections; do
  f=$out/storage-nfs-$c.json
  "$kvtier" bench storage "$url/probe" --nfs-connections "$c" --readers "$c" --json \
    >"$f" 2>"$out/storage-nfs-$c.log"
  printf '%-22s %10.2f %10.2f %10.2f\n' "nfs, $c connections" \
    "$(field "$f" "['readers'][0]['read_GBps']")" "$(field "$f" "['write_GBps']")" \
    "$(field "$f" "['control_GBps']")"
done
f=$out/storage-local.json
"$kvtier" bench storage "$local_dir" --readers 1,8 --json >"$f" 2>"$out/storage-local.log" || true
printf '%-22s %10.2f %10.2f %10.2f\n' "local disk, 8 readers" \
  "$(field "$f" "['readers'][-1]['read_GBps']")" "$(field "$f" "['write_GBps']")" \
  "$(field "$f" "['control_GBps']")"

echo "== nfs-cp (libnfs's own copy tool): N copies at once, $nfscp_mib MiB each, from/to tmpfs"
src=/dev/shm/kvtier-bench-nfs.src
head -c "$((nfscp_mib << 20))" /dev/urandom >"$src"
printf '%-22s %10s %10s\n' copies write read
for n in $connections; do
  t0=$EPOCHREALTIME
  for i in $(seq "$n"); do nfs-cp "$src" "$url/cp-$i" >/dev/null & done
  wait
  t1=$EPOCHREALTIME
  for i in $(seq "$n"); do nfs-cp "$url/cp-$i" "/dev/shm/kvtier-bench-nfs.dst-$i" >/dev/null & done
  wait
  t2=$EPOCHREALTIME
  rm -f /dev/shm/kvtier-bench-nfs.dst-* "$scratch"/cp-*
  python3 -c "
import sys
n, mib, t0, t1, t2 = int(sys.argv[1]), int(sys.argv[2]), *map(float, sys.argv[3:])
b = n * mib * 2**20
print(f'{n:<22d} {b / (t1 - t0) / 1e9:10.2f} {b / (t2 - t1) / 1e9:10.2f}')
" "$n" "$nfscp_mib" "${t0/,/.}" "${t1/,/.}" "${t2/,/.}"
done
echo "GB/s throughout (10^9 bytes per second); JSON and logs in $out"
