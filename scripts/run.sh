#!/usr/bin/env bash
# Installs dependencies, builds kvtier (Release) and runs the main job on built-in defaults:
# `kvtier serve`, the node server (extra arguments go to it; Ctrl-C or SIGTERM drains and exits).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/release -j"$(nproc)" --target kvtier
exec ./build/release/kvtier serve "$@"
