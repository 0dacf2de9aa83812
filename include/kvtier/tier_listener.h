// TierListener: told of every change to what a tier's index holds, a chunk becoming loadable
// from it or ceasing to be, so that KV-cache events (docs/kv-events.md) can mirror the tiers.
//
// A tier calls it under the lock that orders the change, so the calls for one key arrive in the
// order of the changes. An implementation must therefore return at once: no I/O, no waiting, no
// lock a tier could hold, no call back into the tier (the events publisher pushes a small record
// into a bounded lock-free queue and drops it when the queue is full).
//
// Thread-safety: called from any thread of the tiers, concurrently.
#pragma once

#include <cstdint>

#include "kvtier/chunk_key.h"

namespace kvtier {

enum class TierId : uint8_t {
  kMemory = 0,  // L1 (MemoryTier)
  kFile = 1,    // the file tier (FileTier), on any backend
};

class TierListener {
 public:
  virtual ~TierListener() = default;
  // `key` (the key the tier stores it under) entered the tier's index (`stored`) or left it.
  virtual void OnTierChange(TierId tier, const ChunkKey& key, bool stored) noexcept = 0;
};

}  // namespace kvtier
