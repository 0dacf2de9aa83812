// The SM copy kernel: moves whole pages between a paged KV cache in device memory and a chunk in
// the canonical layout, which may be mapped pinned host memory (zero-copy) or device memory.
// Plain C++ interface so that only page_copy_kernel.cu needs nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvtier::gpu {

// One page stream in device memory (mirrors KvPageStream).
struct DevicePageStream {
  char* first_page;
  uint64_t block_stride;
  uint64_t page_bytes;
  uint64_t prefix_token_bytes;
};

// Block ids travel in the kernel's parameters, so one launch covers at most this many blocks of
// a chunk; longer chunks take several launches.
constexpr uint32_t kMaxBlocksPerLaunch = 512;

// Copies pages (stream s, block j) for s in the `num_streams` streams at `streams` and j in
// [first_block, first_block + count). The page's canonical chunk offset, minus
// `chunk_offset_base`, is its offset from `chunk`: a launch can target a whole chunk or a
// staging buffer holding one contiguous piece of it.
struct PageCopyLaunch {
  const DevicePageStream* streams;  // device memory, num_streams entries
  uint32_t num_streams;
  char* chunk;  // device-accessible address of chunk byte `chunk_offset_base`
  uint64_t chunk_offset_base;
  uint64_t chunk_blocks;  // blocks in the whole chunk (fixes each stream's offset)
  uint64_t tokens_per_block;
  uint32_t first_block;  // position in the chunk of this launch's first block
  uint32_t count;        // blocks in this launch, <= kMaxBlocksPerLaunch
  uint32_t block_ids[kMaxBlocksPerLaunch];
};

// Queues the copy on `stream`. REQUIRES: every page address, page size and the chunk 16-byte
// aligned; `max_page_bytes` the largest page_bytes among the streams. Returns the launch error.
cudaError_t LaunchPageCopy(const PageCopyLaunch& launch, bool gather, uint64_t max_page_bytes,
                           int grid_blocks, int threads, cudaStream_t stream);

}  // namespace kvtier::gpu
