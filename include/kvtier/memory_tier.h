// MemoryTier (L1): chunks in host memory, in one arena of fixed-size slots.
//
// The arena is allocated once at Open, pre-faulted, optionally on (transparent) huge pages, and
// backed by a memory file descriptor (memfd) so that a server can hand the same pool to other
// processes, which map it and may register it with CUDA for direct DMA. A process that punches
// holes in it (the descriptor is read-write) costs the chunks there their data, never anyone a
// SIGBUS: holes in shared memory read as zeros and refill on the next touch. Every slot holds one chunk
// (chunk_bytes rounded up to 4 KiB, so slots are O_DIRECT- and DMA-aligned); there is no
// fragmentation and no allocation after Open.
//
// A slot moves through: free -> reserved (being filled by a store, invisible to readers) ->
// resident (visible; may be pinned by readers) -> evicted or removed -> free. Pinned slots are
// never evicted, so a reader can copy out of a slot without holding any lock. Eviction asks an
// EvictionPolicy (LRU or prefix-aware).
//
// A *dirty* chunk is one not yet in a lower tier. Reserve never does I/O: it evicts the policy's
// first *clean* victim, and only when every evictable chunk is dirty does it evict a dirty one,
// whose data is then lost to the lower tiers (counted in dirty_evictions and reported in the
// Reservation). Keeping clean victims ready is the job of a flusher (the engine's): it takes the
// dirty chunks next in eviction order (TakeFlushCandidates), writes them down from their pinned
// slots, and reports each with EndClean.
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/eviction.h"
#include "kvtier/status.h"
#include "kvtier/tier_listener.h"

namespace kvtier {

struct MemoryTierOptions {
  uint64_t capacity_bytes = 1ull << 30;  // arena size; holds capacity_bytes / slot_bytes chunks
  uint64_t chunk_bytes = 0;              // REQUIRED: bytes of one chunk, 1 B .. 16 GiB
  EvictionPolicyKind eviction = EvictionPolicyKind::kPrefixAware;
  // Ask for 2 MiB pages (transparent huge pages for shared memory, never hugetlbfs: see
  // MapArena); 4 KiB pages with a warning where the kernel's shmem_enabled setting refuses.
  bool huge_pages = false;
  bool prefault = true;     // fault every page in at Open, so the first stores run at full speed
  // Told of every commit, eviction and removal (kvtier/tier_listener.h); none when null.
  std::shared_ptr<TierListener> listener;
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
  uint32_t dirty = 0;                    // resident chunks in no lower tier yet
  uint32_t cleaning = 0;                 // dirty chunks being written to a lower tier now
  uint64_t evictions = 0, rejections = 0, errors = 0;
  uint64_t dirty_evictions = 0;  // dirty chunks evicted before they reached a lower tier
  // Reservations under Victims::kCleanOnly refused because only dirty chunks were evictable.
  uint64_t dirty_refusals = 0;
};

class MemoryTier {
 public:
  // Fails with kInvalidArgument for chunk_bytes 0 or over 16 GiB, or a capacity below one slot;
  // with kNoSpace/kIOError if the arena cannot be created.
  static Result<std::unique_ptr<MemoryTier>> Open(const MemoryTierOptions& options);
  ~MemoryTier();
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

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
    SlotId slot = kNoSlot;         // to fill, then Commit or Abort
    bool already_present = false;  // the key is resident or being stored: nothing to do
    // Making room evicted a dirty chunk (no clean one was evictable): it is in no lower tier.
    bool evicted_dirty = false;
    ChunkKey evicted_key;  // that chunk, when evicted_dirty
  };
  // Which chunks Reserve may evict to make room.
  enum class Victims {
    kAny,        // a dirty one when no clean chunk is evictable (a store: its data must land)
    kCleanOnly,  // never a dirty one (a promotion whose data a lower tier holds anyway)
  };
  // Reserves a slot for `key`, evicting the policy's first clean victim if no slot is free (a
  // dirty one if no clean chunk is evictable and `victims` allows it). `parent` is the key of
  // the previous chunk of the same prefix (for the prefix-aware policy), or null. kRejected if
  // every slot is pinned or reserved (counted in rejections), or under kCleanOnly if only dirty
  // chunks are evictable (counted in dirty_refusals). Never blocks on I/O.
  Result<Reservation> Reserve(const ChunkKey& key, const ChunkKey* parent,
                              Victims victims = Victims::kAny);
  // Publishes a reserved slot. `dirty`: the chunk exists in no lower tier yet.
  void Commit(SlotId slot, bool dirty);
  // Gives a reserved slot back unpublished.
  void Abort(SlotId slot);
  // Keys of the resident chunks that are dirty (in no lower tier yet).
  std::vector<ChunkKey> DirtyKeys() const;

  // --- Cleaning: writing dirty chunks to a lower tier. ---
  struct Dirty {
    ChunkKey key;
    SlotId slot = kNoSlot;
  };
  // Starts cleaning `key`: pins its slot (without touching its recency) for the writer to read.
  // kNotFound if it is absent or clean; kRejected if another writer is cleaning it now (whose
  // write may yet fail: the chunk is then dirty again).
  Result<SlotId> BeginClean(const ChunkKey& key);
  // The flusher's work: while fewer than `headroom` slots are free or being cleaned, the dirty
  // chunks among the next `headroom - free - cleaning` evictable chunks in eviction order, at
  // most `max` of them, each begun as by BeginClean.
  std::vector<Dirty> TakeFlushCandidates(uint32_t headroom, size_t max);
  // Ends a cleaning begun above: `stored` marks the chunk clean; the slot is unpinned.
  void EndClean(SlotId slot, bool stored);
  // Removes a resident, unpinned chunk. kNotFound if absent, kRejected if pinned.
  Status Remove(const ChunkKey& key);

  void AddBytesIn(uint64_t n) { bytes_in_.fetch_add(n, std::memory_order_relaxed); }
  void AddBytesOut(uint64_t n) { bytes_out_.fetch_add(n, std::memory_order_relaxed); }
  MemoryTierStats Stats() const;

 private:
  // The slot table: each slot's state, the index of reserved and resident keys, the free list
  // and the eviction policy, with their counters, under one mutex (memory_tier.cc).
  class Table;
  MemoryTier() = default;

  // The arena, fixed at Open and read without a lock: SlotData is on every copy's path.
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t arena_bytes_ = 0, slot_bytes_ = 0, chunk_bytes_ = 0;
  uint32_t num_slots_ = 0;
  bool huge_pages_ = false;

  std::unique_ptr<Table> table_;
  std::atomic<uint64_t> bytes_in_{0}, bytes_out_{0};  // counted by the engine, without the lock
};

}  // namespace kvtier
