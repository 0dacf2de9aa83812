#!/usr/bin/env bash
# Installs everything kvtier needs to build, test and benchmark, from Debian's archive.
# Safe to run again: apt-get skips what is already there.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git ccache
  clang libclang-rt-14-dev          # libFuzzer and sanitizer runtimes
  libssl-dev                        # SHA-256 for chunk keys
  libxxhash-dev                     # payload checksums
  liburing-dev                      # io_uring I/O engine
  libnfs-dev libnfs-utils           # the NFS client of nfs:// directories (and nfs-cp)
  nfs-ganesha nfs-ganesha-vfs rpcbind  # a real NFS server on loopback for the tests
  iproute2                          # network namespaces standing in for hosts (two-host test)
  nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcurl4-openssl-dev prometheus-cpp-dev
  zlib1g-dev                        # gzip'd request logs (kvtier plan --from-log)
  libpugixml-dev                    # the S3 client's XML (s3:// directories; with libcurl)
  libzmq3-dev libmsgpack-cxx-dev    # KV-cache events in vLLM's format (kvtier serve --kv-events)
  fio gnuplot-nox curl python3 python3-pip
  python3-venv                      # scripts/vllm-cpu-server.sh (optional real server)
)

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "all build dependencies present"
fi
