#include "kvtier/chunk_key.h"

#include <numeric>
#include <unordered_set>

#include <gtest/gtest.h>

namespace kvtier {
namespace {

KeyNamespace Qwen() {
  KeyNamespace ns;
  ns.model_id = "Qwen/Qwen3-8B";
  ns.layout_fingerprint = 0x0123456789abcdefull;
  ns.chunk_tokens = 4;
  return ns;
}

std::vector<uint32_t> Iota(size_t n, uint32_t start = 0) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

// Golden vectors: these values define the key encoding (docs/chunk-key.md). If one changes,
// every cache written before becomes unreachable; bump the namespace version instead.
TEST(ChunkKeyTest, GoldenVectors) {
  KeyNamespace ns = Qwen();
  EXPECT_EQ(ns.Root().ToHex(), "6419fe86545df15be8b9b84c81eed28c8d52bd3b7939905bfd0eecd7bcdf26cb");
  EXPECT_EQ(ns.Id(), std::string("6419fe86545df15be8b9b84c81eed28c8d52bd3b7939905bfd0eecd7bcdf26cb").substr(0, 16));
  auto keys = ComputeChunkKeys(ns, Iota(10));
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->size(), 2u);  // the trailing 2 tokens form no full chunk
  EXPECT_EQ((*keys)[0].ToHex(), "ce919b35813315db02e8aa3a855099822bd33aa689c5ef5967e0131286d47f59");
  EXPECT_EQ((*keys)[1].ToHex(), "44667d31cd41b57d1286342a2de3f7e3f11ba799c02cb8842449f2925c2689ad");
  // The chain step alone: SHA-256 of 32 zero bytes followed by uint32 LE 1,2,3.
  std::vector<uint32_t> t = {1, 2, 3};
  EXPECT_EQ(ChainChunkKey(ChunkKey(), t).ToHex(), "3db346a400ab6b8db792fcf156443a8885b27db208362dcf77084f8c7648e645");
}

TEST(ChunkKeyTest, KeysNamePrefixesNotChunks) {
  KeyNamespace ns = Qwen();
  auto a = *ComputeChunkKeys(ns, Iota(8));
  std::vector<uint32_t> other = Iota(8);
  other[0] = 999;  // change the first chunk only
  auto b = *ComputeChunkKeys(ns, other);
  EXPECT_NE(a[0], b[0]);
  EXPECT_NE(a[1], b[1]);  // same second-chunk tokens, different prefix, different key
  // A longer sequence extends, never changes, the keys of its prefix.
  auto longer = *ComputeChunkKeys(ns, Iota(16));
  EXPECT_EQ(longer[0], a[0]);
  EXPECT_EQ(longer[1], a[1]);
}

TEST(ChunkKeyTest, EveryNamespaceFieldSeparates) {
  std::vector<KeyNamespace> variants(7, Qwen());
  variants[1].model_id = "Qwen/Qwen3-8B-FP8";
  variants[2].layout_fingerprint ^= 1;
  variants[3].chunk_tokens = 8;
  variants[4].rank = 1;
  variants[4].world_size = 2;
  variants[5].world_size = 2;
  variants[6].tenant_salt = "tenant-a";
  std::unordered_set<ChunkKey> roots, firsts;
  for (const auto& ns : variants) {
    roots.insert(ns.Root());
    firsts.insert((*ComputeChunkKeys(ns, Iota(16)))[0]);
  }
  EXPECT_EQ(roots.size(), variants.size());
  EXPECT_EQ(firsts.size(), variants.size());
}

TEST(ChunkKeyTest, FieldBoundariesAreUnambiguous) {
  KeyNamespace a = Qwen(), b = Qwen();
  a.model_id = "ab";
  a.tenant_salt = "c";
  b.model_id = "a";
  b.tenant_salt = "bc";
  EXPECT_NE(a.Root(), b.Root());
}

TEST(ChunkKeyTest, InvalidNamespacesAreRefused) {
  KeyNamespace ns = Qwen();
  ns.model_id = "";
  EXPECT_EQ(ComputeChunkKeys(ns, Iota(8)).status().code(), StatusCode::kInvalidArgument);
  ns = Qwen();
  ns.chunk_tokens = 0;
  EXPECT_FALSE(ComputeChunkKeys(ns, Iota(8)).ok());
  ns = Qwen();
  ns.rank = 2;
  ns.world_size = 2;
  EXPECT_FALSE(ns.Validate().ok());
}

TEST(ChunkKeyTest, OpaqueAndHexKeys) {
  std::vector<uint8_t> exact(32, 7);
  auto k = ChunkKey::FromOpaque(exact);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->bytes()[31], 7);
  std::vector<uint8_t> short_key = {1, 2, 3, 4, 5, 6, 7, 8};
  auto h = ChunkKey::FromOpaque(short_key);
  ASSERT_TRUE(h.ok());
  EXPECT_NE(*h, ChunkKey());
  EXPECT_EQ(*h, *ChunkKey::FromOpaque(short_key));
  EXPECT_FALSE(ChunkKey::FromOpaque({}).ok());
  auto round = ChunkKey::FromHex(h->ToHex());
  ASSERT_TRUE(round.ok());
  EXPECT_EQ(*round, *h);
  EXPECT_FALSE(ChunkKey::FromHex("xyz").ok());
  EXPECT_FALSE(ChunkKey::FromHex(std::string(64, 'g')).ok());
}

}  // namespace
}  // namespace kvtier
