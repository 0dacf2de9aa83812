// Test helpers: a fixed namespace, numbered keys, and chunk contents derived from the key, so any
// process can tell a right chunk from a wrong one without sharing state.
#pragma once

#include <cstdint>
#include <span>

#include "kvtier/chunk_key.h"

namespace kvtier::testing {

KeyNamespace TestNamespace();
ChunkKey TestKey(uint64_t i);
// Fills `dst` with bytes determined by `key`.
void FillChunk(const ChunkKey& key, std::span<uint8_t> dst);
// True iff `data` is exactly what FillChunk(key) writes.
bool VerifyChunk(const ChunkKey& key, std::span<const uint8_t> data);

}  // namespace kvtier::testing
