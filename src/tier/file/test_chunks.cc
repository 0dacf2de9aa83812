#include "tier/file/test_chunks.h"

#include <cstring>
#include <string>

namespace kvtier::testing {
namespace {
// splitmix64: fast, and every 8-byte word depends on the key and its position.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t WordAt(const ChunkKey& key, uint64_t i) { return Mix(key.Hash64() ^ (i * 0x100000001b3ull)); }
}  // namespace

KeyNamespace TestNamespace() {
  KeyNamespace ns;
  ns.model_id = "test/file-tier";
  ns.layout_fingerprint = 0x0123456789abcdefull;
  ns.chunk_tokens = 16;
  return ns;
}

ChunkKey TestKey(uint64_t i) {
  std::string s = "file-tier-test-key-" + std::to_string(i);
  return ChunkKey::FromOpaque(std::span<const uint8_t>(
                                  reinterpret_cast<const uint8_t*>(s.data()), s.size()))
      .value();
}

void FillChunk(const ChunkKey& key, std::span<uint8_t> dst) {
  size_t i = 0;
  for (; i + 8 <= dst.size(); i += 8) {
    uint64_t w = WordAt(key, i / 8);
    std::memcpy(dst.data() + i, &w, 8);
  }
  uint64_t w = WordAt(key, i / 8);
  std::memcpy(dst.data() + i, &w, dst.size() - i);
}

bool VerifyChunk(const ChunkKey& key, std::span<const uint8_t> data) {
  size_t i = 0;
  for (; i + 8 <= data.size(); i += 8) {
    uint64_t w = WordAt(key, i / 8);
    if (std::memcmp(data.data() + i, &w, 8) != 0) return false;
  }
  uint64_t w = WordAt(key, i / 8);
  return std::memcmp(data.data() + i, &w, data.size() - i) == 0;
}

}  // namespace kvtier::testing
