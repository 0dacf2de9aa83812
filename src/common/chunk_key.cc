#include "kvtier/chunk_key.h"

#include <fmt/format.h>

#include "common/sha256.h"

namespace kvtier {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

Result<ChunkKey> ChunkKey::FromOpaque(std::span<const uint8_t> bytes) {
  if (bytes.empty()) return Status::InvalidArgument("opaque chunk key is empty");
  if (bytes.size() == kSize) {
    std::array<uint8_t, kSize> a;
    std::memcpy(a.data(), bytes.data(), kSize);
    return ChunkKey(a);
  }
  Sha256 h;
  h.UpdateString("kvtier/opaque/v1");
  h.Update(bytes.data(), bytes.size());
  return ChunkKey(h.Final());
}

Result<ChunkKey> ChunkKey::FromHex(std::string_view hex) {
  if (hex.size() != 2 * kSize) {
    return Status::InvalidArgument(fmt::format("chunk key must be 64 hex digits, got {}", hex.size()));
  }
  std::array<uint8_t, kSize> a;
  for (size_t i = 0; i < kSize; ++i) {
    int hi = HexValue(hex[2 * i]), lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return Status::InvalidArgument("chunk key has a non-hex digit");
    a[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return ChunkKey(a);
}

std::string ChunkKey::ToHex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * kSize, '0');
  for (size_t i = 0; i < kSize; ++i) {
    out[2 * i] = kDigits[bytes_[i] >> 4];
    out[2 * i + 1] = kDigits[bytes_[i] & 15];
  }
  return out;
}

Status KeyNamespace::Validate() const {
  if (model_id.empty()) return Status::InvalidArgument("namespace model_id is empty");
  if (model_id.size() > 1024) return Status::InvalidArgument("namespace model_id is over 1 KiB");
  if (tenant_salt.size() > 1024) return Status::InvalidArgument("tenant salt is over 1 KiB");
  if (chunk_tokens == 0 || chunk_tokens > (1u << 20)) {
    return Status::InvalidArgument(
        fmt::format("chunk_tokens must be in [1, 1048576], got {}", chunk_tokens));
  }
  if (world_size == 0 || rank >= world_size) {
    return Status::InvalidArgument(
        fmt::format("rank {} is not below world size {}", rank, world_size));
  }
  return Status::Ok();
}

ChunkKey KeyNamespace::Root() const {
  Sha256 h;
  h.UpdateString("kvtier/namespace/v1");
  h.UpdateString(model_id);
  h.UpdateU64(layout_fingerprint);
  h.UpdateU32(chunk_tokens);
  h.UpdateU32(rank);
  h.UpdateU32(world_size);
  h.UpdateString(tenant_salt);
  return ChunkKey(h.Final());
}

std::string KeyNamespace::Id() const { return Root().ToHex().substr(0, 16); }

ChunkKey ChainChunkKey(const ChunkKey& prev, std::span<const uint32_t> tokens) {
  Sha256 h;
  h.Update(prev.data(), ChunkKey::kSize);
  for (uint32_t t : tokens) h.UpdateU32(t);
  return ChunkKey(h.Final());
}

Result<std::vector<ChunkKey>> ComputeChunkKeys(const KeyNamespace& ns,
                                               std::span<const uint32_t> tokens) {
  KVTIER_RETURN_IF_ERROR(ns.Validate());
  std::vector<ChunkKey> keys;
  keys.reserve(tokens.size() / ns.chunk_tokens);
  ChunkKey prev = ns.Root();
  for (size_t start = 0; start + ns.chunk_tokens <= tokens.size(); start += ns.chunk_tokens) {
    prev = ChainChunkKey(prev, tokens.subspan(start, ns.chunk_tokens));
    keys.push_back(prev);
  }
  return keys;
}

}  // namespace kvtier
