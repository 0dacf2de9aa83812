// vLLM's KV-cache events as msgpack (docs/kv-events.md, "Wire format"), and the descriptors
// clients send with `describe` (docs/protocol.md), parsed and checked.
//
// Events are vLLM 0.24+'s tagged maps: first "type", then the fields in vLLM's declaration order,
// required fields always (nil where unset), optional ones only when set (msgspec's
// omit_defaults). A batch is KVEventBatch's array [ts, events, data_parallel_rank]. Integers take
// msgpack's shortest form, as msgspec writes them, so the bytes equal vLLM's own
// (events_test.cc pins them).
//
// Thread-safety: pure functions over values.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::events {

// A block hash as the events carry it, already msgpack-encoded: an unsigned integer (vLLM's
// default int hashes) or bin of at most 32 bytes. Compared and hashed as bytes.
using PackedHash = std::string;
PackedHash PackUintHash(uint64_t h);
PackedHash PackBinHash(std::string_view bytes);  // REQUIRES: bytes.size() <= 32
inline const PackedHash kNilHash = std::string(1, '\xc0');

// What a client says about one chunk (a `describe` entry), checked.
struct Descriptor {
  uint32_t index = 0;       // the chunk's index in its prefix
  uint32_t block_size = 0;  // vLLM's block size; 0 only without token ids
  int64_t group_idx = 0;
  std::vector<PackedHash> block_hashes;  // n >= 1
  PackedHash parent = kNilHash;          // the block before the chunk; nil for index 0
  std::vector<uint32_t> token_ids;       // empty when not sent; else chunk_tokens of them
  std::optional<int64_t> lora_id;
  std::optional<std::string> lora_name;
  std::optional<std::string> extra_keys;  // one msgpack value, copied verbatim

  bool operator==(const Descriptor&) const = default;
  // Bytes this descriptor holds in memory (for the bound on pending descriptors).
  size_t MemoryBytes() const;
};

// Parses and checks a descriptor (docs/protocol.md, `describe`): the keys' types, at most
// chunk_tokens hashes, n * block_size == chunk_tokens where block_size > 0, token ids (if any)
// exactly chunk_tokens little-endian uint32, extra_keys one well-formed msgpack value. Unknown
// keys are ignored. kInvalidArgument naming the problem otherwise.
Result<Descriptor> ParseDescriptor(std::span<const uint8_t> bytes, uint32_t chunk_tokens);
// The msgpack map ParseDescriptor reads (for clients and tests).
std::string EncodeDescriptor(const Descriptor& d);

// What a chunk file's header carries for the events (docs/file-format.md, "The descriptor";
// descriptor format 1), so that a host that finds the file (another host, or a restart) can
// announce it: the group the chunk belongs to (the client's namespace without its rank), what
// the group is, the shard's rank, the client's key of the chunk and its `describe` map.
struct FileDescriptor {
  uint64_t group = 0;
  std::string model_id;
  uint32_t chunk_tokens = 0;
  uint32_t world_size = 1;
  uint32_t rank = 0;
  std::array<uint8_t, 32> client_key{};
  Descriptor descriptor;

  bool operator==(const FileDescriptor&) const = default;
};
// The msgpack map of a FileDescriptor, as small as fits in `max_bytes`: whole, else without
// extra_keys, else without token ids too (location-only events); empty when even that does not
// fit (or the model id is over 1,024 bytes).
std::string EncodeFileDescriptor(const FileDescriptor& f, size_t max_bytes);
// Parses and checks one (the descriptor as ParseDescriptor does, with the file's chunk_tokens).
// kInvalidArgument naming the problem.
Result<FileDescriptor> ParseFileDescriptor(std::span<const uint8_t> bytes);

// One BlockStored event.
struct StoredEvent {
  std::span<const PackedHash> block_hashes;
  PackedHash parent = kNilHash;
  std::span<const uint32_t> token_ids;  // empty: location-only ([])
  uint32_t block_size = 0;
  std::optional<int64_t> lora_id;
  std::string_view medium;
  std::optional<std::string_view> lora_name;
  std::optional<std::string_view> extra_keys;  // msgpack, verbatim
  std::optional<int64_t> group_idx;
};
std::string EncodeBlockStored(const StoredEvent& e);
std::string EncodeBlockRemoved(std::span<const PackedHash> block_hashes, std::string_view medium,
                               std::optional<int64_t> group_idx);
std::string EncodeAllBlocksCleared();
// KVEventBatch: [ts, [events...], data_parallel_rank], each event already encoded.
std::string EncodeBatch(double ts, std::span<const std::string> events, int64_t dp_rank = 0);

}  // namespace kvtier::events
