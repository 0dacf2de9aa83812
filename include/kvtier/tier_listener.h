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

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvtier/chunk_key.h"

namespace kvtier {

// The most bytes of descriptor a chunk file's header holds (docs/file-format.md).
inline constexpr size_t kMaxChunkDescriptorBytes = 2920;

enum class TierId : uint8_t {
  kMemory = 0,  // L1 (MemoryTier)
  kFile = 1,    // the file tier (FileTier), on any backend
};

class TierListener {
 public:
  virtual ~TierListener() = default;
  // `key` (the key the tier stores it under) entered the tier's index (`stored`) or left it.
  virtual void OnTierChange(TierId tier, const ChunkKey& key, bool stored) noexcept = 0;
  // What the file tier writes into the header of the chunk file it is about to write for `key`
  // (docs/file-format.md, "The descriptor"): opaque bytes, at most kMaxChunkDescriptorBytes (more
  // are left out); empty for none. Called on a write thread, under no tier lock, before the
  // header is encoded; the same rules hold: return at once, never wait on the tier.
  virtual std::string ChunkDescriptor(const ChunkKey& key) noexcept {
    (void)key;
    return {};
  }
};

}  // namespace kvtier
