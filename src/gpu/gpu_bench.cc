// `kvtier bench gpu`: see gpu_bench.h. Every figure is the median of `reps` timed batches of
// `chunks` chunks, timed with CUDA events on the copy streams, after one untimed warm-up batch.
#include "gpu/gpu_bench.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "gpu/copy_plan.h"
#include "gpu/cuda_copier.h"
#include "kvtier/paged_kv.h"

namespace kvtier::gpu {
namespace {

#define BENCH_CUDA(expr)                                                        \
  do {                                                                          \
    cudaError_t bench_err_ = (expr);                                            \
    if (bench_err_ != cudaSuccess) {                                            \
      return Status::Internal(                                                  \
          fmt::format("{} failed: {}", #expr, cudaGetErrorString(bench_err_))); \
    }                                                                           \
  } while (0)

// Owners of CUDA allocations, freed on every exit path.
struct DeviceBuffer {
  void* ptr = nullptr;
  ~DeviceBuffer() {
    if (ptr) (void)cudaFree(ptr);
  }
};
struct PinnedBuffer {
  void* ptr = nullptr;
  ~PinnedBuffer() {
    if (ptr) (void)cudaFreeHost(ptr);
  }
};
struct Streams {
  cudaStream_t a = nullptr, b = nullptr;
  cudaEvent_t start = nullptr, b_done = nullptr, stop = nullptr;
  ~Streams() {
    for (cudaEvent_t e : {start, b_done, stop}) {
      if (e) (void)cudaEventDestroy(e);
    }
    for (cudaStream_t s : {a, b}) {
      if (s) (void)cudaStreamDestroy(s);
    }
  }
};

using IssueFn = std::function<Status(uint32_t chunk, cudaStream_t stream)>;

// Times one batch: `a` issues on stream A, `b` on stream B, chunk by chunk interleaved, both
// starting from one event. Returns the median over reps of bytes / elapsed in GB/s (1e9 B/s).
Result<double> TimeBatch(Streams& st, uint32_t chunks, int reps, uint64_t bytes, const IssueFn& a,
                         const IssueFn& b) {
  std::vector<double> gbps;
  for (int rep = -1; rep < reps; ++rep) {
    BENCH_CUDA(cudaEventRecord(st.start, st.a));
    BENCH_CUDA(cudaStreamWaitEvent(st.b, st.start, 0));
    for (uint32_t c = 0; c < chunks; ++c) {
      if (a) KVTIER_RETURN_IF_ERROR(a(c, st.a));
      if (b) KVTIER_RETURN_IF_ERROR(b(c, st.b));
    }
    BENCH_CUDA(cudaEventRecord(st.b_done, st.b));
    BENCH_CUDA(cudaStreamWaitEvent(st.a, st.b_done, 0));
    BENCH_CUDA(cudaEventRecord(st.stop, st.a));
    BENCH_CUDA(cudaEventSynchronize(st.stop));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, st.start, st.stop));
    if (rep >= 0) gbps.push_back(double(bytes) / (ms * 1e-3) / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  return gbps[gbps.size() / 2];
}

// Fills `bytes` at `p` with xorshift noise: copies of zeros can hide unwritten output.
void FillRandom(void* p, uint64_t bytes, uint64_t seed) {
  uint64_t x = seed | 1;
  auto* w = static_cast<uint64_t*>(p);
  for (uint64_t i = 0; i < bytes / 8; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    w[i] = x;
  }
}

// Checks `chunk` (host) against the pages of `ids`, read one page at a time with cudaMemcpy.
Result<bool> ChunkMatchesPages(const PagedKvCache& cache, std::span<const int64_t> ids,
                               const char* chunk, std::vector<char>& scratch) {
  scratch.resize(cache.chunk_bytes(ids.size() * cache.tokens_per_block()));
  for (const CopySegment& seg : PlanSegments(cache, ids, /*merge=*/false)) {
    BENCH_CUDA(
        cudaMemcpy(scratch.data() + seg.chunk_offset, seg.page, seg.bytes, cudaMemcpyDeviceToHost));
  }
  return std::memcmp(scratch.data(), chunk, scratch.size()) == 0;
}

struct Config {
  std::string layout;
  uint32_t tpb;
};

}  // namespace

Result<GpuBenchReport> RunGpuBench(const GpuBenchOptions& o) {
  auto say = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  if (o.block_tokens.empty() || o.chunks == 0 || o.reps <= 0 || o.layers == 0 ||
      o.chunk_tokens == 0) {
    return Status::InvalidArgument("bench gpu: empty block sizes, chunks, reps or layers");
  }
  for (uint32_t tpb : o.block_tokens) {
    if (tpb == 0 || o.chunk_tokens % tpb != 0) {
      return Status::InvalidArgument(fmt::format(
          "bench gpu: block size {} does not divide the chunk of {} tokens", tpb, o.chunk_tokens));
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return Status::Unavailable("bench gpu: no CUDA device");
  }
  if (o.device < 0 || o.device >= count) {
    return Status::InvalidArgument(fmt::format("bench gpu: no CUDA device {}", o.device));
  }
  BENCH_CUDA(cudaSetDevice(o.device));
  GpuBenchReport report;
  KVTIER_ASSIGN_OR_RETURN(report.device, DescribeCudaDevice(o.device));
  const uint64_t token_bytes = uint64_t{o.kv_heads} * o.head_dim * o.dtype_bytes;
  const uint64_t bytes_per_token = token_bytes * 2 * o.layers;
  report.chunk_bytes = bytes_per_token * o.chunk_tokens;
  report.batch_bytes = report.chunk_bytes * o.chunks;
  const uint64_t batch = report.batch_bytes;
  say(fmt::format("{}; chunk {} tokens = {:.1f} MiB, {} chunks per batch = {:.2f} GiB",
                  report.device, o.chunk_tokens, report.chunk_bytes / 1048576.0, o.chunks,
                  batch / 1073741824.0));

  // Buffers: the paged cache and two host pools (gather destination, scatter source).
  DeviceBuffer cache_mem;
  PinnedBuffer gather_pool, scatter_pool;
  BENCH_CUDA(cudaMalloc(&cache_mem.ptr, o.cache_bytes));
  BENCH_CUDA(cudaHostAlloc(&gather_pool.ptr, batch, cudaHostAllocDefault));
  BENCH_CUDA(cudaHostAlloc(&scatter_pool.ptr, batch, cudaHostAllocDefault));
  FillRandom(scatter_pool.ptr, batch, 0x9e3779b97f4a7c15ull);
  std::memset(gather_pool.ptr, 0xA5, batch);
  for (uint64_t off = 0; off < o.cache_bytes; off += batch) {
    BENCH_CUDA(cudaMemcpy(static_cast<char*>(cache_mem.ptr) + off, scatter_pool.ptr,
                          std::min(batch, o.cache_bytes - off), cudaMemcpyHostToDevice));
  }
  FillRandom(scatter_pool.ptr, batch, 0x2545f4914f6cdd1dull);  // differ from the cache

  Streams st;
  BENCH_CUDA(cudaStreamCreateWithFlags(&st.a, cudaStreamNonBlocking));
  BENCH_CUDA(cudaStreamCreateWithFlags(&st.b, cudaStreamNonBlocking));
  BENCH_CUDA(cudaEventCreate(&st.start));
  BENCH_CUDA(cudaEventCreate(&st.b_done));
  BENCH_CUDA(cudaEventCreate(&st.stop));

  // Peaks: one copy of the whole batch per direction, and both directions at once.
  char* dev = static_cast<char*>(cache_mem.ptr);
  char* gp = static_cast<char*>(gather_pool.ptr);
  char* sp = static_cast<char*>(scatter_pool.ptr);
  const IssueFn d2h = [&](uint32_t c, cudaStream_t s) -> Status {
    if (c == 0) BENCH_CUDA(cudaMemcpyAsync(gp, dev, batch, cudaMemcpyDeviceToHost, s));
    return Status::Ok();
  };
  const IssueFn h2d = [&](uint32_t c, cudaStream_t s) -> Status {
    if (c == 0) BENCH_CUDA(cudaMemcpyAsync(dev + batch, sp, batch, cudaMemcpyHostToDevice, s));
    return Status::Ok();
  };
  // Measured before and after the copies; the larger of the two is the ceiling the copies are
  // compared with (a shared machine can be slow for a while, and a ceiling measured in a slow
  // moment would flatter every ratio).
  auto measure_peaks = [&](GpuBenchReport::Peaks& p, const char* when) -> Status {
    KVTIER_ASSIGN_OR_RETURN(p.d2h, TimeBatch(st, 1, o.reps, batch, d2h, nullptr));
    KVTIER_ASSIGN_OR_RETURN(p.h2d, TimeBatch(st, 1, o.reps, batch, nullptr, h2d));
    KVTIER_ASSIGN_OR_RETURN(p.bidir, TimeBatch(st, 1, o.reps, 2 * batch, d2h, h2d));
    say(
        fmt::format("peak pinned cudaMemcpy of {:.2f} GiB ({}): d2h {:.1f} GB/s, h2d {:.1f} GB/s, "
                    "both at once {:.1f} GB/s",
                    batch / 1073741824.0, when, p.d2h, p.h2d, p.bidir));
    return Status::Ok();
  };
  KVTIER_RETURN_IF_ERROR(measure_peaks(report.peaks_start, "start"));
  report.peak_d2h = report.peaks_start.d2h;
  report.peak_h2d = report.peaks_start.h2d;
  report.peak_bidir = report.peaks_start.bidir;

  std::vector<Config> configs;
  for (const char* layout : {"per-layer", "cross-layer"}) {
    for (uint32_t tpb : o.block_tokens) configs.push_back({layout, tpb});
  }
  std::mt19937_64 rng(42);
  std::vector<char> scratch;
  for (const Config& cfg : configs) {
    const bool headline = cfg.tpb == o.block_tokens.front();
    const uint64_t page = uint64_t{cfg.tpb} * token_bytes;
    const uint64_t block_bytes = page * 2 * o.layers;
    const uint64_t nb = o.cache_bytes / block_bytes;
    const uint64_t chunk_blocks = o.chunk_tokens / cfg.tpb;
    if (nb < 2 * o.chunks * chunk_blocks) {
      return Status::InvalidArgument(
          fmt::format("bench gpu: cache of {} blocks cannot hold 2 x {} chunks; raise cache_bytes",
                      nb, o.chunks));
    }
    PagedKvCacheDesc desc;
    desc.memory = MemorySpace::kCuda;
    desc.device = o.device;
    desc.tokens_per_block = cfg.tpb;
    if (cfg.layout == "per-layer") {
      for (uint32_t l = 0; l < o.layers; ++l) {
        desc.tensors.push_back(
            KvPageTensor::SplitKv(dev + l * 2 * nb * page, nb, cfg.tpb, token_bytes));
      }
    } else {
      desc.tensors.push_back(KvPageTensor::CrossLayer(dev, nb, o.layers, cfg.tpb, token_bytes));
    }
    KVTIER_ASSIGN_OR_RETURN(PagedKvCache cache, PagedKvCache::Create(desc));

    // Random, distinct block ids: gather chunks first, then scatter chunks.
    std::vector<int64_t> perm(nb);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    auto ids = [&](bool scatter, uint32_t c) {
      return std::span<const int64_t>(perm).subspan(((scatter ? o.chunks : 0) + c) * chunk_blocks,
                                                    chunk_blocks);
    };

    struct Variant {
      std::string name;
      CudaCopierOptions copier;
      CopyMechanism mechanism;
    };
    std::vector<Variant> variants;
    variants.push_back({"auto", {}, CopyMechanism::kAuto});
    variants.push_back({"kernel", {}, CopyMechanism::kSmKernel});
    variants.push_back({"dma", {}, CopyMechanism::kCopyEngine});
    variants.push_back({"staged", {}, CopyMechanism::kStaged});
    if (headline) {
      for (uint64_t mib : o.staging_slot_mib) {
        CudaCopierOptions k;
        k.staging_slot_bytes = mib << 20;
        variants.push_back({fmt::format("staged/{}MiB", mib), k, CopyMechanism::kStaged});
      }
      for (int kb : o.kernel_blocks) {
        CudaCopierOptions k;
        k.kernel_blocks = kb;
        variants.push_back({fmt::format("kernel/{}", kb), k, CopyMechanism::kSmKernel});
      }
    }

    for (Variant& v : variants) {
      KVTIER_ASSIGN_OR_RETURN(auto copier, NewCudaKvCopier(cache, v.copier));
      std::string name = v.name;
      if (v.mechanism == CopyMechanism::kAuto) {
        name = fmt::format("auto={}", CopyMechanismName(copier->AutoMechanism()));
      }
      const uint64_t cb = report.chunk_bytes;
      IssueFn gather = [&](uint32_t c, cudaStream_t s) -> Status {
        CopyOptions opt;
        opt.stream = s;
        opt.mechanism = v.mechanism;
        KVTIER_ASSIGN_OR_RETURN(
            CopyHandle h, copier->Gather(ids(false, c), o.chunk_tokens, gp + c * cb, cb, opt));
        return Status::Ok();
      };
      IssueFn scatter = [&](uint32_t c, cudaStream_t s) -> Status {
        CopyOptions opt;
        opt.stream = s;
        opt.mechanism = v.mechanism;
        KVTIER_ASSIGN_OR_RETURN(
            CopyHandle h, copier->Scatter(ids(true, c), o.chunk_tokens, sp + c * cb, cb, opt));
        return Status::Ok();
      };
      struct Op {
        const char* name;
        bool g, s;
        double peak;
      };
      for (const Op& op :
           {Op{"gather", true, false, report.peak_d2h}, Op{"scatter", false, true, report.peak_h2d},
            Op{"bidir", true, true, report.peak_bidir}}) {
        // Poison both destinations, so that a chunk or page the copy missed cannot verify: the
        // gather pool, and the scatter's target pages (an earlier variant wrote the same bytes
        // there).
        std::memset(gp, 0xA5, batch);
        if (op.s) {
          for (uint32_t c = 0; c < o.chunks; ++c) {
            for (const CopySegment& seg : PlanSegments(cache, ids(true, c), /*merge=*/true)) {
              BENCH_CUDA(cudaMemsetAsync(seg.page, 0x5A, seg.bytes, st.a));
            }
          }
          BENCH_CUDA(cudaStreamSynchronize(st.a));
        }
        const uint64_t bytes = (op.g ? batch : 0) + (op.s ? batch : 0);
        KVTIER_ASSIGN_OR_RETURN(double gbps,
                                TimeBatch(st, o.chunks, o.reps, bytes, op.g ? gather : IssueFn(),
                                          op.s ? scatter : IssueFn()));
        bool ok = true;
        for (uint32_t c = 0; c < o.chunks && ok; ++c) {  // every chunk of the batch
          if (op.g) {
            KVTIER_ASSIGN_OR_RETURN(bool m,
                                    ChunkMatchesPages(cache, ids(false, c), gp + c * cb, scratch));
            ok = ok && m;
          }
          if (op.s) {
            KVTIER_ASSIGN_OR_RETURN(bool m,
                                    ChunkMatchesPages(cache, ids(true, c), sp + c * cb, scratch));
            ok = ok && m;
          }
        }
        GpuBenchRow row{cfg.layout, cfg.tpb, page,           name, op.name,
                        gbps,       op.peak, gbps / op.peak, ok};
        say(
            fmt::format("{:<11} {:>3} tok/block {:>6} KiB pages  {:<14} {:<7} {:6.1f} GB/s  "
                        "{:5.3f} x start peak  {}",
                        row.layout, row.block_tokens, row.page_bytes / 1024, row.variant, row.op,
                        row.gbps, row.ratio, ok ? "verified" : "MISMATCH"));
        if (!ok) {
          return Status::Internal(
              fmt::format("bench gpu: {} {} {} produced wrong bytes", cfg.layout, name, op.name));
        }
        if (v.mechanism == CopyMechanism::kAuto && headline) {
          double& slot = cfg.layout == "per-layer" ? (op.g && op.s ? report.bidir
                                                      : op.g       ? report.gather
                                                                   : report.scatter)
                                                   : (op.g && op.s ? report.cross_bidir
                                                      : op.g       ? report.cross_gather
                                                                   : report.cross_scatter);
          slot = gbps;
          (cfg.layout == "per-layer" ? report.auto_mechanism : report.cross_auto_mechanism) =
              CopyMechanismName(copier->AutoMechanism());
        }
        report.rows.push_back(std::move(row));
      }
    }
  }
  KVTIER_RETURN_IF_ERROR(measure_peaks(report.peaks_end, "end"));
  report.peak_d2h = std::max(report.peaks_start.d2h, report.peaks_end.d2h);
  report.peak_h2d = std::max(report.peaks_start.h2d, report.peaks_end.h2d);
  report.peak_bidir = std::max(report.peaks_start.bidir, report.peaks_end.bidir);
  for (GpuBenchRow& row : report.rows) {
    row.peak_gbps = row.op == "gather"    ? report.peak_d2h
                    : row.op == "scatter" ? report.peak_h2d
                                          : report.peak_bidir;
    row.ratio = row.gbps / row.peak_gbps;
  }
  return report;
}

}  // namespace kvtier::gpu
