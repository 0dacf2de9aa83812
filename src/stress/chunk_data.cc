#include "stress/chunk_data.h"

#include <cstring>

namespace kvtier::stress {
namespace {

uint64_t SplitMix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

KeyNamespace StressNamespace() {
  KeyNamespace ns;
  ns.model_id = "kvtier-stress";
  ns.chunk_tokens = 16;
  return ns;
}

std::vector<ChunkKey> ConversationKeys(int c) {
  std::vector<uint32_t> tokens(kMaxChunks * 16);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<uint32_t>(i < 16 ? (c / 4) * 1000 + i : c * 100000 + i);
  }
  return *ComputeChunkKeys(StressNamespace(), tokens);
}

void FillChunk(const ChunkKey& key, std::span<uint8_t> out) {
  uint64_t state;
  std::memcpy(&state, key.data(), 8);
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    uint64_t v = SplitMix(state);
    std::memcpy(out.data() + i, &v, 8);
  }
  for (uint64_t v = SplitMix(state); i < out.size(); ++i, v >>= 8) out[i] = static_cast<uint8_t>(v);
}

int64_t FirstWrongByte(const ChunkKey& key, std::span<const uint8_t> data,
                       std::vector<uint8_t>* scratch) {
  scratch->resize(data.size());
  FillChunk(key, *scratch);
  if (std::memcmp(scratch->data(), data.data(), data.size()) == 0) return -1;
  for (size_t i = 0; i < data.size(); ++i) {
    if ((*scratch)[i] != data[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace kvtier::stress
