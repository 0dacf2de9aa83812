// The GPU data-path benchmark behind `kvtier bench gpu`: gathers and scatters chunks of a
// Qwen3-8B-like paged KV cache with every mechanism, and measures in the same run the plain
// pinned cudaMemcpy peaks they are compared with.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::gpu {

struct GpuBenchOptions {
  int device = 0;
  // The model shape: token bytes per page = kv_heads x head_dim x dtype_bytes.
  uint32_t layers = 36;
  uint32_t kv_heads = 8;
  uint32_t head_dim = 128;
  uint32_t dtype_bytes = 2;
  uint32_t chunk_tokens = 256;
  // Block sizes (tokens per block) to run; the first is the headline one.
  std::vector<uint32_t> block_tokens = {16, 32, 64};
  // Chunks per timed batch and direction, and device memory for the paged cache.
  uint32_t chunks = 32;
  uint64_t cache_bytes = uint64_t{8} << 30;
  int reps = 5;  // timed repetitions per figure (median reported), after one warm-up
  // Extra variants tried on the headline block size: staging slot sizes (MiB) and thread-block
  // counts of the zero-copy kernel.
  std::vector<uint64_t> staging_slot_mib = {8, 64};
  std::vector<int> kernel_blocks = {32, 264};
  std::function<void(const std::string&)> progress;  // one line per finished figure
};

struct GpuBenchRow {
  std::string layout;  // "per-layer" or "cross-layer"
  uint32_t block_tokens = 0;
  uint64_t page_bytes = 0;
  std::string variant;  // "auto=staged", "kernel", "dma", "staged", "staged/8MiB", ...
  std::string op;       // "gather", "scatter", "bidir"
  double gbps = 0;
  double peak_gbps = 0;   // the matching pinned cudaMemcpy peak of the same run (the larger of
                          // the start and end measurements)
  double ratio = 0;       // gbps / peak_gbps
  bool verified = false;  // every gathered/scattered chunk matched page-by-page copies
};

struct GpuBenchReport {
  std::string device;
  uint64_t chunk_bytes = 0;
  uint64_t batch_bytes = 0;  // bytes per direction in one timed batch
  // Pinned cudaMemcpy of one batch: d2h, h2d and both at once on two streams, measured before
  // and after the copies. peak_* (and every ratio) use the larger of the two.
  struct Peaks {
    double d2h = 0, h2d = 0, bidir = 0;
  };
  Peaks peaks_start, peaks_end;
  double peak_d2h = 0, peak_h2d = 0, peak_bidir = 0;
  // The headline figures: per-layer layout, first block size, mechanism kAuto.
  std::string auto_mechanism;
  double gather = 0, scatter = 0, bidir = 0;
  // The same for the cross-layer layout.
  std::string cross_auto_mechanism;
  double cross_gather = 0, cross_scatter = 0, cross_bidir = 0;
  std::vector<GpuBenchRow> rows;
};

// Runs the benchmark. Unimplemented in builds without CUDA; Unavailable without a device;
// Internal on a CUDA error or a verification failure.
Result<GpuBenchReport> RunGpuBench(const GpuBenchOptions& options);

}  // namespace kvtier::gpu
