// The CUDA copier: gathers and scatters chunks between a paged KV cache in device memory and
// pinned host memory, either with batched copy-engine DMA or with an SM kernel that accesses the
// mapped host memory directly.
//
// Why two mechanisms: the copy engines reach the PCIe limit on large copies, but every page of a
// random block list is a separate DMA, and below a few hundred KiB per copy the engines spend a
// large share of their time per copy rather than per byte. The kernel has no per-page cost
// (pages are just addresses), so it wins on small pages; it costs SM time, which the copy engines
// do not. kAuto picks by page size (CudaCopierOptions::dma_min_page_bytes).
//
// Streams: every copy goes on a caller-given stream or on one of the copier's own non-blocking
// streams, waits for the caller's event stream-side, and ends with an event. Nothing here
// synchronizes a stream the caller owns.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "gpu/copy_plan.h"
#include "gpu/cuda_copier.h"
#include "gpu/page_copy_kernel.h"
#include "kvtier/paged_kv.h"

namespace kvtier {
namespace gpu {
namespace {

constexpr uint64_t kKernelAlignment = 16;
// cudaMemcpyBatchAsync calls are split into batches of at most this many copies.
constexpr size_t kMaxBatch = 4096;

Status CudaError(cudaError_t err, std::string_view what) {
  return Status::Internal(fmt::format("{}: {} ({})", what, cudaGetErrorString(err),
                                      cudaGetErrorName(err)));
}

#define KVTIER_CUDA_RETURN(expr, what)                \
  do {                                                \
    cudaError_t kvtier_err_ = (expr);                 \
    if (kvtier_err_ != cudaSuccess) return CudaError(kvtier_err_, what); \
  } while (0)

// Makes `device` current for the scope and restores the caller's device afterwards, so that a
// copier never changes which device the calling thread works on.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = cudaSetDevice(device);
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
    return Status::InvalidArgument(fmt::format(
        "chunk buffer is not mapped contiguously into device {}'s address space (one "
        "registration must cover it)",
        device));
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

  CopyMechanism AutoMechanism() const override {
    if (!kernel_usable_) return CopyMechanism::kCopyEngine;
    return cache_.min_page_bytes() >= options_.dma_min_page_bytes ? CopyMechanism::kCopyEngine
                                                                  : CopyMechanism::kSmKernel;
  }

  Status KernelCopy(std::span<const int64_t> block_ids, uint64_t num_tokens, char* chunk,
                    bool gather, cudaStream_t stream) {
    if (!kernel_usable_) return KernelUnusable();
    KVTIER_RETURN_IF_ERROR(cache_.CheckRequest(block_ids, num_tokens, !gather));
    if (reinterpret_cast<uintptr_t>(chunk) % kKernelAlignment != 0) {
      return Status::InvalidArgument("SM copy kernel needs a 16-byte aligned chunk");
    }
    DeviceScope scope(device_);
    KVTIER_CUDA_RETURN(scope.status(), "cudaSetDevice");
    return LaunchKernel(block_ids, chunk, gather, stream);
  }

 private:
  CudaKvCopier(PagedKvCache cache, const CudaCopierOptions& options)
      : KvCopier(std::move(cache)),
        options_(options),
        device_(cache_.desc().device),
        events_(std::make_shared<EventPool>()) {}

  Status Init() {
    if (cache_.memory() != MemorySpace::kCuda) {
      return Status::InvalidArgument(
          fmt::format("CUDA copier needs a cache in CUDA memory, not {}",
                      MemorySpaceName(cache_.memory())));
    }
    if (options_.kernel_threads <= 0 || options_.kernel_threads > 1024 ||
        options_.kernel_threads % 32 != 0) {
      return Status::InvalidArgument(fmt::format(
          "kernel_threads {} must be a multiple of 32 in [32, 1024]", options_.kernel_threads));
    }
    if (options_.kernel_blocks < 0) return Status::InvalidArgument("kernel_blocks < 0");
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      return Status::Unavailable(fmt::format("no CUDA device: {}", err == cudaSuccess
                                                                       ? "none found"
                                                                       : cudaGetErrorString(err)));
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
      for (const char* p : {static_cast<const char*>(t.base),
                            static_cast<const char*>(t.base) + last_offset}) {
        cudaPointerAttributes attr{};
        KVTIER_CUDA_RETURN(cudaPointerGetAttributes(&attr, p), "cudaPointerGetAttributes");
        if (attr.type != cudaMemoryTypeDevice || attr.device != device_) {
          return Status::InvalidArgument(fmt::format(
              "paged KV tensor {}: {} is not memory of CUDA device {}", i,
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
    KVTIER_CUDA_RETURN(cudaMalloc(reinterpret_cast<void**>(&device_streams_), table_bytes), "cudaMalloc(stream table)");
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
    if (mechanism == CopyMechanism::kSmKernel) {
      if (!kernel_usable_) return KernelUnusable();
      if (reinterpret_cast<uintptr_t>(chunk) % kKernelAlignment != 0) {
        return Status::InvalidArgument("SM copy kernel needs a 16-byte aligned chunk buffer");
      }
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
      KVTIER_RETURN_IF_ERROR(LaunchKernel(block_ids, mapped, gather, stream));
    } else {
      KVTIER_RETURN_IF_ERROR(
          BatchedDma(block_ids, static_cast<char*>(chunk), gather, stream));
    }
    KVTIER_ASSIGN_OR_RETURN(cudaEvent_t event, events_->Take());
    CopyHandle handle(std::make_shared<CudaHandle>(events_, event), mechanism);
    KVTIER_CUDA_RETURN(cudaEventRecord(event, stream), "cudaEventRecord");
    return handle;
  }

  Status LaunchKernel(std::span<const int64_t> block_ids, char* chunk, bool gather,
                      cudaStream_t stream) {
    // Large (several hundred bytes to kilobytes) but on the stack only for the launch.
    auto launch = std::make_unique<PageCopyLaunch>();
    launch->streams = device_streams_;
    launch->num_streams = static_cast<uint32_t>(cache_.streams().size());
    launch->chunk = chunk;
    launch->chunk_blocks = block_ids.size();
    launch->tokens_per_block = cache_.tokens_per_block();
    for (size_t j0 = 0; j0 < block_ids.size(); j0 += kMaxBlocksPerLaunch) {
      const size_t n = std::min<size_t>(kMaxBlocksPerLaunch, block_ids.size() - j0);
      launch->first_block = static_cast<uint32_t>(j0);
      launch->count = static_cast<uint32_t>(n);
      for (size_t j = 0; j < n; ++j) {
        launch->block_ids[j] = static_cast<uint32_t>(block_ids[j0 + j]);
      }
      KVTIER_CUDA_RETURN(LaunchPageCopy(*launch, gather, cache_.max_page_bytes(), grid_blocks_,
                                        options_.kernel_threads, stream),
                         "launching the page copy kernel");
    }
    return Status::Ok();
  }

  Status BatchedDma(std::span<const int64_t> block_ids, char* chunk, bool gather,
                    cudaStream_t stream) {
    const std::vector<CopySegment> segments =
        PlanSegments(cache_, block_ids, options_.dma_merge_adjacent);
    std::vector<void*> dsts(segments.size());
    std::vector<const void*> srcs(segments.size());
    std::vector<size_t> sizes(segments.size());
    for (size_t i = 0; i < segments.size(); ++i) {
      char* host = chunk + segments[i].chunk_offset;
      dsts[i] = gather ? static_cast<void*>(host) : static_cast<void*>(segments[i].page);
      srcs[i] = gather ? static_cast<const void*>(segments[i].page) : host;
      sizes[i] = segments[i].bytes;
    }
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = options_.dma_prefer_overlap ? cudaMemcpyFlagPreferOverlapWithCompute
                                             : cudaMemcpyFlagDefault;
    size_t attr_index = 0;
    for (size_t i = 0; i < segments.size(); i += kMaxBatch) {
      const size_t n = std::min(kMaxBatch, segments.size() - i);
      KVTIER_CUDA_RETURN(cudaMemcpyBatchAsync(dsts.data() + i, srcs.data() + i, sizes.data() + i,
                                              n, &attr, &attr_index, 1, stream),
                         "cudaMemcpyBatchAsync");
    }
    return Status::Ok();
  }

  CudaCopierOptions options_;
  int device_;
  int grid_blocks_ = 0;
  bool kernel_usable_ = false;
  std::shared_ptr<EventPool> events_;
  cudaStream_t gather_stream_ = nullptr;
  cudaStream_t scatter_stream_ = nullptr;
  DevicePageStream* device_streams_ = nullptr;
};

}  // namespace

Status LaunchKernelCopy(KvCopier& copier, std::span<const int64_t> block_ids, uint64_t num_tokens,
                        void* chunk, bool gather, void* stream) {
  auto* cuda = dynamic_cast<CudaKvCopier*>(&copier);
  if (cuda == nullptr) return Status::InvalidArgument("not a CUDA copier");
  return cuda->KernelCopy(block_ids, num_tokens, static_cast<char*>(chunk), gather,
                          static_cast<cudaStream_t>(stream));
}

Result<std::string> DescribeCudaDevice(int device) {
  cudaDeviceProp prop{};
  KVTIER_CUDA_RETURN(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  int driver = 0, runtime = 0;
  (void)cudaDriverGetVersion(&driver);
  (void)cudaRuntimeGetVersion(&runtime);
  return fmt::format("cuda:{} {}, {} SMs, sm_{}{}, driver {}.{}, runtime {}.{}", device,
                     prop.name, prop.multiProcessorCount, prop.major, prop.minor, driver / 1000,
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
