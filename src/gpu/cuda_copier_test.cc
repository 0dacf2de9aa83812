// GPU copies checked bit-exactly against the host (memcpy) copier on mirrors of the same cache.
// Needs a CUDA device; skips itself where there is none.
#include "gpu/cuda_copier.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "gpu/random_layout.h"
#include "kvtier/paged_kv.h"

namespace kvtier {
namespace {

using gpu::testing::CacheShape;
using gpu::testing::MakeShape;
using gpu::testing::Place;
using gpu::testing::ReferenceGather;
using gpu::testing::ShapeKind;

#define ASSERT_CUDA(expr)                                                                \
  do {                                                                                   \
    const cudaError_t test_err_ = (expr);                                                \
    ASSERT_EQ(test_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(test_err_); \
  } while (0)

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

class CudaCopierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

struct Pinned {
  void* p = nullptr;
  size_t n = 0;
  explicit Pinned(size_t bytes) : n(bytes) {
    EXPECT_EQ(cudaHostAlloc(&p, bytes + 16, cudaHostAllocDefault), cudaSuccess);
  }
  ~Pinned() { (void)cudaFreeHost(p); }
  char* data() { return static_cast<char*>(p); }
};

// A cache in device memory plus a host mirror with the same shape and bytes.
struct GpuCache {
  CacheShape shape;
  void* dev = nullptr;
  std::vector<char> mirror;
  std::optional<PagedKvCache> cache;       // over `dev`
  std::optional<PagedKvCache> host_cache;  // the same shape over `mirror`

  void Init(const CacheShape& s, std::mt19937_64& rng) {
    shape = s;
    ASSERT_CUDA(cudaMalloc(&dev, s.buffer_bytes));
    mirror.resize(s.buffer_bytes);
    gpu::testing::FillRandom(mirror.data(), mirror.size(), rng);
    ASSERT_CUDA(cudaMemcpy(dev, mirror.data(), mirror.size(), cudaMemcpyHostToDevice));
    auto c = PagedKvCache::Create(Place(s, dev, MemorySpace::kCuda));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    cache = std::move(c).value();
    auto h = PagedKvCache::Create(Place(s, mirror.data(), MemorySpace::kHost));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    host_cache = std::move(h).value();
  }
  ~GpuCache() {
    if (dev) (void)cudaFree(dev);
  }
  std::vector<char> DeviceBytes() {
    std::vector<char> out(shape.buffer_bytes);
    EXPECT_EQ(cudaMemcpy(out.data(), dev, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

void CheckGatherAndScatter(const CacheShape& shape, CopyMechanism mechanism, uint64_t chunk_tokens,
                           std::mt19937_64& rng, const CudaCopierOptions& options = {}) {
  SCOPED_TRACE(testing::Message() << "mechanism " << CopyMechanismName(mechanism) << ", "
                                  << shape.tokens_per_block << " tokens/block, " << chunk_tokens
                                  << " tokens");
  GpuCache g;
  g.Init(shape, rng);
  if (::testing::Test::HasFatalFailure()) return;
  auto copier = NewCudaKvCopier(*g.cache, options);
  ASSERT_TRUE(copier.ok()) << copier.status().ToString();
  auto host = NewHostKvCopier(*g.host_cache);
  ASSERT_TRUE(host.ok());
  const uint64_t nblk = chunk_tokens / shape.tokens_per_block;
  const auto ids = gpu::testing::RandomIds(rng, g.cache->num_blocks(), nblk);
  const uint64_t bytes = g.cache->chunk_bytes(chunk_tokens);

  // Gather into a poisoned pinned chunk.
  Pinned chunk(bytes);
  std::memset(chunk.data(), 0xA5, bytes);
  CopyOptions opt;
  opt.mechanism = mechanism;
  auto h = (*copier)->Gather(ids, chunk_tokens, chunk.data(), bytes, opt);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_TRUE(h->Wait().ok());
  EXPECT_TRUE(h->IsDone());
  if (mechanism != CopyMechanism::kAuto) {
    EXPECT_EQ(h->mechanism(), mechanism);
  }
  std::vector<char> expect(bytes);
  ASSERT_TRUE((*host)->Gather(ids, chunk_tokens, expect.data(), bytes).ok());
  EXPECT_EQ(expect, ReferenceGather(g.host_cache->desc(), ids));
  EXPECT_EQ(0, std::memcmp(chunk.data(), expect.data(), bytes)) << "gather differs";

  // Scatter a random chunk into other blocks; the whole device buffer must equal the mirror
  // after the same host scatter (no stray writes).
  const auto ids2 = gpu::testing::RandomIds(rng, g.cache->num_blocks(), nblk);
  gpu::testing::FillRandom(chunk.data(), bytes, rng);
  auto s = (*copier)->Scatter(ids2, chunk_tokens, chunk.data(), bytes, opt);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(s->Wait().ok());
  ASSERT_TRUE((*host)->Scatter(ids2, chunk_tokens, chunk.data(), bytes).ok());
  EXPECT_TRUE(g.DeviceBytes() == g.mirror) << "scatter differs";
}

TEST_F(CudaCopierTest, MatchesHostCopierOnRandomLayouts) {
  std::mt19937_64 rng(2024);
  struct Case {
    ShapeKind kind;
    uint32_t layers, tpb;
    uint64_t token_bytes, pad, chunk_tokens;
  };
  const Case cases[] = {
      {ShapeKind::kSplitKvPerLayer, 4, 16, 2048, 0, 256},  // Qwen3-8B-like pages
      {ShapeKind::kSplitKvPerLayer, 3, 32, 512, 16, 128},
      {ShapeKind::kPackedKvPerLayer, 3, 8, 256, 32, 64},
      {ShapeKind::kCrossLayer, 5, 16, 1024, 16, 256},
      {ShapeKind::kCrossLayer, 2, 64, 128, 0, 128},
      {ShapeKind::kMlaPerLayer, 3, 64, 1152, 0, 256},  // DeepSeek-like latents
      {ShapeKind::kMlaCrossLayer, 4, 16, 1152, 16, 64},
      {ShapeKind::kSplitKvPerLayer, 2, 1, 64, 0, 600},  // > one kernel launch of blocks
  };
  for (const Case& c : cases) {
    const uint64_t nblk = c.chunk_tokens / c.tpb;
    const CacheShape shape = MakeShape(c.kind, c.layers, c.tpb, 2 * nblk + 3, c.token_bytes, c.pad);
    for (CopyMechanism m : {CopyMechanism::kSmKernel, CopyMechanism::kCopyEngine,
                            CopyMechanism::kStaged, CopyMechanism::kAuto}) {
      CheckGatherAndScatter(shape, m, c.chunk_tokens, rng);
    }
  }
}

// Staging slots smaller than the chunk: several streams per piece, and streams split by blocks.
TEST_F(CudaCopierTest, StagedInPieces) {
  std::mt19937_64 rng(77);
  // 4 KiB pages, 16 blocks per chunk: 64 KiB per stream, 6 streams.
  const CacheShape shape = MakeShape(ShapeKind::kSplitKvPerLayer, 3, 16, 40, 256, 16);
  for (uint64_t slot : {uint64_t{16} << 10, uint64_t{160} << 10, uint64_t{4} << 10}) {
    for (int slots : {1, 2, 3}) {
      CudaCopierOptions o;
      o.staging_slot_bytes = slot;
      o.staging_slots = slots;
      CheckGatherAndScatter(shape, CopyMechanism::kStaged, 256, rng, o);
    }
  }
  GpuCache g;
  g.Init(shape, rng);
  CudaCopierOptions tiny;
  tiny.staging_slot_bytes = 1024;  // smaller than a page
  auto copier = NewCudaKvCopier(*g.cache, tiny);
  ASSERT_TRUE(copier.ok());
  Pinned chunk(g.cache->chunk_bytes(16));
  CopyOptions staged;
  staged.mechanism = CopyMechanism::kStaged;
  const std::vector<int64_t> ids = {4};
  auto r = (*copier)->Gather(ids, 16, chunk.data(), g.cache->chunk_bytes(16), staged);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  CudaCopierOptions off;
  off.staging_slot_bytes = 0;
  auto no_staging = NewCudaKvCopier(*g.cache, off);
  ASSERT_TRUE(no_staging.ok());
  EXPECT_EQ((*no_staging)->AutoMechanism(), CopyMechanism::kSmKernel);
  EXPECT_FALSE((*no_staging)->Gather(ids, 16, chunk.data(), g.cache->chunk_bytes(16), staged).ok());
}

// Concurrent copies from several threads on several caller streams share the staging lanes.
TEST_F(CudaCopierTest, ConcurrentStagedCopiesFromThreads) {
  std::mt19937_64 rng(31);
  GpuCache g;
  g.Init(MakeShape(ShapeKind::kCrossLayer, 4, 16, 64, 512, 0), rng);
  CudaCopierOptions o;
  o.staging_slot_bytes = 64 << 10;  // pieces smaller than a chunk
  auto copier = NewCudaKvCopier(*g.cache, o);
  ASSERT_TRUE(copier.ok());
  auto host = NewHostKvCopier(*g.host_cache);
  ASSERT_TRUE(host.ok());
  const auto all = gpu::testing::RandomIds(rng, 64, 64);
  const uint64_t bytes = g.cache->chunk_bytes(64);  // 4 blocks per chunk
  constexpr int kThreads = 4;
  std::vector<std::unique_ptr<Pinned>> chunks;
  for (int t = 0; t < kThreads; ++t) chunks.push_back(std::make_unique<Pinned>(bytes));
  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      cudaStream_t s;
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        results[t] = Status::Internal("stream");
        return;
      }
      std::span<const int64_t> ids(all.data() + 4 * t, 4);
      CopyOptions opt;
      opt.stream = s;
      opt.mechanism = CopyMechanism::kStaged;
      for (int rep = 0; rep < 20 && results[t].ok(); ++rep) {
        auto h = (*copier)->Gather(ids, 64, chunks[t]->data(), bytes, opt);
        results[t] = h.ok() ? h->Wait() : h.status();
      }
      (void)cudaStreamDestroy(s);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(results[t].ok()) << results[t].ToString();
    std::span<const int64_t> ids(all.data() + 4 * t, 4);
    EXPECT_EQ(std::vector<char>(chunks[t]->data(), chunks[t]->data() + bytes),
              ReferenceGather(g.host_cache->desc(), ids))
        << "thread " << t;
  }
}

// A chunk leaves a 16-token per-layer engine and enters a 32-token cross-layer one.
TEST_F(CudaCopierTest, RoundTripAcrossBlockSizes) {
  std::mt19937_64 rng(9);
  GpuCache a, b;
  a.Init(MakeShape(ShapeKind::kSplitKvPerLayer, 4, 16, 40, 2048, 0), rng);
  b.Init(MakeShape(ShapeKind::kCrossLayer, 4, 32, 20, 2048, 0), rng);
  auto ca = NewCudaKvCopier(*a.cache);
  auto cb = NewCudaKvCopier(*b.cache);
  ASSERT_TRUE(ca.ok() && cb.ok());
  const auto ids_a = gpu::testing::RandomIds(rng, 40, 16);
  const auto ids_b = gpu::testing::RandomIds(rng, 20, 8);
  const uint64_t bytes = a.cache->chunk_bytes(256);
  ASSERT_EQ(bytes, b.cache->chunk_bytes(256));
  Pinned c1(bytes), c2(bytes);
  std::memset(c2.data(), 0x11, bytes);
  CopyOptions kernel, dma;
  kernel.mechanism = CopyMechanism::kSmKernel;
  dma.mechanism = CopyMechanism::kCopyEngine;
  auto g = (*ca)->Gather(ids_a, 256, c1.data(), bytes, kernel);
  ASSERT_TRUE(g.ok());
  // The scatter waits for the gather on the GPU, through the gather's event.
  CopyOptions after = dma;
  after.wait_event = g->event();
  auto s = (*cb)->Scatter(ids_b, 256, c1.data(), bytes, after);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  CopyOptions after2 = kernel;
  after2.wait_event = s->event();
  auto g2 = (*cb)->Gather(ids_b, 256, c2.data(), bytes, after2);
  ASSERT_TRUE(g2.ok());
  ASSERT_TRUE(g2->Wait().ok());
  EXPECT_EQ(0, std::memcmp(c1.data(), c2.data(), bytes));
  EXPECT_EQ(std::vector<char>(c1.data(), c1.data() + bytes),
            ReferenceGather(a.host_cache->desc(), ids_a));
}

// The copy runs on the caller's stream after the caller's event: it sees what a "compute" stream
// wrote before recording the event, and the compute stream can wait on the copy's event.
TEST_F(CudaCopierTest, OrdersWithCallerStreamsAndEvents) {
  std::mt19937_64 rng(4);
  GpuCache g;
  g.Init(MakeShape(ShapeKind::kSplitKvPerLayer, 2, 16, 8, 256, 0), rng);
  auto copier = NewCudaKvCopier(*g.cache);
  ASSERT_TRUE(copier.ok());
  cudaStream_t compute, copy;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
  cudaEvent_t written;
  ASSERT_CUDA(cudaEventCreate(&written));
  // "Compute" rewrites the whole cache with 0x3C, slowly enough to race an unordered copy.
  for (int i = 0; i < 20; ++i) {
    ASSERT_CUDA(cudaMemsetAsync(g.dev, 0x3C, g.shape.buffer_bytes, compute));
  }
  ASSERT_CUDA(cudaEventRecord(written, compute));
  const std::vector<int64_t> ids = {5, 2};
  const uint64_t bytes = g.cache->chunk_bytes(32);
  for (CopyMechanism m : {CopyMechanism::kSmKernel, CopyMechanism::kCopyEngine}) {
    Pinned chunk(bytes);
    std::memset(chunk.data(), 0, bytes);
    CopyOptions opt;
    opt.stream = copy;
    opt.wait_event = written;
    opt.mechanism = m;
    auto h = (*copier)->Gather(ids, 32, chunk.data(), bytes, opt);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    ASSERT_NE(h->event(), nullptr);
    ASSERT_CUDA(cudaStreamWaitEvent(compute, static_cast<cudaEvent_t>(h->event()), 0));
    ASSERT_CUDA(cudaStreamSynchronize(compute));
    EXPECT_TRUE(h->IsDone());
    for (uint64_t i = 0; i < bytes; ++i) {
      ASSERT_EQ(static_cast<unsigned char>(chunk.data()[i]), 0x3C) << "byte " << i;
    }
  }
  (void)cudaEventDestroy(written);
  (void)cudaStreamDestroy(compute);
  (void)cudaStreamDestroy(copy);
}

// A batch of chunks, each in its own pinned buffer or all in one pool, matches the host copier
// for every mechanism; the copy-engine batch is one handle, completing after the last chunk. A
// pageable chunk anywhere in a batch is refused with its index.
TEST_F(CudaCopierTest, BatchedChunksMatchHostCopier) {
  std::mt19937_64 rng(31);
  const CacheShape shape = MakeShape(ShapeKind::kSplitKvPerLayer, 3, 16, 48, 1024, 0);
  GpuCache g;
  g.Init(shape, rng);
  auto copier = NewCudaKvCopier(*g.cache);
  ASSERT_TRUE(copier.ok());
  auto host = NewHostKvCopier(*g.host_cache);
  ASSERT_TRUE(host.ok());
  const uint64_t tokens = 64, bytes = g.cache->chunk_bytes(tokens);
  const int n = 6;
  std::vector<int64_t> all(48);
  std::iota(all.begin(), all.end(), 0);
  for (CopyMechanism m : {CopyMechanism::kCopyEngine, CopyMechanism::kStaged,
                          CopyMechanism::kSmKernel, CopyMechanism::kAuto}) {
    SCOPED_TRACE(CopyMechanismName(m));
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<std::vector<int64_t>> ids;
    for (int c = 0; c < n; ++c) ids.emplace_back(all.begin() + 4 * c, all.begin() + 4 * c + 4);
    Pinned pool(n * bytes);
    std::memset(pool.data(), 0xA5, n * bytes);
    std::vector<ChunkCopy> chunks;
    for (int c = 0; c < n; ++c) chunks.push_back({ids[c], pool.data() + c * bytes, bytes});
    CopyOptions opt;
    opt.mechanism = m;
    auto h = (*copier)->GatherChunks(chunks, tokens, opt);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    ASSERT_TRUE(h->Wait().ok());
    for (int c = 0; c < n; ++c) {
      EXPECT_EQ(0, std::memcmp(pool.data() + c * bytes,
                               ReferenceGather(g.host_cache->desc(), ids[c]).data(), bytes))
          << "gather, chunk " << c;
    }
    // Scatter fresh bytes back into the same blocks; the device must equal the mirror.
    gpu::testing::FillRandom(pool.data(), n * bytes, rng);
    auto s = (*copier)->ScatterChunks(chunks, tokens, opt);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE(s->Wait().ok());
    ASSERT_TRUE((*host)->ScatterChunks(chunks, tokens).ok());
    EXPECT_TRUE(g.DeviceBytes() == g.mirror) << "scatter differs";
  }
  // Chunks in separate pinned allocations (the span check fails; each is checked on its own),
  // then one pageable chunk among them.
  Pinned a(bytes), b(bytes);
  std::vector<char> pageable(bytes);
  const std::vector<int64_t> ia = {1, 2, 3, 4}, ib = {9, 8, 7, 6};
  std::vector<ChunkCopy> two = {{ia, a.data(), bytes}, {ib, b.data(), bytes}};
  auto h = (*copier)->GatherChunks(two, tokens);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_TRUE(h->Wait().ok());
  EXPECT_EQ(0, std::memcmp(b.data(), ReferenceGather(g.host_cache->desc(), ib).data(), bytes));
  two[1].chunk = pageable.data();
  CopyOptions dma;
  dma.mechanism = CopyMechanism::kCopyEngine;
  auto bad = (*copier)->GatherChunks(two, tokens, dma);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().ToString().find("chunk 1 of 2"), std::string::npos)
      << bad.status().ToString();
}

TEST_F(CudaCopierTest, RefusesWhatItCannotDo) {
  std::mt19937_64 rng(8);
  GpuCache g;
  g.Init(MakeShape(ShapeKind::kSplitKvPerLayer, 2, 16, 8, 256, 0), rng);
  auto copier = NewCudaKvCopier(*g.cache);
  ASSERT_TRUE(copier.ok());
  const std::vector<int64_t> ids = {1, 6};
  const uint64_t bytes = g.cache->chunk_bytes(32);
  CopyOptions kernel;
  kernel.mechanism = CopyMechanism::kSmKernel;

  // Pageable memory.
  std::vector<char> pageable(bytes);
  auto r = (*copier)->Gather(ids, 32, pageable.data(), bytes);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("pinned"), std::string::npos) << r.status().ToString();
  // Misaligned chunk: refused by the zero-copy kernel, served under kAuto.
  Pinned chunk(bytes + 16);
  r = (*copier)->Gather(ids, 32, chunk.data() + 4, bytes, kernel);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("aligned"), std::string::npos) << r.status().ToString();
  r = (*copier)->Gather(ids, 32, chunk.data() + 4, bytes);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->mechanism(), CopyMechanism::kStaged);  // 4 KiB pages: staged, any alignment
  ASSERT_TRUE(r->Wait().ok());
  EXPECT_EQ(std::vector<char>(chunk.data() + 4, chunk.data() + 4 + bytes),
            ReferenceGather(g.host_cache->desc(), ids));
  // Partial last block, out-of-range id, duplicate scatter ids, host memory mechanism.
  EXPECT_EQ((*copier)->Gather(ids, 31, chunk.data(), bytes).status().code(),
            StatusCode::kInvalidArgument);
  const std::vector<int64_t> bad = {1, 99};
  EXPECT_EQ((*copier)->Gather(bad, 32, chunk.data(), bytes).status().code(),
            StatusCode::kInvalidArgument);
  const std::vector<int64_t> dup = {3, 3};
  EXPECT_EQ((*copier)->Scatter(dup, 32, chunk.data(), bytes).status().code(),
            StatusCode::kInvalidArgument);
  CopyOptions memcpy_opt;
  memcpy_opt.mechanism = CopyMechanism::kHostMemcpy;
  EXPECT_FALSE((*copier)->Gather(ids, 32, chunk.data(), bytes, memcpy_opt).ok());

  // A cache whose pages are not 16-byte aligned: the kernel refuses, kAuto picks DMA.
  GpuCache odd;
  odd.Init(MakeShape(ShapeKind::kPackedKvPerLayer, 2, 4, 8, 18, 2), rng);
  auto oc = NewCudaKvCopier(*odd.cache);
  ASSERT_TRUE(oc.ok());
  EXPECT_EQ((*oc)->AutoMechanism(), CopyMechanism::kCopyEngine);
  const std::vector<int64_t> oids = {7, 0, 3};
  const uint64_t obytes = odd.cache->chunk_bytes(12);
  Pinned ochunk(obytes);
  EXPECT_EQ((*oc)->Gather(oids, 12, ochunk.data(), obytes, kernel).status().code(),
            StatusCode::kInvalidArgument);
  auto og = (*oc)->Gather(oids, 12, ochunk.data(), obytes);
  ASSERT_TRUE(og.ok()) << og.status().ToString();
  ASSERT_TRUE(og->Wait().ok());
  EXPECT_EQ(std::vector<char>(ochunk.data(), ochunk.data() + obytes),
            ReferenceGather(odd.host_cache->desc(), oids));

  // A description pointing at host memory is not a CUDA cache.
  EXPECT_EQ(NewCudaKvCopier(*g.host_cache).status().code(), StatusCode::kInvalidArgument);
  PagedKvCacheDesc lie = g.host_cache->desc();
  lie.memory = MemorySpace::kCuda;
  EXPECT_EQ(NewCudaKvCopier(PagedKvCache::Create(lie).value()).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier
