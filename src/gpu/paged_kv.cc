#include "kvtier/paged_kv.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "gpu/copy_plan.h"

namespace kvtier {

namespace {

using i128 = __int128;

constexpr uint64_t kMaxBlocks = uint64_t{1} << 31;
// Keeps every address computation far from uint64 overflow.
constexpr i128 kMaxExtent = i128{1} << 56;

Status TensorError(size_t index, std::string_view what) {
  return Status::InvalidArgument(fmt::format("paged KV tensor {}: {}", index, what));
}

// Offsets, inside one block, of a tensor's pages in canonical (layer, component) order.
std::vector<i128> PageOffsets(const KvPageTensor& t) {
  std::vector<i128> offsets;
  offsets.reserve(size_t{t.num_layers} * t.num_components);
  for (uint32_t l = 0; l < t.num_layers; ++l) {
    for (uint32_t c = 0; c < t.num_components; ++c) {
      offsets.push_back(i128(l) * t.layer_stride_bytes + i128(c) * t.component_stride_bytes);
    }
  }
  return offsets;
}

i128 FloorDiv(i128 a, i128 b) {  // b > 0
  i128 q = a / b;
  if ((a % b != 0) && (a < 0)) --q;
  return q;
}

// True when two pages of the tensor share a byte. Page (b, k) covers
// [b * stride + o_k, + page). For a pair (k1, k2) the distance |d * stride + (o_k1 - o_k2)|, with
// d = b1 - b2, is convex in d, so only the integers next to its real minimum (clamped to the
// valid range of d) need checking.
bool PagesOverlap(const std::vector<i128>& offsets, uint64_t num_blocks, uint64_t block_stride,
                  uint64_t page) {
  const i128 max_d = i128(num_blocks) - 1;
  const i128 stride = block_stride;
  for (size_t k1 = 0; k1 < offsets.size(); ++k1) {
    for (size_t k2 = 0; k2 < offsets.size(); ++k2) {
      const i128 delta = offsets[k1] - offsets[k2];
      std::vector<i128> candidates = {-max_d, max_d, 1, -1, 0};
      if (stride > 0) {
        const i128 f = FloorDiv(-delta, stride);
        candidates.push_back(f);
        candidates.push_back(f + 1);
      }
      for (i128 d : candidates) {
        d = std::clamp(d, -max_d, max_d);
        if (k1 == k2 && d == 0) continue;
        i128 distance = d * stride + delta;
        if (distance < 0) distance = -distance;
        if (distance < i128(page)) return true;
      }
    }
  }
  return false;
}

}  // namespace

std::string_view MemorySpaceName(MemorySpace space) {
  switch (space) {
    case MemorySpace::kHost:
      return "host";
    case MemorySpace::kCuda:
      return "cuda";
  }
  return "unknown";
}

std::string_view CopyMechanismName(CopyMechanism mechanism) {
  switch (mechanism) {
    case CopyMechanism::kAuto:
      return "auto";
    case CopyMechanism::kHostMemcpy:
      return "memcpy";
    case CopyMechanism::kCopyEngine:
      return "dma";
    case CopyMechanism::kSmKernel:
      return "kernel";
    case CopyMechanism::kStaged:
      return "staged";
  }
  return "unknown";
}

Result<CopyMechanism> ParseCopyMechanism(std::string_view name) {
  if (name == "auto") return CopyMechanism::kAuto;
  if (name == "memcpy") return CopyMechanism::kHostMemcpy;
  if (name == "dma" || name == "copy-engine") return CopyMechanism::kCopyEngine;
  if (name == "kernel" || name == "sm-kernel") return CopyMechanism::kSmKernel;
  if (name == "staged") return CopyMechanism::kStaged;
  return Status::InvalidArgument(fmt::format(
      "unknown copy mechanism '{}' (expected auto, memcpy, dma, kernel or staged)", name));
}

KvPageTensor KvPageTensor::SplitKv(void* base, uint64_t num_blocks, uint32_t tokens_per_block,
                                   uint64_t token_bytes) {
  const uint64_t page = uint64_t{tokens_per_block} * token_bytes;
  KvPageTensor t;
  t.base = base;
  t.num_blocks = num_blocks;
  t.block_stride_bytes = page;
  t.token_bytes = token_bytes;
  t.num_components = 2;
  t.component_stride_bytes = num_blocks * page;
  return t;
}

KvPageTensor KvPageTensor::PackedKv(void* base, uint64_t num_blocks, uint32_t tokens_per_block,
                                    uint64_t token_bytes) {
  const uint64_t page = uint64_t{tokens_per_block} * token_bytes;
  KvPageTensor t;
  t.base = base;
  t.num_blocks = num_blocks;
  t.block_stride_bytes = 2 * page;
  t.token_bytes = token_bytes;
  t.num_components = 2;
  t.component_stride_bytes = page;
  return t;
}

KvPageTensor KvPageTensor::SinglePage(void* base, uint64_t num_blocks, uint32_t tokens_per_block,
                                      uint64_t token_bytes) {
  KvPageTensor t;
  t.base = base;
  t.num_blocks = num_blocks;
  t.block_stride_bytes = uint64_t{tokens_per_block} * token_bytes;
  t.token_bytes = token_bytes;
  return t;
}

KvPageTensor KvPageTensor::CrossLayer(void* base, uint64_t num_blocks, uint32_t num_layers,
                                      uint32_t tokens_per_block, uint64_t token_bytes) {
  const uint64_t page = uint64_t{tokens_per_block} * token_bytes;
  KvPageTensor t;
  t.base = base;
  t.num_blocks = num_blocks;
  t.block_stride_bytes = uint64_t{num_layers} * 2 * page;
  t.token_bytes = token_bytes;
  t.num_layers = num_layers;
  t.layer_stride_bytes = 2 * page;
  t.num_components = 2;
  t.component_stride_bytes = page;
  return t;
}

Result<PagedKvCache> PagedKvCache::Create(PagedKvCacheDesc desc) {
  if (desc.tensors.empty()) return Status::InvalidArgument("paged KV cache: no tensors");
  if (desc.tokens_per_block == 0) {
    return Status::InvalidArgument("paged KV cache: tokens_per_block must be positive");
  }
  if (desc.memory == MemorySpace::kCuda && desc.device < 0) {
    return Status::InvalidArgument(fmt::format("paged KV cache: bad device {}", desc.device));
  }
  PagedKvCache cache;
  cache.num_blocks_ = std::numeric_limits<uint64_t>::max();
  cache.min_page_bytes_ = std::numeric_limits<uint64_t>::max();
  struct Extent {
    i128 begin, end;
    size_t tensor;
  };
  std::vector<Extent> extents;
  i128 prefix = 0;
  for (size_t i = 0; i < desc.tensors.size(); ++i) {
    const KvPageTensor& t = desc.tensors[i];
    if (t.base == nullptr) return TensorError(i, "null base pointer");
    if (t.num_blocks == 0) return TensorError(i, "num_blocks is 0");
    if (t.num_blocks > kMaxBlocks) {
      return TensorError(i, fmt::format("{} blocks is more than 2^31", t.num_blocks));
    }
    if (t.token_bytes == 0) return TensorError(i, "token_bytes is 0");
    if (t.num_layers == 0 || t.num_components == 0) {
      return TensorError(i, "num_layers and num_components must be positive");
    }
    const i128 page = i128(desc.tokens_per_block) * t.token_bytes;
    if (page > kMaxExtent) return TensorError(i, "page size is absurdly large");
    const std::vector<i128> offsets = PageOffsets(t);
    const i128 max_offset = *std::max_element(offsets.begin(), offsets.end());
    const i128 end = i128(t.num_blocks - 1) * t.block_stride_bytes + max_offset + page;
    if (end > kMaxExtent) return TensorError(i, "extent is absurdly large");
    if (t.num_blocks > 1 && t.block_stride_bytes == 0) {
      return TensorError(i, "block_stride_bytes is 0 but there are several blocks");
    }
    if (PagesOverlap(offsets, t.num_blocks, t.block_stride_bytes, uint64_t(page))) {
      return TensorError(
          i, fmt::format("pages overlap (page {} B, block stride {} B, layer stride {} B, "
                         "component stride {} B)",
                         uint64_t(page), t.block_stride_bytes, t.layer_stride_bytes,
                         t.component_stride_bytes));
    }
    const i128 begin = i128(reinterpret_cast<uintptr_t>(t.base));
    extents.push_back({begin, begin + end, i});
    for (i128 off : offsets) {
      KvPageStream s;
      s.first_page = static_cast<char*>(t.base) + uint64_t(off);
      s.block_stride = t.block_stride_bytes;
      s.page_bytes = uint64_t(page);
      s.token_bytes = t.token_bytes;
      s.prefix_token_bytes = uint64_t(prefix);
      prefix += t.token_bytes;
      cache.streams_.push_back(s);
    }
    cache.num_blocks_ = std::min(cache.num_blocks_, t.num_blocks);
    cache.min_page_bytes_ = std::min(cache.min_page_bytes_, uint64_t(page));
    cache.max_page_bytes_ = std::max(cache.max_page_bytes_, uint64_t(page));
  }
  if (prefix > kMaxExtent / 65536) {
    return Status::InvalidArgument("paged KV cache: bytes per token is absurdly large");
  }
  std::sort(extents.begin(), extents.end(),
            [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].begin < extents[i - 1].end) {
      return Status::InvalidArgument(fmt::format(
          "paged KV cache: tensors {} and {} overlap in memory (describe interleaved pages as "
          "layers or components of one tensor)",
          extents[i - 1].tensor, extents[i].tensor));
    }
  }
  cache.bytes_per_token_ = uint64_t(prefix);
  cache.desc_ = std::move(desc);
  return cache;
}

bool PagedKvCache::PagesAligned(uint64_t alignment) const {
  for (const KvPageTensor& t : desc_.tensors) {
    const auto misaligned = [&](uint64_t v) { return v % alignment != 0; };
    if (misaligned(reinterpret_cast<uintptr_t>(t.base))) return false;
    if (t.num_blocks > 1 && misaligned(t.block_stride_bytes)) return false;
    if (t.num_layers > 1 && misaligned(t.layer_stride_bytes)) return false;
    if (t.num_components > 1 && misaligned(t.component_stride_bytes)) return false;
    if (misaligned(uint64_t{desc_.tokens_per_block} * t.token_bytes)) return false;
  }
  return true;
}

Status PagedKvCache::CheckRequest(std::span<const int64_t> block_ids, uint64_t num_tokens,
                                  bool for_scatter) const {
  const uint64_t tpb = desc_.tokens_per_block;
  if (num_tokens == 0) return Status::InvalidArgument("chunk of 0 tokens");
  if (num_tokens % tpb != 0) {
    return Status::InvalidArgument(fmt::format(
        "chunk of {} tokens is not a multiple of {} tokens per block: partial last block "
        "({} tokens) refused",
        num_tokens, tpb, num_tokens % tpb));
  }
  if (block_ids.size() != num_tokens / tpb) {
    return Status::InvalidArgument(
        fmt::format("chunk of {} tokens needs {} block ids ({} tokens per block), got {}",
                    num_tokens, num_tokens / tpb, tpb, block_ids.size()));
  }
  for (size_t j = 0; j < block_ids.size(); ++j) {
    if (for_scatter && block_ids[j] == kSkipBlock) continue;
    if (block_ids[j] < 0 || uint64_t(block_ids[j]) >= num_blocks_) {
      return Status::InvalidArgument(fmt::format("block id {} (position {}) out of range [0, {})",
                                                 block_ids[j], j, num_blocks_));
    }
  }
  if (for_scatter && block_ids.size() > 1) {
    std::unordered_set<int64_t> seen;
    for (int64_t id : block_ids) {
      if (id != kSkipBlock && !seen.insert(id).second) {
        return Status::InvalidArgument("scatter into duplicate block ids refused");
      }
    }
  }
  return Status::Ok();
}

std::string PagedKvCache::ToString() const {
  std::string where = desc_.memory == MemorySpace::kCuda ? fmt::format("cuda:{}", desc_.device)
                                                         : std::string("host");
  std::string pages = min_page_bytes_ == max_page_bytes_
                          ? fmt::format("{} B", min_page_bytes_)
                          : fmt::format("{}-{} B", min_page_bytes_, max_page_bytes_);
  return fmt::format(
      "{}, {} tensors, {} page streams, {} blocks of {} tokens, {} B/token, "
      "pages {}",
      where, desc_.tensors.size(), streams_.size(), num_blocks_, desc_.tokens_per_block,
      bytes_per_token_, pages);
}

Status KvCopier::CheckChunks(std::span<const ChunkCopy> chunks, uint64_t num_tokens,
                             bool gather) const {
  const uint64_t need = cache_.chunk_bytes(num_tokens);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ChunkCopy& c = chunks[i];
    Status st = cache_.CheckRequest(c.block_ids, num_tokens, /*for_scatter=*/!gather);
    if (st.ok() && c.chunk == nullptr) st = Status::InvalidArgument("null chunk buffer");
    if (st.ok() && (gather ? c.chunk_bytes < need : c.chunk_bytes != need)) {
      st = Status::InvalidArgument(fmt::format("chunk buffer of {} bytes, {} {}", c.chunk_bytes,
                                               gather ? "at least" : "exactly", need));
    }
    if (!st.ok()) return st.WithContext(fmt::format("chunk {} of {}", i, chunks.size()));
  }
  return Status::Ok();
}

// The generic batch: one call per chunk, in order, on the caller's stream (or the copier's stream
// for that direction), so the last handle completes after every earlier copy.
Result<CopyHandle> KvCopier::GatherChunks(std::span<const ChunkCopy> chunks, uint64_t num_tokens,
                                          const CopyOptions& options) {
  KVTIER_RETURN_IF_ERROR(CheckChunks(chunks, num_tokens, /*gather=*/true));
  CopyHandle last;
  for (const ChunkCopy& c : chunks) {
    KVTIER_ASSIGN_OR_RETURN(last, Gather(c.block_ids, num_tokens, c.chunk, c.chunk_bytes, options));
  }
  return last;
}

Result<CopyHandle> KvCopier::ScatterChunks(std::span<const ChunkCopy> chunks, uint64_t num_tokens,
                                           const CopyOptions& options) {
  KVTIER_RETURN_IF_ERROR(CheckChunks(chunks, num_tokens, /*gather=*/false));
  CopyHandle last;
  for (const ChunkCopy& c : chunks) {
    KVTIER_ASSIGN_OR_RETURN(last,
                            Scatter(c.block_ids, num_tokens, c.chunk, c.chunk_bytes, options));
  }
  return last;
}

namespace gpu {

std::vector<CopySegment> PlanSegments(const PagedKvCache& cache, std::span<const int64_t> block_ids,
                                      bool merge) {
  std::vector<CopySegment> segments;
  const uint64_t nblk = block_ids.size();
  segments.reserve(cache.streams().size() * nblk);
  for (size_t s = 0; s < cache.streams().size(); ++s) {
    const uint64_t page = cache.streams()[s].page_bytes;
    for (uint64_t j = 0; j < nblk; ++j) {
      if (block_ids[j] == kSkipBlock) continue;
      char* addr = cache.PageAddress(s, block_ids[j]);
      const uint64_t off = cache.ChunkOffset(s, nblk, j);
      if (merge && !segments.empty()) {
        CopySegment& last = segments.back();
        if (last.page + last.bytes == addr && last.chunk_offset + last.bytes == off) {
          last.bytes += page;
          continue;
        }
      }
      segments.push_back({addr, off, page});
    }
  }
  return segments;
}

}  // namespace gpu
}  // namespace kvtier
