#include "kvtier/paged_kv.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "gpu/copy_plan.h"
#include "gpu/random_layout.h"

namespace kvtier {
namespace {

using gpu::testing::CacheShape;
using gpu::testing::MakeShape;
using gpu::testing::Place;
using gpu::testing::ReferenceGather;
using gpu::testing::ShapeKind;

// A host cache of some shape, filled with random bytes.
struct HostCache {
  CacheShape shape;
  std::vector<char> mem;
  PagedKvCache cache;
  std::unique_ptr<KvCopier> copier;

  static HostCache Make(ShapeKind kind, uint32_t layers, uint32_t tpb, uint64_t blocks,
                        uint64_t token_bytes, uint64_t pad, std::mt19937_64& rng) {
    CacheShape shape = MakeShape(kind, layers, tpb, blocks, token_bytes, pad);
    std::vector<char> mem(shape.buffer_bytes);
    gpu::testing::FillRandom(mem.data(), mem.size(), rng);
    auto cache = PagedKvCache::Create(Place(shape, mem.data(), MemorySpace::kHost));
    EXPECT_TRUE(cache.ok()) << cache.status().ToString();
    auto copier = NewHostKvCopier(*cache);
    EXPECT_TRUE(copier.ok()) << copier.status().ToString();
    return HostCache{shape, std::move(mem), std::move(cache).value(), std::move(copier).value()};
  }

  std::vector<char> Gather(std::span<const int64_t> ids) {
    const uint64_t tokens = ids.size() * cache.tokens_per_block();
    std::vector<char> chunk(cache.chunk_bytes(tokens), 0x5a);
    auto h = copier->Gather(ids, tokens, chunk.data(), chunk.size());
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    return chunk;
  }
  void Scatter(std::span<const int64_t> ids, const std::vector<char>& chunk) {
    const uint64_t tokens = ids.size() * cache.tokens_per_block();
    auto h = copier->Scatter(ids, tokens, chunk.data(), chunk.size());
    ASSERT_TRUE(h.ok()) << h.status().ToString();
  }
};

PagedKvCacheDesc OneTensor(void* base, uint32_t tpb, KvPageTensor t) {
  t.base = base;
  PagedKvCacheDesc d;
  d.memory = MemorySpace::kHost;
  d.tokens_per_block = tpb;
  d.tensors.push_back(t);
  return d;
}

TEST(PagedKvCacheTest, QwenShapes) {
  std::vector<char> mem(1);
  PagedKvCacheDesc d;
  d.memory = MemorySpace::kHost;
  d.tokens_per_block = 16;
  // Addresses are never touched by Create: describe a large cache over fake bases.
  for (int l = 0; l < 36; ++l) {
    d.tensors.push_back(
        KvPageTensor::SplitKv(reinterpret_cast<void*>((l + 1) * (1ull << 32)), 1000, 16, 2048));
  }
  auto c = PagedKvCache::Create(d);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->bytes_per_token(), 147456u);
  EXPECT_EQ(c->chunk_bytes(256), 37748736u);
  EXPECT_EQ(c->streams().size(), 72u);
  EXPECT_EQ(c->min_page_bytes(), 32768u);
  EXPECT_EQ(c->num_blocks(), 1000u);
  EXPECT_TRUE(c->PagesAligned(16));
  // Stream 1 is layer 0's V: it starts after all of layer 0's K tokens.
  EXPECT_EQ(c->ChunkOffset(1, 16, 0), 256u * 2048);
  EXPECT_EQ(c->ChunkOffset(2, 16, 3), 2u * 256 * 2048 + 3 * 32768);

  PagedKvCacheDesc x;
  x.memory = MemorySpace::kHost;
  x.tokens_per_block = 16;
  x.tensors.push_back(
      KvPageTensor::CrossLayer(reinterpret_cast<void*>(1ull << 32), 1000, 36, 16, 2048));
  auto cx = PagedKvCache::Create(x);
  ASSERT_TRUE(cx.ok()) << cx.status().ToString();
  EXPECT_EQ(cx->bytes_per_token(), 147456u);
  EXPECT_EQ(cx->streams().size(), 72u);
  for (size_t s = 0; s < 72; ++s) {
    EXPECT_EQ(cx->ChunkOffset(s, 16, 5), c->ChunkOffset(s, 16, 5)) << s;
  }
}

TEST(PagedKvCacheTest, RefusesBadDescriptions) {
  std::vector<char> mem(1 << 20);
  void* base = mem.data();
  auto expect_invalid = [](PagedKvCacheDesc d, const char* what) {
    auto c = PagedKvCache::Create(std::move(d));
    ASSERT_FALSE(c.ok()) << what;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << what;
    EXPECT_NE(c.status().message().find(what), std::string::npos) << c.status().ToString();
  };
  PagedKvCacheDesc empty;
  empty.tokens_per_block = 16;
  expect_invalid(empty, "no tensors");
  expect_invalid(OneTensor(base, 0, KvPageTensor::SinglePage(base, 4, 16, 64)), "tokens_per_block");
  expect_invalid(OneTensor(nullptr, 16, KvPageTensor::SinglePage(nullptr, 4, 16, 64)), "null base");
  expect_invalid(OneTensor(base, 16, KvPageTensor::SinglePage(base, 0, 16, 64)), "num_blocks");
  expect_invalid(OneTensor(base, 16, KvPageTensor::SinglePage(base, 4, 16, 0)), "token_bytes");
  expect_invalid(OneTensor(base, 16, KvPageTensor::SinglePage(base, (1ull << 31) + 1, 16, 64)),
                 "2^31");
  // Block stride shorter than a page: neighbouring blocks overlap.
  KvPageTensor t = KvPageTensor::SinglePage(base, 4, 16, 64);
  t.block_stride_bytes = 1000;
  expect_invalid(OneTensor(base, 16, t), "overlap");
  // K and V pages one byte too close.
  t = KvPageTensor::PackedKv(base, 4, 16, 64);
  t.component_stride_bytes = 16 * 64 - 1;
  expect_invalid(OneTensor(base, 16, t), "overlap");
  // Cross-layer block whose layers run into the next block.
  t = KvPageTensor::CrossLayer(base, 4, 8, 16, 64);
  t.block_stride_bytes -= 16;
  expect_invalid(OneTensor(base, 16, t), "overlap");
  // V pages of a split layout landing on K pages of later blocks.
  t = KvPageTensor::SplitKv(base, 4, 16, 64);
  t.component_stride_bytes = 2 * 16 * 64;
  expect_invalid(OneTensor(base, 16, t), "overlap");
  // Two tensors sharing memory.
  PagedKvCacheDesc two = OneTensor(base, 16, KvPageTensor::SinglePage(base, 4, 16, 64));
  two.tensors.push_back(KvPageTensor::SinglePage(static_cast<char*>(base) + 1024, 4, 16, 64));
  expect_invalid(two, "overlap in memory");
  // Legal: the same split layout with a stride that interleaves K and V without collisions.
  t = KvPageTensor::SplitKv(base, 4, 16, 64);
  t.block_stride_bytes = 2 * 16 * 64;
  t.component_stride_bytes = 16 * 64;
  EXPECT_TRUE(PagedKvCache::Create(OneTensor(base, 16, t)).ok());
}

TEST(PagedKvCacheTest, RefusesBadRequests) {
  std::mt19937_64 rng(1);
  HostCache h = HostCache::Make(ShapeKind::kSplitKvPerLayer, 2, 16, 8, 64, 0, rng);
  const std::vector<int64_t> ids = {3, 1, 7};
  auto code = [&](std::span<const int64_t> i, uint64_t tokens, bool scatter) {
    return h.cache.CheckRequest(i, tokens, scatter);
  };
  EXPECT_TRUE(code(ids, 48, false).ok());
  Status partial = code(ids, 40, false);
  EXPECT_EQ(partial.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(partial.message().find("partial last block"), std::string::npos) << partial.ToString();
  EXPECT_FALSE(code(ids, 32, false).ok());  // too many ids
  EXPECT_FALSE(code(ids, 64, false).ok());  // too few ids
  EXPECT_FALSE(code(ids, 0, false).ok());
  const std::vector<int64_t> out_of_range = {3, 8, 1};
  Status oor = code(out_of_range, 48, false);
  EXPECT_NE(oor.message().find("out of range"), std::string::npos) << oor.ToString();
  const std::vector<int64_t> negative = {-1, 2, 3};
  EXPECT_FALSE(code(negative, 48, false).ok());
  const std::vector<int64_t> dup = {3, 1, 3};
  EXPECT_TRUE(code(dup, 48, false).ok());
  EXPECT_NE(code(dup, 48, true).message().find("duplicate"), std::string::npos);

  std::vector<char> chunk(h.cache.chunk_bytes(48));
  auto small = h.copier->Gather(ids, 48, chunk.data(), chunk.size() - 1);
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  auto wrong_size = h.copier->Scatter(ids, 48, chunk.data(), chunk.size() + 16);
  EXPECT_EQ(wrong_size.status().code(), StatusCode::kInvalidArgument);
  auto null_chunk = h.copier->Gather(ids, 48, nullptr, chunk.size());
  EXPECT_EQ(null_chunk.status().code(), StatusCode::kInvalidArgument);
  CopyOptions kernel;
  kernel.mechanism = CopyMechanism::kSmKernel;
  EXPECT_FALSE(h.copier->Gather(ids, 48, chunk.data(), chunk.size(), kernel).ok());
  auto partial_gather = h.copier->Gather(ids, 47, chunk.data(), chunk.size());
  EXPECT_EQ(partial_gather.status().code(), StatusCode::kInvalidArgument);
}

TEST(PagedKvCacheTest, HostCopierNeedsHostMemory) {
  std::vector<char> mem(1 << 16);
  PagedKvCacheDesc d = OneTensor(mem.data(), 16, KvPageTensor::SinglePage(mem.data(), 4, 16, 64));
  d.memory = MemorySpace::kCuda;
  auto c = PagedKvCache::Create(d);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(NewHostKvCopier(*c).status().code(), StatusCode::kInvalidArgument);
#ifndef KVTIER_WITH_CUDA
  EXPECT_FALSE(CudaDataPathBuilt());
  EXPECT_EQ(NewCudaKvCopier(*c).status().code(), StatusCode::kUnimplemented);
#endif
}

TEST(PagedKvCacheTest, MechanismNames) {
  for (CopyMechanism m :
       {CopyMechanism::kAuto, CopyMechanism::kHostMemcpy, CopyMechanism::kCopyEngine,
        CopyMechanism::kSmKernel, CopyMechanism::kStaged}) {
    auto parsed = ParseCopyMechanism(CopyMechanismName(m));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, m);
  }
  EXPECT_FALSE(ParseCopyMechanism("warp-drive").ok());
}

// Gathers match the definition of the canonical layout for every shape, block size and a
// shuffled, non-contiguous id list.
TEST(HostCopierTest, GatherMatchesDefinition) {
  std::mt19937_64 rng(7);
  for (ShapeKind kind :
       {ShapeKind::kSplitKvPerLayer, ShapeKind::kPackedKvPerLayer, ShapeKind::kCrossLayer,
        ShapeKind::kMlaPerLayer, ShapeKind::kMlaCrossLayer}) {
    for (uint32_t tpb : {1u, 4u, 16u}) {
      for (uint64_t pad : {0u, 48u, 7u}) {
        HostCache h = HostCache::Make(kind, 3, tpb, 64 / tpb + 5, 40, pad, rng);
        const auto ids = gpu::testing::RandomIds(rng, h.cache.num_blocks(), 64 / tpb);
        EXPECT_EQ(h.Gather(ids), ReferenceGather(h.cache.desc(), ids))
            << int(kind) << " tpb " << tpb << " pad " << pad;
      }
    }
  }
}

// Adjacent pages merge into one segment; random ones do not; both cover the chunk exactly.
TEST(HostCopierTest, PlanMergesAdjacentPages) {
  std::mt19937_64 rng(3);
  HostCache h = HostCache::Make(ShapeKind::kSplitKvPerLayer, 2, 16, 32, 64, 0, rng);
  const std::vector<int64_t> consecutive = {4, 5, 6, 7};
  auto merged = gpu::PlanSegments(h.cache, consecutive, true);
  ASSERT_EQ(merged.size(), 4u);  // one per stream
  for (const auto& s : merged) EXPECT_EQ(s.bytes, 4u * 16 * 64);
  auto unmerged = gpu::PlanSegments(h.cache, consecutive, false);
  EXPECT_EQ(unmerged.size(), 16u);
  uint64_t total = 0;
  for (const auto& s : unmerged) total += s.bytes;
  EXPECT_EQ(total, h.cache.chunk_bytes(64));
  const std::vector<int64_t> backwards = {7, 6, 5, 4};
  EXPECT_EQ(gpu::PlanSegments(h.cache, backwards, true).size(), 16u);
}

// The point of the canonical layout: a chunk leaves one engine and enters another with a
// different block size and tensor arrangement, bit-exactly, without touching other blocks.
TEST(HostCopierTest, RoundTripAcrossBlockSizesAndLayouts) {
  std::mt19937_64 rng(11);
  const uint32_t layers = 4;
  const uint64_t tb = 256;
  const uint64_t tokens = 256;
  HostCache a = HostCache::Make(ShapeKind::kSplitKvPerLayer, layers, 16, 40, tb, 0, rng);
  HostCache b = HostCache::Make(ShapeKind::kCrossLayer, layers, 32, 20, tb, 32, rng);
  HostCache c = HostCache::Make(ShapeKind::kPackedKvPerLayer, layers, 8, 50, tb, 16, rng);
  const auto ids_a = gpu::testing::RandomIds(rng, 40, tokens / 16);
  const auto ids_b = gpu::testing::RandomIds(rng, 20, tokens / 32);
  const auto ids_c = gpu::testing::RandomIds(rng, 50, tokens / 8);
  const std::vector<char> chunk = a.Gather(ids_a);

  const std::vector<char> b_before = b.mem;
  b.Scatter(ids_b, chunk);
  EXPECT_EQ(b.Gather(ids_b), chunk);
  {  // Only the pages of ids_b changed.
    std::vector<bool> touched(b.mem.size(), false);
    for (const auto& seg : gpu::PlanSegments(b.cache, ids_b, false)) {
      const uint64_t off = seg.page - b.mem.data();
      for (uint64_t i = 0; i < seg.bytes; ++i) touched[off + i] = true;
    }
    uint64_t stray = 0;
    for (uint64_t i = 0; i < b.mem.size(); ++i) stray += !touched[i] && b.mem[i] != b_before[i];
    EXPECT_EQ(stray, 0u);
  }

  c.Scatter(ids_c, b.Gather(ids_b));
  EXPECT_EQ(c.Gather(ids_c), chunk);
  EXPECT_EQ(a.Gather(ids_a), chunk);
}

// A batch moves exactly what one call per chunk moves; a bad chunk anywhere in it is refused,
// naming the chunk, before anything is copied.
TEST(HostCopierTest, BatchedChunksMatchOneCallPerChunk) {
  std::mt19937_64 rng(17);
  HostCache src = HostCache::Make(ShapeKind::kSplitKvPerLayer, 3, 16, 40, 64, 0, rng);
  HostCache dst = HostCache::Make(ShapeKind::kSplitKvPerLayer, 3, 16, 40, 64, 0, rng);
  const uint64_t tokens = 64, bytes = src.cache.chunk_bytes(tokens);
  std::vector<std::vector<int64_t>> ids;
  for (int c = 0; c < 5; ++c) ids.push_back(gpu::testing::RandomIds(rng, 40, tokens / 16));
  std::vector<char> batch(5 * bytes, 0x11);
  std::vector<ChunkCopy> chunks;
  for (int c = 0; c < 5; ++c) chunks.push_back({ids[c], batch.data() + c * bytes, bytes});
  ASSERT_TRUE(src.copier->GatherChunks(chunks, tokens).ok());
  for (int c = 0; c < 5; ++c) {
    EXPECT_EQ(std::vector<char>(batch.begin() + c * bytes, batch.begin() + (c + 1) * bytes),
              src.Gather(ids[c]))
        << "chunk " << c;
  }

  // Scatter the batch into other (disjoint) blocks of another cache.
  std::vector<int64_t> all(40);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<std::vector<int64_t>> dst_ids;
  for (int c = 0; c < 5; ++c) dst_ids.emplace_back(all.begin() + 4 * c, all.begin() + 4 * c + 4);
  for (int c = 0; c < 5; ++c) chunks[c].block_ids = dst_ids[c];
  ASSERT_TRUE(dst.copier->ScatterChunks(chunks, tokens).ok());
  for (int c = 0; c < 5; ++c) EXPECT_EQ(dst.Gather(dst_ids[c]), src.Gather(ids[c]));

  // Refusals: a wrong size, a bad id or a null buffer in chunk 3 leaves every block untouched.
  const std::vector<char> before = dst.mem;
  std::vector<char> junk(5 * bytes, 0x77);
  for (int c = 0; c < 5; ++c) chunks[c].chunk = junk.data() + c * bytes;
  const std::vector<int64_t> bad_ids = {1, 2, 3, 99};
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<ChunkCopy> bad = chunks;
    if (variant == 0) bad[3].chunk_bytes = bytes - 1;
    if (variant == 1) bad[3].block_ids = bad_ids;
    if (variant == 2) bad[3].chunk = nullptr;
    auto r = dst.copier->ScatterChunks(bad, tokens);
    ASSERT_FALSE(r.ok()) << variant;
    EXPECT_NE(r.status().ToString().find("chunk 3 of 5"), std::string::npos)
        << r.status().ToString();
    EXPECT_TRUE(dst.mem == before) << "variant " << variant << " copied something";
  }
  EXPECT_TRUE(dst.copier->ScatterChunks({}, tokens).ok());  // nothing to do
}

// kSkipBlock: a scatter leaves the skipped blocks untouched and fills the others; gathers and
// duplicate checks still refuse it where it makes no sense.
TEST(HostCopierTest, ScatterSkipsBlocks) {
  std::mt19937_64 rng(13);
  HostCache h = HostCache::Make(ShapeKind::kSplitKvPerLayer, 3, 16, 12, 64, 0, rng);
  const std::vector<int64_t> ids = {5, 2, 9, 0};
  const std::vector<char> chunk = h.Gather(ids);
  HostCache dst = HostCache::Make(ShapeKind::kSplitKvPerLayer, 3, 16, 12, 64, 0, rng);
  const std::vector<char> before = dst.mem;
  const std::vector<int64_t> skip_two = {kSkipBlock, kSkipBlock, 7, 3};
  EXPECT_FALSE(dst.cache.CheckRequest(skip_two, 64, /*for_scatter=*/false).ok());
  const std::vector<int64_t> dup_after_skip = {kSkipBlock, 7, 7, 3};
  EXPECT_FALSE(dst.cache.CheckRequest(dup_after_skip, 64, true).ok());
  dst.Scatter(skip_two, chunk);
  // Blocks 7 and 3 hold the chunk's blocks 2 and 3; everything else is as it was.
  const std::vector<int64_t> tail = {9, 0};
  const std::vector<int64_t> tail_dst = {7, 3};
  const std::vector<char> expected_tail = h.Gather(tail);
  EXPECT_EQ(dst.Gather(tail_dst), expected_tail);
  std::vector<bool> touched(dst.mem.size(), false);
  for (const auto& seg : gpu::PlanSegments(dst.cache, skip_two, false)) {
    const uint64_t off = seg.page - dst.mem.data();
    for (uint64_t i = 0; i < seg.bytes; ++i) touched[off + i] = true;
  }
  uint64_t stray = 0;
  for (uint64_t i = 0; i < dst.mem.size(); ++i) stray += !touched[i] && dst.mem[i] != before[i];
  EXPECT_EQ(stray, 0u);
  EXPECT_EQ(gpu::PlanSegments(dst.cache, skip_two, false).size(), 3u * 2 * 2);
}

TEST(HostCopierTest, MlaRoundTrip) {
  std::mt19937_64 rng(5);
  // DeepSeek-like latent: 576 bf16 values per token and layer.
  HostCache a = HostCache::Make(ShapeKind::kMlaPerLayer, 3, 64, 10, 1152, 0, rng);
  HostCache b = HostCache::Make(ShapeKind::kMlaCrossLayer, 3, 16, 40, 1152, 16, rng);
  const auto ids_a = gpu::testing::RandomIds(rng, 10, 4);
  const auto ids_b = gpu::testing::RandomIds(rng, 40, 16);
  const auto chunk = a.Gather(ids_a);
  EXPECT_EQ(chunk.size(), 256u * 3 * 1152);
  b.Scatter(ids_b, chunk);
  EXPECT_EQ(b.Gather(ids_b), chunk);
}

}  // namespace
}  // namespace kvtier
