#!/usr/bin/env bash
# The GPU data path's whole check on a machine with an NVIDIA GPU, in one go: builds the CUDA
# part, runs its tests (host and GPU), runs the GPU tests again under compute-sanitizer memcheck,
# and runs `kvtier bench gpu` at several block (page) sizes. Logs and JSON go to the output
# folder; a short summary table is printed last.
#
#   scripts/gpu-check.sh [OUTPUT_DIR]        (default: $OUT, else build/gpu-check)
#
# Build: the regular CMake build (-DKVTIER_WITH_CUDA=ON, only the GPU targets) when every
# dependency is installed; otherwise a standalone build of just the GPU library, its tests and a
# `kvtier` binary with the bench command, which needs only nvcc, a C++20 g++ and the header-only
# libraries (fmt, spdlog, nlohmann-json, CLI11) plus GoogleTest sources. Point KVTIER_DEPS_DIR at
# a folder holding include/{fmt,spdlog,nlohmann,CLI} and googletest/ for machines without the
# Debian dev packages (copy them from /usr/include and /usr/src/googletest of a Debian machine).
#
# Environment: KVTIER_GPU_BUILD (auto, cmake or standalone; default auto), KVTIER_BENCH_ARGS
# (default "--block-tokens 16,32,64,128"), CUDA_HOME.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${1:-${OUT:-build/gpu-check}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cuda=${CUDA_HOME:-/usr/local/cuda}
export PATH="$cuda/bin:$PATH"
jobs=$(nproc)
bench_args=${KVTIER_BENCH_ARGS:---block-tokens 16,32,64,128}
deps=${KVTIER_DEPS_DIR:-}
[ -n "$deps" ] && deps=$(cd "$deps" && pwd)
status_build=FAIL status_test=FAIL status_cuda_test=FAIL status_memcheck=FAIL status_bench=FAIL
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

# 1. What this machine has (cheap, and it tells the next run what to expect).
{
  echo "== date"; date -u
  echo "== os"; grep PRETTY_NAME /etc/os-release
  echo "== gpu"; nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1
  echo "== tools"
  for t in nvcc g++ cmake ninja python3 compute-sanitizer; do
    printf '%-18s %s\n' "$t" "$(command -v $t || echo missing)"
  done
  nvcc --version | tail -2; g++ --version | head -1; cmake --version | head -1
  echo "== headers and libraries"
  for h in fmt/format.h spdlog/spdlog.h nlohmann/json.hpp CLI/CLI.hpp gtest/gtest.h \
           openssl/evp.h xxhash.h liburing.h; do
    if [ -e "/usr/include/$h" ]; then printf '%-20s present\n' "$h"; else printf '%-20s missing\n' "$h"; fi
  done
  echo "cpus: $jobs"; free -g | head -2
} > "$out/env.txt" 2>&1
stamp "environment written to env.txt"

build_cmake() {
  local dir=build/gpu-cmake gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DKVTIER_WITH_CUDA=ON &&
    cmake --build "$dir" -j"$jobs" --target kvtier gpu_test gpu_cuda_test || return 1
  bin_kvtier=$dir/kvtier
  bin_test=$dir/src/gpu/gpu_test
  bin_cuda_test=$dir/src/gpu/gpu_cuda_test
}

build_standalone() {
  local dir=build/gpu-standalone
  mkdir -p "$dir/obj"
  local inc=(-Iinclude -Isrc -I"$cuda/include")
  [ -n "$deps" ] && inc+=(-I"$deps/include")
  local cxx=(g++ -std=c++20 -O2 -g -Wall -Wextra -Wno-unused-parameter -pthread
             -DFMT_HEADER_ONLY -DKVTIER_WITH_CUDA=1 -DKVTIER_VERSION=\"standalone\" "${inc[@]}")
  local gtest_inc=() gtest_lib=(-lgtest -lgtest_main)
  if [ ! -e /usr/include/gtest/gtest.h ] || [ -n "$deps" ]; then
    local gt=${deps:+$deps/googletest}
    if [ -z "$gt" ] || [ ! -d "$gt/googletest" ]; then
      echo "no GoogleTest: set KVTIER_DEPS_DIR (see the header of this script)"; return 1
    fi
    gtest_inc=(-I"$gt/googletest/include")
    "${cxx[@]}" -I"$gt/googletest/include" -I"$gt/googletest" -c \
      "$gt/googletest/src/gtest-all.cc" -o "$dir/obj/gtest-all.o" &
    "${cxx[@]}" -I"$gt/googletest/include" -c "$gt/googletest/src/gtest_main.cc" \
      -o "$dir/obj/gtest_main.o" &
    gtest_lib=("$dir/obj/gtest-all.o" "$dir/obj/gtest_main.o")
  fi
  nvcc -std=c++17 -O3 -lineinfo -Isrc \
    -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
    -c src/gpu/page_copy_kernel.cu -o "$dir/obj/page_copy_kernel.o" &
  local srcs=(src/common/status.cc src/gpu/paged_kv.cc src/gpu/host_copier.cc
              src/gpu/cuda_copier.cc src/gpu/gpu_bench.cc src/tools/main.cc src/tools/command.cc
              src/tools/bench_gpu_cmd.cc src/gpu/paged_kv_test.cc src/gpu/cuda_copier_test.cc)
  for s in "${srcs[@]}"; do
    "${cxx[@]}" "${gtest_inc[@]}" -c "$s" -o "$dir/obj/$(basename "$s" .cc).o" &
  done
  local failed=0
  for j in $(jobs -p); do wait "$j" || failed=1; done
  [ $failed = 0 ] || return 1
  local lib=("$dir"/obj/{status,paged_kv,host_copier,cuda_copier,gpu_bench,page_copy_kernel}.o)
  local link=(-L"$cuda/lib64" -lcudart_static -ldl -lrt -pthread)
  g++ -o "$dir/kvtier" "$dir"/obj/{main,command,bench_gpu_cmd}.o "${lib[@]}" "${link[@]}" &&
    g++ -o "$dir/gpu_test" "$dir/obj/paged_kv_test.o" "${lib[@]}" "${gtest_lib[@]}" "${link[@]}" &&
    g++ -o "$dir/gpu_cuda_test" "$dir/obj/cuda_copier_test.o" "${lib[@]}" "${gtest_lib[@]}" \
      "${link[@]}" || return 1
  bin_kvtier=$dir/kvtier
  bin_test=$dir/gpu_test
  bin_cuda_test=$dir/gpu_cuda_test
}

# 2. Build.
{
  build_kind=none
  mode=${KVTIER_GPU_BUILD:-auto}
  if [ "$mode" != standalone ] && build_cmake; then
    build_kind=cmake
  elif [ "$mode" != cmake ]; then
    echo "== the CMake build is not possible here (above); building the GPU parts standalone"
    build_standalone && build_kind=standalone
  fi
  echo "build: $build_kind"
} > "$out/build.log" 2>&1
build_kind=$(tail -1 "$out/build.log" | sed 's/build: //')
if [ "$build_kind" = none ]; then
  stamp "BUILD FAILED; last lines of build.log:"
  grep -E "error|Error" "$out/build.log" | head -20
  tail -20 "$out/build.log"
  exit 1
fi
status_build="ok ($build_kind)"
stamp "built ($build_kind)"

# 3. Tests: the host-side ones, then the GPU ones, then the GPU ones under memcheck.
"$bin_test" --gtest_brief=1 > "$out/test.log" 2>&1 && status_test=ok
"$bin_cuda_test" >> "$out/test.log" 2>&1 && status_cuda_test=ok
grep -q "SKIPPED" "$out/test.log" && status_cuda_test="$status_cuda_test (some SKIPPED)"
stamp "tests: host $status_test, gpu $status_cuda_test"
if command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 "$bin_cuda_test" \
    > "$out/memcheck.log" 2>&1 && status_memcheck=ok
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | tail -3
else
  echo "compute-sanitizer not found" > "$out/memcheck.log"
fi
stamp "memcheck: $status_memcheck"

# 4. Benchmark.
# shellcheck disable=SC2086
"$bin_kvtier" bench gpu --json $bench_args > "$out/bench.json" 2> "$out/bench.log" &&
  status_bench=ok
stamp "bench: $status_bench"

# 5. Summary.
{
  echo "== gpu-check summary"
  echo "build:        $status_build"
  echo "host tests:   $status_test"
  echo "gpu tests:    $status_cuda_test"
  echo "memcheck:     $status_memcheck  ($(grep -m1 'ERROR SUMMARY' "$out/memcheck.log" 2>/dev/null))"
  echo "bench:        $status_bench"
  grep -E "FAILED|Failure" "$out/test.log" | head -10
  if [ "$status_bench" = ok ]; then
    python3 - "$out/bench.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
print(j["device"])
m = j["peaks_measured"]
print(f'peaks: d2h {j["peak_d2h_GBps"]:.1f}  h2d {j["peak_h2d_GBps"]:.1f}  bidir {j["peak_bidir_GBps"]:.1f} GB/s'
      f'  (start {m["start"]["d2h"]:.1f}/{m["start"]["h2d"]:.1f}/{m["start"]["bidir"]:.1f},'
      f' end {m["end"]["d2h"]:.1f}/{m["end"]["h2d"]:.1f}/{m["end"]["bidir"]:.1f})')
print(f'per-layer/{j["block_tokens"]} auto={j["mechanism"]}: gather {j["gather_GBps"]:.1f} ({j["gather_vs_peak_d2h"]:.3f})  '
      f'scatter {j["scatter_GBps"]:.1f} ({j["scatter_vs_peak_h2d"]:.3f})  bidir {j["bidir_GBps"]:.1f} ({j["bidir_vs_peak_bidir"]:.3f})')
c = j["cross_layer"]
print(f'cross-layer auto={c["mechanism"]}: gather {c["gather_GBps"]:.1f} ({c["gather_vs_peak_d2h"]:.3f})  '
      f'scatter {c["scatter_GBps"]:.1f} ({c["scatter_vs_peak_h2d"]:.3f})  bidir {c["bidir_GBps"]:.1f} ({c["bidir_vs_peak_bidir"]:.3f})')
print("targets met" if j["targets_met"] else "targets NOT met")
rows = {}
for r in j["rows"]:
    rows.setdefault((r["layout"], r["block_tokens"], r["variant"]), {})[r["op"]] = r["GBps"]
print(f'{"layout":<12}{"tok":>4} {"variant":<14}{"gather":>8}{"scatter":>8}{"bidir":>8}')
for (layout, tpb, variant), v in rows.items():
    print(f'{layout:<12}{tpb:>4} {variant:<14}{v.get("gather",0):8.1f}{v.get("scatter",0):8.1f}{v.get("bidir",0):8.1f}')
EOF
  else
    tail -5 "$out/bench.log"
  fi
} | tee "$out/summary.txt"
[ "$status_test" = ok ] && [[ "$status_cuda_test" == ok* ]] && [ "$status_memcheck" = ok ] &&
  [ "$status_bench" = ok ]
