// Builds without KVTIER_WITH_CUDA: the CUDA entry points exist and say clearly that they are not
// there, so callers (the CLI, engines) need no #ifdef.
#include "gpu/gpu_bench.h"
#include "kvtier/paged_kv.h"

namespace kvtier {

Result<std::unique_ptr<KvCopier>> NewCudaKvCopier(PagedKvCache cache,
                                                  const CudaCopierOptions& options) {
  return Status::Unimplemented(
      "kvtier was built without CUDA: reconfigure with -DKVTIER_WITH_CUDA=ON for GPU copies");
}

bool CudaDataPathBuilt() { return false; }

namespace gpu {
Result<GpuBenchReport> RunGpuBench(const GpuBenchOptions& options) {
  return Status::Unimplemented(
      "kvtier was built without CUDA: reconfigure with -DKVTIER_WITH_CUDA=ON to benchmark the "
      "GPU data path");
}
}  // namespace gpu

}  // namespace kvtier
