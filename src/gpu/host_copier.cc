// The memcpy copier: same interface and chunk layout as the CUDA copier, for caches in host
// memory. Tests use it as the reference the GPU copies are checked against, bit for bit.
#include <fmt/format.h>

#include <cstring>

#include "gpu/copy_plan.h"
#include "kvtier/paged_kv.h"

namespace kvtier {
namespace {

class HostKvCopier final : public KvCopier {
 public:
  explicit HostKvCopier(PagedKvCache cache) : KvCopier(std::move(cache)) {}

  Result<CopyHandle> Gather(std::span<const int64_t> block_ids, uint64_t num_tokens, void* chunk,
                            uint64_t chunk_capacity, const CopyOptions& options) override {
    KVTIER_RETURN_IF_ERROR(CheckCall(block_ids, num_tokens, chunk, chunk_capacity, options,
                                     /*for_scatter=*/false));
    char* out = static_cast<char*>(chunk);
    for (const gpu::CopySegment& seg : gpu::PlanSegments(cache_, block_ids, /*merge=*/true)) {
      std::memcpy(out + seg.chunk_offset, seg.page, seg.bytes);
    }
    return CopyHandle();
  }

  Result<CopyHandle> Scatter(std::span<const int64_t> block_ids, uint64_t num_tokens,
                             const void* chunk, uint64_t chunk_bytes,
                             const CopyOptions& options) override {
    KVTIER_RETURN_IF_ERROR(CheckCall(block_ids, num_tokens, chunk, chunk_bytes, options,
                                     /*for_scatter=*/true));
    if (chunk_bytes != cache_.chunk_bytes(num_tokens)) {
      return Status::InvalidArgument(fmt::format("scatter: chunk is {} bytes, expected {}",
                                                 chunk_bytes, cache_.chunk_bytes(num_tokens)));
    }
    const char* in = static_cast<const char*>(chunk);
    for (const gpu::CopySegment& seg : gpu::PlanSegments(cache_, block_ids, /*merge=*/true)) {
      std::memcpy(seg.page, in + seg.chunk_offset, seg.bytes);
    }
    return CopyHandle();
  }

  CopyMechanism AutoMechanism() const override { return CopyMechanism::kHostMemcpy; }

 private:
  Status CheckCall(std::span<const int64_t> block_ids, uint64_t num_tokens, const void* chunk,
                   uint64_t chunk_bytes, const CopyOptions& options, bool for_scatter) const {
    if (options.mechanism != CopyMechanism::kAuto &&
        options.mechanism != CopyMechanism::kHostMemcpy) {
      return Status::InvalidArgument(fmt::format("host copier cannot use mechanism '{}'",
                                                 CopyMechanismName(options.mechanism)));
    }
    if (options.stream != nullptr || options.wait_event != nullptr) {
      return Status::InvalidArgument("host copier takes no CUDA stream or event");
    }
    KVTIER_RETURN_IF_ERROR(cache_.CheckRequest(block_ids, num_tokens, for_scatter));
    if (chunk == nullptr) return Status::InvalidArgument("null chunk buffer");
    if (chunk_bytes < cache_.chunk_bytes(num_tokens)) {
      return Status::InvalidArgument(fmt::format("chunk buffer of {} bytes, {} needed", chunk_bytes,
                                                 cache_.chunk_bytes(num_tokens)));
    }
    return Status::Ok();
  }
};

}  // namespace

Result<std::unique_ptr<KvCopier>> NewHostKvCopier(PagedKvCache cache) {
  if (cache.memory() != MemorySpace::kHost) {
    return Status::InvalidArgument(fmt::format("host copier needs a cache in host memory, not {}",
                                               MemorySpaceName(cache.memory())));
  }
  return std::unique_ptr<KvCopier>(new HostKvCopier(std::move(cache)));
}

}  // namespace kvtier
