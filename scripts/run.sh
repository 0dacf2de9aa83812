#!/usr/bin/env bash
# Installs dependencies, builds kvtier (Release) and runs the main job on built-in defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/release -j"$(nproc)"
exec ./build/release/kvtier bench engine "$@"
