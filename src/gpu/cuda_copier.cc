// The CUDA copier: gathers and scatters chunks between a paged KV cache in device memory and
// pinned host memory, either with batched copy-engine DMA or with an SM kernel that accesses the
// mapped host memory directly.
//
// Why several mechanisms: the copy engines reach the PCIe limit on large copies, but every page
// of a random block list is a separate DMA. Measured on an H200, batched DMA of 32 KiB pages
// still reaches ~97% of the peak in one direction but only ~73% of the two-way peak when
// gathers and scatters run together; from 64 KiB pages on it reaches the peak both ways. The
// zero-copy kernel has no per-page cost but its PCIe writes and reads top out at ~95% and ~92%
// of the one-way peak and interfere when both run (~68% two-way). Staging keeps the best of
// both: the kernel gathers pages at HBM speed into a device buffer and the copy engines move
// that buffer in one large DMA, overlapped with the next piece's kernel. kAuto picks DMA for
// large pages and staging for small ones (CudaCopierOptions::dma_min_page_bytes).
//
// Streams: every copy goes on a caller-given stream or on one of the copier's own non-blocking
// streams, waits for the caller's event stream-side, and ends with an event. Nothing here
// synchronizes a stream the caller owns.
#include "gpu/cuda_copier.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "gpu/copy_plan.h"
#include "gpu/page_copy_kernel.h"
#include "kvtier/paged_kv.h"

namespace kvtier {
namespace gpu {
namespace {

constexpr uint64_t kKernelAlignment = 16;
// cudaMemcpyBatchAsync calls are split into batches of at most this many copies.
constexpr size_t kMaxBatch = 4096;

Status CudaError(cudaError_t err, std::string_view what) {
  return Status::Internal(
      fmt::format("{}: {} ({})", what, cudaGetErrorString(err), cudaGetErrorName(err)));
}

#define KVTIER_CUDA_RETURN(expr, what)                                   \
  do {                                                                   \
    cudaError_t kvtier_err_ = (expr);                                    \
    if (kvtier_err_ != cudaSuccess) return CudaError(kvtier_err_, what); \
  } while (0)

// Makes `device` current for the scope and restores the caller's device afterwards, so that a
// copier never changes which device the calling thread works on. cudaSetDevice runs even when
// cudaGetDevice already names `device`: on a thread that never used CUDA, cudaGetDevice answers 0
// with no context current, and cudaPointerGetAttributes there finds no device address for memory
// registered elsewhere in the process (by PyTorch's runtime, say): the first load on a new thread
// failed with "not mapped contiguously". cudaSetDevice binds the device's primary context.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = cudaSetDevice(device);
    if (previous_ == device) previous_ = -1;  // nothing to restore
  }
  ~DeviceScope() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

// Events are reused: creating one per copy would cost more than a small copy's issue time.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  ~EventPool() {
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
  }
  Result<cudaEvent_t> Take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    KVTIER_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    return e;
  }
  void Give(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(e);
  }

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

class CudaHandle final : public CopyHandle::Impl {
 public:
  CudaHandle(std::shared_ptr<EventPool> pool, cudaEvent_t event)
      : pool_(std::move(pool)), event_(event) {}
  ~CudaHandle() override { pool_->Give(event_); }
  bool IsDone() override { return cudaEventQuery(event_) != cudaErrorNotReady; }
  Status Wait() override {
    KVTIER_CUDA_RETURN(cudaEventSynchronize(event_), "waiting for a KV copy");
    return Status::Ok();
  }
  void* event() override { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t event_;
};

// The device-side address of a pinned host buffer, or why there is none.
Result<char*> MappedHostAddress(const void* ptr, uint64_t bytes, int device) {
  cudaPointerAttributes first{}, last{};
  KVTIER_CUDA_RETURN(cudaPointerGetAttributes(&first, ptr), "cudaPointerGetAttributes(chunk)");
  const char* end = static_cast<const char*>(ptr) + bytes - 1;
  KVTIER_CUDA_RETURN(cudaPointerGetAttributes(&last, end), "cudaPointerGetAttributes(chunk end)");
  if (first.type != cudaMemoryTypeHost || last.type != cudaMemoryTypeHost) {
    return Status::InvalidArgument(
        "chunk buffer is not pinned host memory (allocate it with cudaHostAlloc or register it "
        "with cudaHostRegister)");
  }
  if (first.devicePointer == nullptr || last.devicePointer == nullptr ||
      static_cast<char*>(last.devicePointer) - static_cast<char*>(first.devicePointer) !=
          static_cast<ptrdiff_t>(bytes - 1)) {
    return Status::InvalidArgument(
        fmt::format("chunk buffer is not mapped contiguously into device {}'s address space (one "
                    "registration must cover it; device addresses of its first and last byte: "
                    "{}, {})",
                    device, static_cast<const void*>(first.devicePointer),
                    static_cast<const void*>(last.devicePointer)));
  }
  return static_cast<char*>(first.devicePointer);
}

class CudaKvCopier final : public KvCopier {
 public:
  static Result<std::unique_ptr<CudaKvCopier>> Create(PagedKvCache cache,
                                                      const CudaCopierOptions& options) {
    std::unique_ptr<CudaKvCopier> c(new CudaKvCopier(std::move(cache), options));
    KVTIER_RETURN_IF_ERROR(c->Init());
    return c;
  }

  ~CudaKvCopier() override {
    DeviceScope scope(device_);
    for (cudaStream_t s : {gather_stream_, scatter_stream_}) {
      if (s != nullptr) {
        (void)cudaStreamSynchronize(s);
        (void)cudaStreamDestroy(s);
      }
    }
    for (StagingLane& lane : lanes_) lane.Release();
    if (device_streams_ != nullptr) (void)cudaFree(device_streams_);
  }

  Result<CopyHandle> Gather(std::span<const int64_t> block_ids, uint64_t num_tokens, void* chunk,
                            uint64_t chunk_capacity, const CopyOptions& options) override {
    if (chunk_capacity < cache_.chunk_bytes(num_tokens)) {
      return Status::InvalidArgument(fmt::format("chunk buffer of {} bytes, {} needed",
                                                 chunk_capacity, cache_.chunk_bytes(num_tokens)));
    }
    return Copy(block_ids, num_tokens, chunk, options, /*gather=*/true);
  }

  Result<CopyHandle> Scatter(std::span<const int64_t> block_ids, uint64_t num_tokens,
                             const void* chunk, uint64_t chunk_bytes,
                             const CopyOptions& options) override {
    if (chunk_bytes != cache_.chunk_bytes(num_tokens)) {
      return Status::InvalidArgument(fmt::format("scatter: chunk is {} bytes, expected {}",
                                                 chunk_bytes, cache_.chunk_bytes(num_tokens)));
    }
    return Copy(block_ids, num_tokens, const_cast<void*>(chunk), options, /*gather=*/false);
  }

  Result<CopyHandle> GatherChunks(std::span<const ChunkCopy> chunks, uint64_t num_tokens,
                                  const CopyOptions& options) override {
    return CopyChunks(chunks, num_tokens, options, /*gather=*/true);
  }

  Result<CopyHandle> ScatterChunks(std::span<const ChunkCopy> chunks, uint64_t num_tokens,
                                   const CopyOptions& options) override {
    return CopyChunks(chunks, num_tokens, options, /*gather=*/false);
  }

  CopyMechanism AutoMechanism() const override {
    if (!kernel_usable_) return CopyMechanism::kCopyEngine;
    if (cache_.min_page_bytes() >= options_.dma_min_page_bytes) return CopyMechanism::kCopyEngine;
    return StagingEnabled() ? CopyMechanism::kStaged : CopyMechanism::kSmKernel;
  }

 private:
  CudaKvCopier(PagedKvCache cache, const CudaCopierOptions& options)
      : KvCopier(std::move(cache)),
        options_(options),
        device_(cache_.desc().device),
        events_(std::make_shared<EventPool>()) {}

  Status Init() {
    if (cache_.memory() != MemorySpace::kCuda) {
      return Status::InvalidArgument(fmt::format("CUDA copier needs a cache in CUDA memory, not {}",
                                                 MemorySpaceName(cache_.memory())));
    }
    if (options_.kernel_threads <= 0 || options_.kernel_threads > 1024 ||
        options_.kernel_threads % 32 != 0) {
      return Status::InvalidArgument(fmt::format(
          "kernel_threads {} must be a multiple of 32 in [32, 1024]", options_.kernel_threads));
    }
    if (options_.kernel_blocks < 0) return Status::InvalidArgument("kernel_blocks < 0");
    if (options_.staging_slots < 0 || (options_.staging_slot_bytes % kKernelAlignment) != 0) {
      return Status::InvalidArgument(
          "staging_slots must be >= 0 and staging_slot_bytes a multiple of 16");
    }
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      return Status::Unavailable(fmt::format(
          "no CUDA device: {}", err == cudaSuccess ? "none found" : cudaGetErrorString(err)));
    }
    if (device_ >= count) {
      return Status::InvalidArgument(
          fmt::format("CUDA device {} requested, {} present", device_, count));
    }
    DeviceScope scope(device_);
    KVTIER_CUDA_RETURN(scope.status(), "cudaSetDevice");
    int sms = 0;
    KVTIER_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_),
                       "cudaDeviceGetAttribute");
    grid_blocks_ = options_.kernel_blocks > 0 ? options_.kernel_blocks : sms;

    // Every tensor's first and last byte must be memory of this device.
    for (size_t i = 0; i < cache_.desc().tensors.size(); ++i) {
      const KvPageTensor& t = cache_.desc().tensors[i];
      uint64_t last_offset = (t.num_blocks - 1) * t.block_stride_bytes +
                             uint64_t{t.num_layers - 1} * t.layer_stride_bytes +
                             uint64_t{t.num_components - 1} * t.component_stride_bytes +
                             uint64_t{cache_.tokens_per_block()} * t.token_bytes - 1;
      for (const char* p :
           {static_cast<const char*>(t.base), static_cast<const char*>(t.base) + last_offset}) {
        cudaPointerAttributes attr{};
        KVTIER_CUDA_RETURN(cudaPointerGetAttributes(&attr, p), "cudaPointerGetAttributes");
        if (attr.type != cudaMemoryTypeDevice || attr.device != device_) {
          return Status::InvalidArgument(
              fmt::format("paged KV tensor {}: {} is not memory of CUDA device {}", i,
                          p == t.base ? "base" : "last byte", device_));
        }
      }
    }

    for (cudaStream_t* s : {&gather_stream_, &scatter_stream_}) {
      KVTIER_CUDA_RETURN(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking), "cudaStreamCreate");
    }

    kernel_usable_ = cache_.PagesAligned(kKernelAlignment);
    std::vector<DevicePageStream> host_streams;
    for (const KvPageStream& s : cache_.streams()) {
      host_streams.push_back({s.first_page, s.block_stride, s.page_bytes, s.prefix_token_bytes});
    }
    const size_t table_bytes = host_streams.size() * sizeof(DevicePageStream);
    KVTIER_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&device_streams_), table_bytes),
                       "cudaMalloc(stream table)");
    KVTIER_CUDA_RETURN(cudaMemcpyAsync(device_streams_, host_streams.data(), table_bytes,
                                       cudaMemcpyHostToDevice, gather_stream_),
                       "uploading the stream table");
    KVTIER_CUDA_RETURN(cudaStreamSynchronize(gather_stream_), "uploading the stream table");
    return Status::Ok();
  }

  Status KernelUnusable() const {
    return Status::InvalidArgument(
        "SM copy kernel needs every page address and page size 16-byte aligned; this cache's "
        "are not (use the copy engines)");
  }

  Result<CopyHandle> Copy(std::span<const int64_t> block_ids, uint64_t num_tokens, void* chunk,
                          const CopyOptions& options, bool gather) {
    CopyMechanism mechanism = options.mechanism;
    // Skipped blocks are served by the segment plan only; the kernels take every block.
    const bool skips =
        !gather && std::find(block_ids.begin(), block_ids.end(), kSkipBlock) != block_ids.end();
    if (skips && mechanism == CopyMechanism::kAuto) mechanism = CopyMechanism::kCopyEngine;
    if (skips && mechanism != CopyMechanism::kCopyEngine) {
      return Status::InvalidArgument("a scatter with skipped blocks needs the copy engines");
    }
    if (mechanism == CopyMechanism::kAuto) {
      mechanism = AutoMechanism();
      if (mechanism == CopyMechanism::kSmKernel &&
          reinterpret_cast<uintptr_t>(chunk) % kKernelAlignment != 0) {
        mechanism = CopyMechanism::kCopyEngine;
      }
    }
    if (mechanism == CopyMechanism::kHostMemcpy) {
      return Status::InvalidArgument("CUDA copier cannot use mechanism 'memcpy'");
    }
    KVTIER_RETURN_IF_ERROR(cache_.CheckRequest(block_ids, num_tokens, !gather));
    if (chunk == nullptr) return Status::InvalidArgument("null chunk buffer");
    const uint64_t bytes = cache_.chunk_bytes(num_tokens);
    if (mechanism == CopyMechanism::kSmKernel || mechanism == CopyMechanism::kStaged) {
      if (!kernel_usable_) return KernelUnusable();
    }
    if (mechanism == CopyMechanism::kSmKernel &&
        reinterpret_cast<uintptr_t>(chunk) % kKernelAlignment != 0) {
      return Status::InvalidArgument("SM copy kernel needs a 16-byte aligned chunk buffer");
    }
    if (mechanism == CopyMechanism::kStaged && !StagingEnabled()) {
      return Status::InvalidArgument(
          "staged copies are disabled (staging_slot_bytes or "
          "staging_slots is 0)");
    }

    DeviceScope scope(device_);
    KVTIER_CUDA_RETURN(scope.status(), "cudaSetDevice");
    KVTIER_ASSIGN_OR_RETURN(char* mapped, MappedHostAddress(chunk, bytes, device_));
    cudaStream_t stream = options.stream != nullptr ? static_cast<cudaStream_t>(options.stream)
                                                    : (gather ? gather_stream_ : scatter_stream_);
    if (options.wait_event != nullptr) {
      KVTIER_CUDA_RETURN(
          cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(options.wait_event), 0),
          "cudaStreamWaitEvent");
    }
    if (mechanism == CopyMechanism::kSmKernel) {
      KVTIER_RETURN_IF_ERROR(LaunchKernel(block_ids, mapped, 0, 0, cache_.streams().size(), 0,
                                          block_ids.size(), gather, stream));
    } else if (mechanism == CopyMechanism::kStaged) {
      KVTIER_RETURN_IF_ERROR(Staged(block_ids, static_cast<char*>(chunk), gather, stream));
    } else {
      KVTIER_RETURN_IF_ERROR(BatchedDma(block_ids, static_cast<char*>(chunk), gather, stream));
    }
    KVTIER_ASSIGN_OR_RETURN(cudaEvent_t event, events_->Take());
    CopyHandle handle(std::make_shared<CudaHandle>(events_, event), mechanism);
    KVTIER_CUDA_RETURN(cudaEventRecord(event, stream), "cudaEventRecord");
    return handle;
  }

  // A batch on the copy engines is one sequence of cudaMemcpyBatchAsync calls for every chunk's
  // segments; the kernel mechanisms go chunk by chunk (KvCopier's generic batch).
  Result<CopyHandle> CopyChunks(std::span<const ChunkCopy> chunks, uint64_t num_tokens,
                                const CopyOptions& options, bool gather) {
    CopyMechanism mechanism =
        options.mechanism == CopyMechanism::kAuto ? AutoMechanism() : options.mechanism;
    if (!gather && options.mechanism == CopyMechanism::kAuto) {
      for (const ChunkCopy& c : chunks) {
        if (std::find(c.block_ids.begin(), c.block_ids.end(), kSkipBlock) != c.block_ids.end()) {
          mechanism = CopyMechanism::kCopyEngine;
        }
      }
    }
    if (mechanism != CopyMechanism::kCopyEngine) {
      return gather ? KvCopier::GatherChunks(chunks, num_tokens, options)
                    : KvCopier::ScatterChunks(chunks, num_tokens, options);
    }
    KVTIER_RETURN_IF_ERROR(CheckChunks(chunks, num_tokens, gather));
    if (chunks.empty()) return CopyHandle();
    DeviceScope scope(device_);
    KVTIER_CUDA_RETURN(scope.status(), "cudaSetDevice");
    // Chunks usually lie in one registered pool: two queries for the whole span instead of two
    // per chunk (a few microseconds each, paid once per chunk and layer by a layer-wise load).
    const uint64_t bytes = cache_.chunk_bytes(num_tokens);
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (const ChunkCopy& c : chunks) {
      lo = std::min(lo, reinterpret_cast<uintptr_t>(c.chunk));
      hi = std::max(hi, reinterpret_cast<uintptr_t>(c.chunk) + bytes);
    }
    if (!MappedHostAddress(reinterpret_cast<void*>(lo), hi - lo, device_).ok()) {
      for (size_t i = 0; i < chunks.size(); ++i) {
        Result<char*> mapped = MappedHostAddress(chunks[i].chunk, bytes, device_);
        if (!mapped.ok()) {
          return mapped.status().WithContext(fmt::format("chunk {} of {}", i, chunks.size()));
        }
      }
    }
    cudaStream_t stream = options.stream != nullptr ? static_cast<cudaStream_t>(options.stream)
                                                    : (gather ? gather_stream_ : scatter_stream_);
    if (options.wait_event != nullptr) {
      KVTIER_CUDA_RETURN(
          cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(options.wait_event), 0),
          "cudaStreamWaitEvent");
    }
    KVTIER_RETURN_IF_ERROR(BatchedDma(chunks, gather, stream));
    KVTIER_ASSIGN_OR_RETURN(cudaEvent_t event, events_->Take());
    CopyHandle handle(std::make_shared<CudaHandle>(events_, event), CopyMechanism::kCopyEngine);
    KVTIER_CUDA_RETURN(cudaEventRecord(event, stream), "cudaEventRecord");
    return handle;
  }

  // Kernel copy of pages (stream s, block j), s in [s0, s1), j in [j0, j1), to or from `chunk`,
  // the device-accessible address of canonical chunk offset `chunk_offset_base`.
  Status LaunchKernel(std::span<const int64_t> block_ids, char* chunk, uint64_t chunk_offset_base,
                      size_t s0, size_t s1, size_t j0, size_t j1, bool gather,
                      cudaStream_t stream) {
    // A few kilobytes: on the heap rather than on the caller's stack.
    auto launch = std::make_unique<PageCopyLaunch>();
    launch->streams = device_streams_ + s0;
    launch->num_streams = static_cast<uint32_t>(s1 - s0);
    launch->chunk = chunk;
    launch->chunk_offset_base = chunk_offset_base;
    launch->chunk_blocks = block_ids.size();
    launch->tokens_per_block = cache_.tokens_per_block();
    for (size_t b = j0; b < j1; b += kMaxBlocksPerLaunch) {
      const size_t n = std::min<size_t>(kMaxBlocksPerLaunch, j1 - b);
      launch->first_block = static_cast<uint32_t>(b);
      launch->count = static_cast<uint32_t>(n);
      for (size_t j = 0; j < n; ++j) {
        launch->block_ids[j] = static_cast<uint32_t>(block_ids[b + j]);
      }
      KVTIER_CUDA_RETURN(LaunchPageCopy(*launch, gather, cache_.max_page_bytes(), grid_blocks_,
                                        options_.kernel_threads, stream),
                         "launching the page copy kernel");
    }
    return Status::Ok();
  }

  bool StagingEnabled() const {
    return options_.staging_slot_bytes > 0 && options_.staging_slots > 0;
  }

  // One contiguous piece of the chunk that fits a staging slot: whole streams [s0, s1), or
  // blocks [j0, j1) of one stream too large for a slot.
  struct Piece {
    size_t s0, s1, j0, j1;
    uint64_t offset, bytes;
  };

  Result<std::vector<Piece>> PlanPieces(uint64_t nblk) const {
    std::vector<Piece> pieces;
    const uint64_t slot = options_.staging_slot_bytes;
    const auto& streams = cache_.streams();
    size_t s = 0;
    while (s < streams.size()) {
      const uint64_t page = streams[s].page_bytes;
      if (nblk * page > slot) {
        const uint64_t per = slot / page;
        if (per == 0) {
          return Status::InvalidArgument(fmt::format(
              "staging slot of {} bytes is smaller than one page ({} bytes)", slot, page));
        }
        for (uint64_t j0 = 0; j0 < nblk; j0 += per) {
          const uint64_t j1 = std::min(nblk, j0 + per);
          pieces.push_back({s, s + 1, j0, j1, cache_.ChunkOffset(s, nblk, j0), (j1 - j0) * page});
        }
        ++s;
        continue;
      }
      Piece p{s, s, 0, nblk, cache_.ChunkOffset(s, nblk, 0), 0};
      while (p.s1 < streams.size() && p.bytes + nblk * streams[p.s1].page_bytes <= slot) {
        p.bytes += nblk * streams[p.s1].page_bytes;
        ++p.s1;
      }
      pieces.push_back(p);
      s = p.s1;
    }
    return pieces;
  }

  // Staged copy, issued on the direction's lane: a kernel stream and a DMA stream ping-ponging
  // over the lane's slots, so piece i's DMA overlaps piece i+1's kernel. Each slot carries two
  // events (filled, free) that order its producer and consumer on the GPU; the lane's mutex
  // keeps the enqueue of one copy in one piece, which is what makes reusing those events safe.
  // `stream` (the caller's) waits for the lane's last operation, and the lane waits for
  // everything queued on `stream` before the copy.
  Status Staged(std::span<const int64_t> block_ids, char* host_chunk, bool gather,
                cudaStream_t stream) {
    KVTIER_ASSIGN_OR_RETURN(std::vector<Piece> pieces, PlanPieces(block_ids.size()));
    StagingLane& lane = lanes_[gather ? 0 : 1];
    std::lock_guard<std::mutex> lock(lane.mu);
    KVTIER_RETURN_IF_ERROR(lane.Init(options_.staging_slots, options_.staging_slot_bytes));
    KVTIER_CUDA_RETURN(cudaEventRecord(lane.start, stream), "cudaEventRecord");
    KVTIER_CUDA_RETURN(cudaStreamWaitEvent(lane.kernel_stream, lane.start, 0), "wait");
    KVTIER_CUDA_RETURN(cudaStreamWaitEvent(lane.dma_stream, lane.start, 0), "wait");
    for (const Piece& p : pieces) {
      StagingLane::Slot& slot = lane.slots[lane.next++ % lane.slots.size()];
      if (gather) {
        KVTIER_CUDA_RETURN(cudaStreamWaitEvent(lane.kernel_stream, slot.free, 0), "wait");
        KVTIER_RETURN_IF_ERROR(LaunchKernel(block_ids, slot.buffer, p.offset, p.s0, p.s1, p.j0,
                                            p.j1, true, lane.kernel_stream));
        KVTIER_CUDA_RETURN(cudaEventRecord(slot.filled, lane.kernel_stream), "cudaEventRecord");
        KVTIER_CUDA_RETURN(cudaStreamWaitEvent(lane.dma_stream, slot.filled, 0), "wait");
        KVTIER_CUDA_RETURN(cudaMemcpyAsync(host_chunk + p.offset, slot.buffer, p.bytes,
                                           cudaMemcpyDeviceToHost, lane.dma_stream),
                           "cudaMemcpyAsync(staging -> chunk)");
        KVTIER_CUDA_RETURN(cudaEventRecord(slot.free, lane.dma_stream), "cudaEventRecord");
      } else {
        KVTIER_CUDA_RETURN(cudaStreamWaitEvent(lane.dma_stream, slot.free, 0), "wait");
        KVTIER_CUDA_RETURN(cudaMemcpyAsync(slot.buffer, host_chunk + p.offset, p.bytes,
                                           cudaMemcpyHostToDevice, lane.dma_stream),
                           "cudaMemcpyAsync(chunk -> staging)");
        KVTIER_CUDA_RETURN(cudaEventRecord(slot.filled, lane.dma_stream), "cudaEventRecord");
        KVTIER_CUDA_RETURN(cudaStreamWaitEvent(lane.kernel_stream, slot.filled, 0), "wait");
        KVTIER_RETURN_IF_ERROR(LaunchKernel(block_ids, slot.buffer, p.offset, p.s0, p.s1, p.j0,
                                            p.j1, false, lane.kernel_stream));
        KVTIER_CUDA_RETURN(cudaEventRecord(slot.free, lane.kernel_stream), "cudaEventRecord");
      }
    }
    // The last stream of the pipeline has waited, piece by piece, for the other one.
    cudaStream_t last = gather ? lane.dma_stream : lane.kernel_stream;
    KVTIER_CUDA_RETURN(cudaEventRecord(lane.end, last), "cudaEventRecord");
    KVTIER_CUDA_RETURN(cudaStreamWaitEvent(stream, lane.end, 0), "cudaStreamWaitEvent");
    return Status::Ok();
  }

  Status BatchedDma(std::span<const int64_t> block_ids, char* chunk, bool gather,
                    cudaStream_t stream) {
    const ChunkCopy one{block_ids, chunk, 0};
    return BatchedDma(std::span(&one, 1), gather, stream);
  }

  Status BatchedDma(std::span<const ChunkCopy> chunks, bool gather, cudaStream_t stream) {
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    for (const ChunkCopy& c : chunks) {
      for (const CopySegment& seg :
           PlanSegments(cache_, c.block_ids, options_.dma_merge_adjacent)) {
        char* host = static_cast<char*>(c.chunk) + seg.chunk_offset;
        dsts.push_back(gather ? static_cast<void*>(host) : static_cast<void*>(seg.page));
        srcs.push_back(gather ? static_cast<const void*>(seg.page) : host);
        sizes.push_back(seg.bytes);
      }
    }
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = options_.dma_prefer_overlap ? cudaMemcpyFlagPreferOverlapWithCompute
                                             : cudaMemcpyFlagDefault;
    size_t attr_index = 0;
    for (size_t i = 0; i < sizes.size(); i += kMaxBatch) {
      const size_t n = std::min(kMaxBatch, sizes.size() - i);
      KVTIER_CUDA_RETURN(cudaMemcpyBatchAsync(dsts.data() + i, srcs.data() + i, sizes.data() + i, n,
                                              &attr, &attr_index, 1, stream),
                         "cudaMemcpyBatchAsync");
    }
    return Status::Ok();
  }

  // Staging buffers, streams and events of one direction, created on first staged copy.
  struct StagingLane {
    struct Slot {
      char* buffer = nullptr;
      cudaEvent_t filled = nullptr, free = nullptr;
    };
    std::mutex mu;
    bool ready = false;
    cudaStream_t kernel_stream = nullptr, dma_stream = nullptr;
    cudaEvent_t start = nullptr, end = nullptr;
    std::vector<Slot> slots;
    uint64_t next = 0;

    // REQUIRES: mu held.
    Status Init(int num_slots, uint64_t slot_bytes) {
      if (ready) return Status::Ok();
      // Idempotent: after a failure (out of memory, say) the next call completes what is
      // missing, and Release() frees whatever exists.
      for (cudaStream_t* s : {&kernel_stream, &dma_stream}) {
        if (*s == nullptr) {
          KVTIER_CUDA_RETURN(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking),
                             "cudaStreamCreate");
        }
      }
      for (cudaEvent_t* e : {&start, &end}) {
        if (*e == nullptr) {
          KVTIER_CUDA_RETURN(cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                             "cudaEventCreate");
        }
      }
      if (slots.empty()) slots.resize(num_slots);
      for (Slot& slot : slots) {
        if (slot.buffer == nullptr) {
          KVTIER_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&slot.buffer), slot_bytes),
                             fmt::format("allocating a {} MiB staging buffer", slot_bytes >> 20));
        }
        for (cudaEvent_t* e : {&slot.filled, &slot.free}) {
          if (*e == nullptr) {
            KVTIER_CUDA_RETURN(cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                               "cudaEventCreate");
          }
        }
      }
      ready = true;
      return Status::Ok();
    }
    void Release() {
      for (cudaStream_t s : {kernel_stream, dma_stream}) {
        if (s != nullptr) {
          (void)cudaStreamSynchronize(s);
          (void)cudaStreamDestroy(s);
        }
      }
      for (Slot& slot : slots) {
        if (slot.buffer != nullptr) (void)cudaFree(slot.buffer);
        for (cudaEvent_t e : {slot.filled, slot.free}) {
          if (e != nullptr) (void)cudaEventDestroy(e);
        }
      }
      for (cudaEvent_t e : {start, end}) {
        if (e != nullptr) (void)cudaEventDestroy(e);
      }
    }
  };

  CudaCopierOptions options_;
  int device_;
  StagingLane lanes_[2];  // [0] gathers, [1] scatters
  int grid_blocks_ = 0;
  bool kernel_usable_ = false;
  std::shared_ptr<EventPool> events_;
  cudaStream_t gather_stream_ = nullptr;
  cudaStream_t scatter_stream_ = nullptr;
  DevicePageStream* device_streams_ = nullptr;
};

}  // namespace

Result<std::string> DescribeCudaDevice(int device) {
  cudaDeviceProp prop{};
  KVTIER_CUDA_RETURN(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  int driver = 0, runtime = 0;
  (void)cudaDriverGetVersion(&driver);
  (void)cudaRuntimeGetVersion(&runtime);
  return fmt::format("cuda:{} {}, {} SMs, sm_{}{}, driver {}.{}, runtime {}.{}", device, prop.name,
                     prop.multiProcessorCount, prop.major, prop.minor, driver / 1000,
                     (driver % 1000) / 10, runtime / 1000, (runtime % 1000) / 10);
}

}  // namespace gpu

Result<std::unique_ptr<KvCopier>> NewCudaKvCopier(PagedKvCache cache,
                                                  const CudaCopierOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(auto copier, gpu::CudaKvCopier::Create(std::move(cache), options));
  return std::unique_ptr<KvCopier>(std::move(copier));
}

bool CudaDataPathBuilt() { return true; }

}  // namespace kvtier
