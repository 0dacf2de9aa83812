// Internals of the CUDA copier that the benchmark and the tests reach beyond the public
// interface. CUDA builds only.
#pragma once

#include <string>

#include "kvtier/paged_kv.h"

namespace kvtier::gpu {

// "cuda:0 NVIDIA H200, 132 SMs, driver 13.0, runtime 13.0" or the error.
Result<std::string> DescribeCudaDevice(int device);

}  // namespace kvtier::gpu
