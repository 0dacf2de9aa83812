#!/usr/bin/env bash
# Two hosts reading one NFS export at once against one host alone, in the same run: network
# namespaces stand in for a file server (the loopback nfs-ganesha of scripts/nfs-server.sh,
# bound to 10.213.0.1, with an rpcbind of its own under a private /run) and two hosts
# (10.213.0.2, .3) joined by a bridge, as in python/tests/test_two_hosts.py. Each host runs
# `kvtier bench tier` on a directory of its own in the export through nfs:// (no mount): first
# host A alone, then A and B started together. Prints each run's tier read GB/s, the two hosts'
# sum and its ratio to A alone. The hosts' runs start together and do the same work, so their
# read phases overlap, but not to the millisecond: the sum is what each host measured over its
# own read phase. Needs root; everything it makes is removed on exit.
#
#   scripts/bench-two-hosts.sh [KVTIER_BINARY] [BENCH_TIER_ARGS...]
#
# Defaults: build/release/kvtier, --chunk-mib 4 --chunks 32 --repeats 3 --readers 4 --writers 4.
set -euo pipefail
cd "$(dirname "$0")/.."
kvtier=${1:-build/release/kvtier}
shift || true
[ $# -gt 0 ] || set -- --chunk-mib 4 --chunks 32 --repeats 3 --readers 4 --writers 4
[ -x "$kvtier" ] || { echo "no kvtier binary at $kvtier" >&2; exit 1; }
kvtier=$(realpath "$kvtier")
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, ganesha)" >&2; exit 1; }

readonly SERVER_ADDR=10.213.0.1
p="kvtb$$"
srv=${p}s
state=$(mktemp -d /tmp/kvtier-bench-two-hosts.XXXXXX)
made=()
cleanup() {
  KVTIER_NFS_ADDR=$SERVER_ADDR ip netns exec "$srv" ./scripts/nfs-server.sh stop "$state" \
    >/dev/null 2>&1 || true
  local ns
  for ns in "${made[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$state"
}
trap cleanup EXIT

for ns in "$srv" "${p}a" "${p}b"; do
  ip netns add "$ns"
  made+=("$ns")
  ip -n "$ns" link set lo up
done
ip -n "$srv" link add br0 type bridge
ip -n "$srv" addr add "$SERVER_ADDR/24" dev br0
ip -n "$srv" link set br0 up
i=2
for h in a b; do
  ip -n "$srv" link add "to-$h" type veth peer name eth0 netns "$p$h"
  ip -n "$srv" link set "to-$h" master br0 up
  ip -n "$p$h" addr add "10.213.0.$i/24" dev eth0
  ip -n "$p$h" link set eth0 up
  i=$((i + 1))
done

ip netns exec "$srv" unshare --mount --propagation private sh -c \
  "mount -t tmpfs -o mode=755 kvtier-run /run &&
   KVTIER_NFS_ADDR=$SERVER_ADDR exec ./scripts/nfs-server.sh start '$state'" >/dev/null
url="nfs://$SERVER_ADDR/export"

read_gbps() { python3 -c 'import json,sys; print(json.load(sys.stdin)["read_GBps"])'; }

args=("$@")
one() {  # HOST DIR: bench tier's JSON on stdout
  ip netns exec "$p$1" "$kvtier" bench tier --dir "$url/$2" --json "${args[@]}" 2>/dev/null
}

echo "== bench tier through nfs://$SERVER_ADDR (loopback in network namespaces): $*"
alone=$(one a alone | read_gbps)
printf "host A alone:          read %.3f GB/s\n" "$alone"
one a both-a > "$state/a.json" &
pa=$!
one b both-b > "$state/b.json" &
pb=$!
wait "$pa" "$pb"
ra=$(read_gbps < "$state/a.json")
rb=$(read_gbps < "$state/b.json")
python3 - "$alone" "$ra" "$rb" <<'EOF'
import sys
alone, a, b = map(float, sys.argv[1:])
print(f"hosts A and B at once: read {a:.3f} + {b:.3f} = {a + b:.3f} GB/s")
print(f"ratio (two hosts together / one alone): {(a + b) / alone:.2f}")
EOF
