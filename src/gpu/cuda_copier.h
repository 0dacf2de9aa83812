// Internals of the CUDA copier that the benchmark and the tests reach beyond the public
// interface. CUDA builds only.
#pragma once

#include <span>

#include "kvtier/paged_kv.h"

namespace kvtier::gpu {

// Runs the SM copy kernel of `copier` (made by NewCudaKvCopier) between its cache and `chunk`,
// any device-accessible address (device memory too, e.g. a staging buffer), on `stream`
// (cudaStream_t). No event is recorded. Same request checks as Gather/Scatter.
Status LaunchKernelCopy(KvCopier& copier, std::span<const int64_t> block_ids, uint64_t num_tokens,
                        void* chunk, bool gather, void* stream);

// "cuda:0 NVIDIA H200, 132 SMs, driver 13.0, runtime 13.0" or the error.
Result<std::string> DescribeCudaDevice(int device);

}  // namespace kvtier::gpu
