// What the verifying clients store: keys and bytes that any process of a run can recompute, so
// that a client checks a chunk another process stored (or a server restored from its file tier)
// without asking anyone. The adversary uses the same keys to aim at the clients' chunks.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvtier/chunk_key.h"

namespace kvtier::stress {

// Conversation c: up to kMaxChunks chunks. Conversations share prefixes (c / 4 picks the first
// chunk's tokens), so clients meet on common chunks as real tenants of one model do.
inline constexpr int kConversations = 48;
inline constexpr int kMaxChunks = 12;

// The namespace every verifying client declares.
KeyNamespace StressNamespace();

// The kMaxChunks keys of conversation c, in [0, kConversations).
std::vector<ChunkKey> ConversationKeys(int c);

// The bytes of `key`'s chunk, as many as `out` holds.
void FillChunk(const ChunkKey& key, std::span<uint8_t> out);

// The offset of the first byte of `data` that is not FillChunk's for `key`, or -1. `scratch`
// is reused between calls.
int64_t FirstWrongByte(const ChunkKey& key, std::span<const uint8_t> data,
                       std::vector<uint8_t>* scratch);

}  // namespace kvtier::stress
