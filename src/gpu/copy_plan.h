// The list of contiguous copies that moves one chunk: shared by the host copier, the copy-engine
// path of the CUDA copier and the tests.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvtier/paged_kv.h"

namespace kvtier::gpu {

// One contiguous run: `bytes` at `page` in the cache <-> `bytes` at `chunk_offset` in the chunk.
struct CopySegment {
  char* page;
  uint64_t chunk_offset;
  uint64_t bytes;
};

// Segments of one chunk in chunk order (streams, then blocks). With `merge`, runs that are
// contiguous both in the cache and in the chunk (consecutive block ids whose pages are adjacent)
// become one segment. kSkipBlock ids get no segment. REQUIRES: cache.CheckRequest(block_ids, ...)
// passed.
std::vector<CopySegment> PlanSegments(const PagedKvCache& cache, std::span<const int64_t> block_ids,
                                      bool merge);

}  // namespace kvtier::gpu
