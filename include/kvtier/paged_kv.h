// Paged KV caches and the copies between them and chunks in host memory.
//
// An inference engine keeps its attention KV cache in fixed-size blocks ("pages") of
// `tokens_per_block` tokens; a request's tokens live in blocks named by block ids that are
// neither contiguous nor ordered. kvtier stores KV in chunks of `chunk_tokens` consecutive tokens
// laid out in one canonical, block-size-independent order, so that a chunk written by an engine
// with 16-token blocks can be read back by one with 32-token blocks. This header describes a
// paged cache as raw memory (base pointers and strides, never tensor shapes) and declares the
// copier that gathers blocks into a chunk and scatters a chunk back into blocks.
//
// ## Describing a cache
// A cache is a list of `KvPageTensor`s sharing one block-id space and one `tokens_per_block`.
// In each block, a tensor holds `num_layers x num_components` pages; page (block b, layer l,
// component c) starts at
//     base + b * block_stride_bytes + l * layer_stride_bytes + c * component_stride_bytes
// and is `tokens_per_block * token_bytes` contiguous bytes, token t of the block at
// `t * token_bytes`. Common shapes (see the helpers below):
//   * vLLM FlashAttention, one tensor per layer, [2, num_blocks, block, heads, dim]: 1 layer,
//     2 components (K, V) whose stride is num_blocks * page bytes.
//   * K/V-packed pages, [num_blocks, 2, block, heads, dim]: 1 layer, 2 components one page apart.
//   * MLA, [num_blocks, block, latent]: 1 layer, 1 component.
//   * Cross-layer, one block holding every layer, [num_blocks, layers, 2, block, heads, dim]:
//     one tensor with `layers` layers and 2 components.
//
// ## The canonical chunk layout
// Number the cache's page streams in order: tensors in list order, then layers, then components
// (stream = (tensor, layer, component)). A chunk of N tokens is the concatenation, over streams
// in that order, of N tokens x token_bytes: token 0's bytes of the stream, then token 1's, ...
// For per-layer tensors listed in layer order this is "layer-major, then K/V, then token", and a
// cross-layer tensor with the same layers gives exactly the same bytes. Nothing in it depends on
// tokens_per_block. Chunk size = N x bytes_per_token().
//
// Thread-safety: PagedKvCache is an immutable value. A KvCopier's Gather and Scatter may be called
// concurrently from several threads; CopyHandle is not thread-safe (one owner).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/status.h"

namespace kvtier {

// Where a cache's pages live.
enum class MemorySpace : uint8_t {
  kHost,  // ordinary host memory (CPU-only engines, tests)
  kCuda,  // device memory of CUDA device `device`
};
std::string_view MemorySpaceName(MemorySpace space);

// One tensor of a paged KV cache, as raw pages. All sizes in bytes.
struct KvPageTensor {
  void* base = nullptr;                 // page (block 0, layer 0, component 0)
  uint64_t num_blocks = 0;              // valid block ids are [0, num_blocks)
  uint64_t block_stride_bytes = 0;      // from block b to block b + 1
  uint64_t token_bytes = 0;             // one token's bytes in one page (e.g. heads x dim x 2)
  uint32_t num_layers = 1;              // layers kept in every block of this tensor
  uint64_t layer_stride_bytes = 0;      // from layer l to l + 1 inside a block
  uint32_t num_components = 1;          // 2 for separate K and V pages, 1 for MLA or mixed K/V
  uint64_t component_stride_bytes = 0;  // from component c to c + 1 (may exceed the block stride)

  // [2, num_blocks, tokens_per_block, ...] (vLLM FlashAttention, one tensor per layer).
  static KvPageTensor SplitKv(void* base, uint64_t num_blocks, uint32_t tokens_per_block,
                              uint64_t token_bytes);
  // [num_blocks, 2, tokens_per_block, ...] (K and V pages side by side in each block).
  static KvPageTensor PackedKv(void* base, uint64_t num_blocks, uint32_t tokens_per_block,
                               uint64_t token_bytes);
  // [num_blocks, tokens_per_block, ...]: one page per block (MLA latents, or K/V mixed per token).
  static KvPageTensor SinglePage(void* base, uint64_t num_blocks, uint32_t tokens_per_block,
                                 uint64_t token_bytes);
  // [num_blocks, num_layers, 2, tokens_per_block, ...]: every layer's K and V in one block.
  static KvPageTensor CrossLayer(void* base, uint64_t num_blocks, uint32_t num_layers,
                                 uint32_t tokens_per_block, uint64_t token_bytes);
};

struct PagedKvCacheDesc {
  MemorySpace memory = MemorySpace::kCuda;
  int device = 0;                 // CUDA device ordinal when memory == kCuda
  uint32_t tokens_per_block = 0;  // tokens in every block of every tensor
  std::vector<KvPageTensor> tensors;
};

// One stream of the canonical layout: the pages of one (tensor, layer, component).
struct KvPageStream {
  char* first_page;       // page of block 0
  uint64_t block_stride;  // bytes from block b to b + 1
  uint64_t page_bytes;    // tokens_per_block x token_bytes
  uint64_t token_bytes;
  uint64_t prefix_token_bytes;  // sum of token_bytes over earlier streams
};

// A validated description of a paged cache. Create() checks it once; copies then only check the
// block ids of each request.
class PagedKvCache {
 public:
  // Fails (InvalidArgument, with the tensor index in the message) on: no tensors, a zero
  // tokens_per_block, a null base, zero sizes, more than 2^31 blocks, pages of one tensor that
  // overlap each other (within a block or across blocks), tensors whose address ranges overlap.
  static Result<PagedKvCache> Create(PagedKvCacheDesc desc);

  const PagedKvCacheDesc& desc() const { return desc_; }
  MemorySpace memory() const { return desc_.memory; }
  uint32_t tokens_per_block() const { return desc_.tokens_per_block; }
  // Valid block ids are [0, num_blocks()): the smallest num_blocks over the tensors.
  uint64_t num_blocks() const { return num_blocks_; }
  uint64_t bytes_per_token() const { return bytes_per_token_; }
  uint64_t chunk_bytes(uint64_t num_tokens) const { return num_tokens * bytes_per_token_; }
  const std::vector<KvPageStream>& streams() const { return streams_; }
  // Smallest and largest page (one stream, one block) in bytes.
  uint64_t min_page_bytes() const { return min_page_bytes_; }
  uint64_t max_page_bytes() const { return max_page_bytes_; }
  // True when every page address and page size is a multiple of `alignment` (a power of two).
  bool PagesAligned(uint64_t alignment) const;

  // Checks one chunk request: `num_tokens` a positive multiple of tokens_per_block (a partial last
  // block is refused), exactly num_tokens / tokens_per_block ids, each in [0, num_blocks()).
  // Duplicate ids are allowed for gathers; `for_scatter` refuses them (two chunk parts would race
  // for one page) and accepts kSkipBlock.
  Status CheckRequest(std::span<const int64_t> block_ids, uint64_t num_tokens,
                      bool for_scatter) const;

  // Offset in the chunk of page (stream s, j-th block of the chunk) for a chunk of `chunk_blocks`
  // blocks.
  uint64_t ChunkOffset(size_t stream, uint64_t chunk_blocks, uint64_t j) const {
    const KvPageStream& st = streams_[stream];
    return chunk_blocks * desc_.tokens_per_block * st.prefix_token_bytes + j * st.page_bytes;
  }
  // Address of page (stream s, block id).
  char* PageAddress(size_t stream, int64_t block_id) const {
    const KvPageStream& st = streams_[stream];
    return st.first_page + static_cast<uint64_t>(block_id) * st.block_stride;
  }

  // e.g. "cuda:0, 36 tensors, 72 page streams, 16 tokens/block, 147456 B/token, pages 32768 B".
  std::string ToString() const;

 private:
  PagedKvCache() = default;
  PagedKvCacheDesc desc_;
  std::vector<KvPageStream> streams_;
  uint64_t num_blocks_ = 0;
  uint64_t bytes_per_token_ = 0;
  uint64_t min_page_bytes_ = 0;
  uint64_t max_page_bytes_ = 0;
};

// A scatter's block id that leaves its part of the chunk uncopied: for a chunk whose leading
// blocks the engine already holds (e.g. from its own prefix cache, possibly shared with running
// requests, so they must not be rewritten).
inline constexpr int64_t kSkipBlock = -1;

// How a copy is carried out.
enum class CopyMechanism : uint8_t {
  kAuto,        // the copier chooses (see KvCopier::ChooseMechanism)
  kHostMemcpy,  // memcpy on the calling thread (host caches)
  kCopyEngine,  // batched DMA on the GPU's copy engines (cudaMemcpyBatchAsync), one per page
  kSmKernel,    // a GPU kernel reading/writing mapped pinned host memory (zero-copy)
  kStaged,      // the SM kernel gathers into (scatters from) a device staging buffer, and the
                // copy engines move the staged piece in one large DMA, pipelined
};
std::string_view CopyMechanismName(CopyMechanism mechanism);
// "auto", "memcpy", "dma" / "copy-engine", "kernel" / "sm-kernel", "staged".
Result<CopyMechanism> ParseCopyMechanism(std::string_view name);

struct CopyOptions {
  // cudaStream_t to issue the copy on; nullptr = the copier's own stream for this direction
  // (non-blocking streams created by the copier). Never the legacy default stream.
  void* stream = nullptr;
  // cudaEvent_t that the copy waits for before touching any memory, e.g. recorded on the compute
  // stream after the kernels that wrote the blocks (gather) or that last read them (scatter).
  // The wait is stream-side: the caller's thread and streams are never blocked.
  void* wait_event = nullptr;
  CopyMechanism mechanism = CopyMechanism::kAuto;
};

// The result of starting a copy: poll it, wait on it, or hand its event to another stream.
// Destroying a handle does not cancel or wait for the copy; the chunk and the blocks must stay
// valid until the copy completes.
class CopyHandle {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual bool IsDone() = 0;
    virtual Status Wait() = 0;
    virtual void* event() = 0;
  };

  CopyHandle() = default;  // a completed copy
  CopyHandle(std::shared_ptr<Impl> impl, CopyMechanism mechanism)
      : impl_(std::move(impl)), mechanism_(mechanism) {}

  // Non-blocking: true once the copy has completed (or failed; Wait() then says how).
  bool IsDone() { return impl_ == nullptr || impl_->IsDone(); }
  // Blocks the calling thread until the copy completes. Fails (Internal) if the device reported
  // an error for it.
  Status Wait() { return impl_ ? impl_->Wait() : Status::Ok(); }
  // A cudaEvent_t that completes with the copy, for cudaStreamWaitEvent on a compute stream
  // (e.g. before attention reads scattered blocks). Valid while this handle lives. nullptr for
  // host copies, which are complete when Gather/Scatter returns.
  void* event() { return impl_ ? impl_->event() : nullptr; }
  // The mechanism that carried the copy out.
  CopyMechanism mechanism() const { return mechanism_; }

 private:
  std::shared_ptr<Impl> impl_;
  CopyMechanism mechanism_ = CopyMechanism::kHostMemcpy;
};

// One chunk of a batched copy (KvCopier::GatherChunks / ScatterChunks).
struct ChunkCopy {
  std::span<const int64_t> block_ids;  // the chunk's blocks in token order
  void* chunk = nullptr;               // host buffer
  uint64_t chunk_bytes = 0;            // capacity for a gather, exact size for a scatter
};

// Moves chunks between a paged KV cache and host memory in the canonical layout.
class KvCopier {
 public:
  virtual ~KvCopier() = default;

  const PagedKvCache& cache() const { return cache_; }

  // Gathers blocks `block_ids` (in token order) into `chunk`, which must hold at least
  // cache().chunk_bytes(num_tokens) bytes. For GPU caches `chunk` must be pinned host memory
  // (cudaHostAlloc or cudaHostRegister), 16-byte aligned for kSmKernel. Returns once the copy is
  // queued (GPU) or done (host); the handle says when it completes. Fails without copying on a
  // bad request (see PagedKvCache::CheckRequest), an unusable chunk buffer or a mechanism that
  // cannot serve this cache (InvalidArgument), or a CUDA error (Internal).
  virtual Result<CopyHandle> Gather(std::span<const int64_t> block_ids, uint64_t num_tokens,
                                    void* chunk, uint64_t chunk_capacity,
                                    const CopyOptions& options = {}) = 0;
  // Scatters `chunk` (exactly cache().chunk_bytes(num_tokens) bytes) into blocks `block_ids`.
  // Same rules as Gather; duplicate block ids are refused; a kSkipBlock id copies nothing for its
  // block (a CUDA copier then uses the copy engines).
  virtual Result<CopyHandle> Scatter(std::span<const int64_t> block_ids, uint64_t num_tokens,
                                     const void* chunk, uint64_t chunk_bytes,
                                     const CopyOptions& options = {}) = 0;

  // Many chunks of `num_tokens` tokens each, in order, in one call: what a layer-by-layer load
  // issues for each layer (one chunk per 256 tokens of a prefix). Every chunk is checked as by
  // Gather/Scatter before anything is queued (a refusal names the chunk's index); the handle
  // completes with the last copy. The CUDA copier puts the copy-engine work of all chunks into one
  // batch, so the cost per call, not per chunk, is what the caller pays on the host.
  virtual Result<CopyHandle> GatherChunks(std::span<const ChunkCopy> chunks, uint64_t num_tokens,
                                          const CopyOptions& options = {});
  virtual Result<CopyHandle> ScatterChunks(std::span<const ChunkCopy> chunks, uint64_t num_tokens,
                                           const CopyOptions& options = {});

  // The mechanism kAuto resolves to for this cache.
  virtual CopyMechanism AutoMechanism() const = 0;

 protected:
  explicit KvCopier(PagedKvCache cache) : cache_(std::move(cache)) {}
  // Checks every chunk of a batch: its block ids (CheckRequest), a non-null buffer, its size.
  Status CheckChunks(std::span<const ChunkCopy> chunks, uint64_t num_tokens, bool gather) const;
  PagedKvCache cache_;
};

// memcpy copier for caches in host memory (MemorySpace::kHost). Synchronous: handles are
// complete on return. Accepts kAuto and kHostMemcpy.
Result<std::unique_ptr<KvCopier>> NewHostKvCopier(PagedKvCache cache);

struct CudaCopierOptions {
  // kAuto uses the copy engines when every page is at least this large; below it, kStaged (or
  // the zero-copy kernel when staging is disabled); and the copy engines whenever pages or the
  // chunk are not 16-byte aligned. On an H200 (PCIe 5), batched DMA of 64 KiB pages reaches the
  // cudaMemcpy peak in each direction and both at once, 32 KiB pages do not when both directions
  // run (docs/gpu-data-path.md).
  uint64_t dma_min_page_bytes = 64 * 1024;
  // Device staging for kStaged: `staging_slots` buffers of `staging_slot_bytes` per direction,
  // allocated on first use (default 2 x 32 MiB x 2 directions = 128 MiB). A chunk larger than a
  // slot moves in several pieces; 0 disables kStaged.
  uint64_t staging_slot_bytes = uint64_t{32} << 20;
  int staging_slots = 2;
  // Thread blocks of the SM copy kernel (0: one per SM) and threads per block.
  int kernel_blocks = 0;
  int kernel_threads = 512;
  // Pass cudaMemcpyFlagPreferOverlapWithCompute to batched copies.
  bool dma_prefer_overlap = true;
  // Merge pages that are adjacent both in the cache and in the chunk into one DMA segment.
  bool dma_merge_adjacent = true;
};

// CUDA copier for caches in device memory (MemorySpace::kCuda). Checks that every tensor's first
// and last byte are device memory of desc().device. Unimplemented when kvtier was built without
// CUDA; Unavailable when no usable device is present.
Result<std::unique_ptr<KvCopier>> NewCudaKvCopier(PagedKvCache cache,
                                                  const CudaCopierOptions& options = {});

// True when this build contains the CUDA data path.
bool CudaDataPathBuilt();

}  // namespace kvtier
