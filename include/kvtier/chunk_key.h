// Chunk keys: 32-byte names for chunks of KV cache, chained over a token prefix.
//
//   root   = SHA-256("kvtier/namespace/v1" || canonical namespace fields)
//   key[0] = SHA-256(root || tokens of chunk 0 as little-endian uint32)
//   key[i] = SHA-256(key[i-1] || tokens of chunk i)
//
// so a key names a whole prefix, not just its last chunk. The namespace binds the model id, the
// layout fingerprint, the chunk size in tokens, the tensor-parallel rank and world size, and an
// optional tenant salt: two namespaces never produce the same key. Keys are identical across
// processes, runs, hosts and languages (docs/chunk-key.md pins the encoding; tests pin golden
// vectors). SHA-256 is used so that a tenant cannot forge another prefix's key.
//
// Callers that already have keys (an inference engine's block hashes) can wrap them with
// ChunkKey::FromOpaque instead.
//
// Thread-safety: all functions are pure; ChunkKey and KeyNamespace are values.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/status.h"

namespace kvtier {

class ChunkKey {
 public:
  static constexpr size_t kSize = 32;

  ChunkKey() { bytes_.fill(0); }
  explicit ChunkKey(const std::array<uint8_t, kSize>& bytes) : bytes_(bytes) {}

  // Wraps caller-supplied key bytes: exactly 32 bytes are used as they are; any other non-empty
  // length is hashed (SHA-256 of "kvtier/opaque/v1" || bytes) to 32. Empty input is refused.
  static Result<ChunkKey> FromOpaque(std::span<const uint8_t> bytes);
  // Parses 64 hex digits.
  static Result<ChunkKey> FromHex(std::string_view hex);

  const std::array<uint8_t, kSize>& bytes() const { return bytes_; }
  const uint8_t* data() const { return bytes_.data(); }
  std::string ToHex() const;
  // First 8 bytes as an integer: already uniformly distributed, a good hash-table hash.
  uint64_t Hash64() const {
    uint64_t h;
    std::memcpy(&h, bytes_.data(), sizeof(h));
    return h;
  }

  auto operator<=>(const ChunkKey&) const = default;

 private:
  std::array<uint8_t, kSize> bytes_;
};

struct ChunkKeyHash {
  size_t operator()(const ChunkKey& k) const { return static_cast<size_t>(k.Hash64()); }
};

// What a key is scoped to. Two engines share chunks only if every field matches.
struct KeyNamespace {
  std::string model_id;             // e.g. "Qwen/Qwen3-8B"
  uint64_t layout_fingerprint = 0;  // Layout::Fingerprint()
  uint32_t chunk_tokens = 256;
  uint32_t rank = 0;                // tensor-parallel rank of this shard
  uint32_t world_size = 1;          // tensor-parallel world size
  std::string tenant_salt;          // optional; separates tenants sharing one store

  // Checks the fields: model_id non-empty and at most 1 KiB, chunk_tokens in [1, 1<<20],
  // rank < world_size.
  Status Validate() const;
  // The root key: hash of the canonical encoding of every field.
  ChunkKey Root() const;
  // 16 hex digits derived from Root(): the directory name of this namespace on shared storage.
  std::string Id() const;
};

// key = SHA-256(prev || little-endian uint32 tokens). REQUIRES: tokens non-empty.
ChunkKey ChainChunkKey(const ChunkKey& prev, std::span<const uint32_t> tokens);

// Keys of every full chunk of `tokens` (a trailing partial chunk gets no key: only full chunks
// are stored). Fails if the namespace is invalid.
Result<std::vector<ChunkKey>> ComputeChunkKeys(const KeyNamespace& ns,
                                               std::span<const uint32_t> tokens);

}  // namespace kvtier

template <>
struct std::hash<kvtier::ChunkKey> {
  size_t operator()(const kvtier::ChunkKey& k) const { return static_cast<size_t>(k.Hash64()); }
};
