// MemoryTier (L1): chunks in host memory, in one arena of fixed-size slots.
//
// The arena is allocated once at Open, pre-faulted, optionally on huge pages, and backed by a
// memory file descriptor (memfd) so that a server can hand the same pool to other processes,
// which map it and may register it with CUDA for direct DMA. Every slot holds one chunk
// (chunk_bytes rounded up to 4 KiB, so slots are O_DIRECT- and DMA-aligned); there is no
// fragmentation and no allocation after Open.
//
// A slot moves through: free -> reserved (being filled by a store, invisible to readers) ->
// resident (visible; may be pinned by readers) -> evicted or removed -> free. Pinned slots are
// never evicted, so a reader can copy out of a slot without holding any lock. Eviction asks an
// EvictionPolicy (LRU or prefix-aware). When a *dirty* chunk (one not yet in a lower tier) is
// evicted, the eviction sink is called with its data before the slot is reused (write-back).
//
// Thread-safety: every method is thread-safe. No lock is held while the eviction sink runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/eviction.h"
#include "kvtier/status.h"

namespace kvtier {

struct MemoryTierOptions {
  uint64_t capacity_bytes = 1ull << 30;  // arena size; holds capacity_bytes / slot_bytes chunks
  uint64_t chunk_bytes = 0;              // REQUIRED: bytes of one chunk, 1 B .. 16 GiB
  EvictionPolicyKind eviction = EvictionPolicyKind::kPrefixAware;
  bool huge_pages = false;  // try 2 MiB huge pages; falls back to 4 KiB pages with a warning
  bool prefault = true;     // fault every page in at Open, so the first stores run at full speed
};

struct MemoryTierStats {
  uint64_t capacity_bytes = 0;
  uint64_t slot_bytes = 0;
  uint32_t num_slots = 0;
  uint32_t resident = 0;  // committed chunks
  uint32_t pinned = 0;    // slots with at least one reader
  bool huge_pages = false;
  uint64_t lookups = 0, hits = 0, misses = 0;
  uint64_t bytes_in = 0, bytes_out = 0;  // counted by the engine as it copies
  uint64_t evictions = 0, write_backs = 0, rejections = 0, errors = 0;
};

// Called with a dirty chunk that is being evicted, before its slot is reused; runs on the thread
// that needed the slot, with no lock held.
using EvictionSink = std::function<void(const ChunkKey& key, std::span<const uint8_t> data)>;

class MemoryTier {
 public:
  // Fails with kInvalidArgument for chunk_bytes 0 or over 16 GiB, or a capacity below one slot;
  // with kNoSpace/kIOError if the arena cannot be created.
  static Result<std::unique_ptr<MemoryTier>> Open(const MemoryTierOptions& options);
  ~MemoryTier();
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  // Must be set before the first Reserve if write-back is wanted.
  void SetEvictionSink(EvictionSink sink);

  // The arena, for sharing with other processes: an fd that maps to base() at offset 0.
  int fd() const { return fd_; }
  uint8_t* base() const { return base_; }
  uint64_t arena_bytes() const { return arena_bytes_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint32_t num_slots() const { return num_slots_; }
  uint64_t SlotOffset(SlotId slot) const { return static_cast<uint64_t>(slot) * slot_bytes_; }
  // The chunk_bytes of `slot`. Valid to read while pinned, to write while reserved.
  std::span<uint8_t> SlotData(SlotId slot) const {
    return {base_ + SlotOffset(slot), chunk_bytes_};
  }

  // How many leading keys are resident. Counts one lookup and hits/misses.
  size_t LookupPrefix(std::span<const ChunkKey> keys);
  bool Contains(const ChunkKey& key) const;

  // Pins a resident chunk for reading and marks it recently used. kNotFound if absent.
  Result<SlotId> Pin(const ChunkKey& key);
  void Unpin(SlotId slot);

  struct Reservation {
    SlotId slot = kNoSlot;        // to fill, then Commit or Abort
    bool already_present = false; // the key is resident or being stored: nothing to do
  };
  // Reserves a slot for `key`, evicting the policy's victim if no slot is free. `parent` is the
  // key of the previous chunk of the same prefix (for the prefix-aware policy), or null.
  // kRejected if every slot is pinned or reserved. May run the eviction sink (blocking I/O).
  Result<Reservation> Reserve(const ChunkKey& key, const ChunkKey* parent);
  // Publishes a reserved slot. `dirty`: the chunk exists in no lower tier yet.
  void Commit(SlotId slot, bool dirty);
  // Gives a reserved slot back unpublished.
  void Abort(SlotId slot);
  // Marks a resident chunk as safely stored in a lower tier (no write-back needed).
  void MarkClean(const ChunkKey& key);
  // Keys of the resident chunks that are dirty (in no lower tier yet).
  std::vector<ChunkKey> DirtyKeys() const;
  // Removes a resident, unpinned chunk. kNotFound if absent, kRejected if pinned.
  Status Remove(const ChunkKey& key);

  void AddBytesIn(uint64_t n) { bytes_in_.fetch_add(n, std::memory_order_relaxed); }
  void AddBytesOut(uint64_t n) { bytes_out_.fetch_add(n, std::memory_order_relaxed); }
  MemoryTierStats Stats() const;

 private:
  enum class SlotState : uint8_t { kFree, kReserved, kResident };
  struct Slot {
    ChunkKey key;
    ChunkKey parent;
    bool has_parent = false;
    SlotState state = SlotState::kFree;
    bool dirty = false;
    uint32_t pins = 0;
  };

  MemoryTier() = default;
  void ReleaseSlotLocked(SlotId slot);

  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t arena_bytes_ = 0, slot_bytes_ = 0, chunk_bytes_ = 0;
  uint32_t num_slots_ = 0;
  bool huge_pages_ = false;
  EvictionSink sink_;

  mutable std::mutex mu_;
  std::unordered_map<ChunkKey, SlotId, ChunkKeyHash> index_;  // reserved and resident keys
  std::vector<Slot> slots_;
  std::vector<SlotId> free_;
  std::unique_ptr<EvictionPolicy> policy_;
  uint32_t resident_ = 0, pinned_ = 0;
  uint64_t lookups_ = 0, hits_ = 0, misses_ = 0;
  uint64_t evictions_ = 0, write_backs_ = 0, rejections_ = 0;
  std::atomic<uint64_t> bytes_in_{0}, bytes_out_{0};
};

}  // namespace kvtier
