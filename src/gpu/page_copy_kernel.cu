#include "gpu/page_copy_kernel.h"

namespace kvtier::gpu {
namespace {

constexpr int kUnroll = 4;  // 16-byte vectors each thread has in flight per step

// Work unit = (stream, block of the launch, part of the page), part varying fastest, so that
// neighbouring thread blocks touch neighbouring chunk bytes. A persistent grid strides over
// units. Loads of one step are all issued before the stores: reading mapped host memory over
// PCIe costs a microsecond or more, and only many requests in flight hide it.
template <bool kGather>
__global__ void PageCopyKernel(const __grid_constant__ PageCopyLaunch p, uint32_t parts,
                               uint32_t unit_bytes) {
  const uint64_t units = uint64_t{p.num_streams} * p.count * parts;
  for (uint64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const uint32_t part = static_cast<uint32_t>(u % parts);
    const uint64_t sj = u / parts;
    const uint32_t j = static_cast<uint32_t>(sj % p.count);
    const uint32_t s = static_cast<uint32_t>(sj / p.count);
    const DevicePageStream st = p.streams[s];
    const uint64_t begin = uint64_t{part} * unit_bytes;
    if (begin >= st.page_bytes) continue;
    const uint64_t n = st.page_bytes - begin < unit_bytes ? st.page_bytes - begin : unit_bytes;
    char* page = st.first_page + uint64_t{p.block_ids[j]} * st.block_stride + begin;
    char* chunk = p.chunk +
                  (p.chunk_blocks * p.tokens_per_block * st.prefix_token_bytes +
                   uint64_t{p.first_block + j} * st.page_bytes - p.chunk_offset_base) +
                  begin;
    const int4* src = reinterpret_cast<const int4*>(kGather ? page : chunk);
    int4* dst = reinterpret_cast<int4*>(kGather ? chunk : page);
    const uint32_t nv = static_cast<uint32_t>(n / 16);
    const uint32_t step = blockDim.x;
    uint32_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * step < nv; i += kUnroll * step) {
      int4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) v[k] = __ldcs(src + i + k * step);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) __stcs(dst + i + k * step, v[k]);
    }
    for (; i < nv; i += step) __stcs(dst + i, __ldcs(src + i));
  }
}

}  // namespace

cudaError_t LaunchPageCopy(const PageCopyLaunch& launch, bool gather, uint64_t max_page_bytes,
                           int grid_blocks, int threads, cudaStream_t stream) {
  if (launch.count == 0 || launch.num_streams == 0) return cudaSuccess;
  const uint32_t unit_bytes = static_cast<uint32_t>(threads) * 16 * kUnroll;
  const uint32_t parts = static_cast<uint32_t>((max_page_bytes + unit_bytes - 1) / unit_bytes);
  const uint64_t units = uint64_t{launch.num_streams} * launch.count * parts;
  const int grid = static_cast<int>(units < uint64_t(grid_blocks) ? units : grid_blocks);
  if (gather) {
    PageCopyKernel<true><<<grid, threads, 0, stream>>>(launch, parts, unit_bytes);
  } else {
    PageCopyKernel<false><<<grid, threads, 0, stream>>>(launch, parts, unit_bytes);
  }
  return cudaGetLastError();
}

}  // namespace kvtier::gpu
