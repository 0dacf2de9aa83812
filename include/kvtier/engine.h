// Engine: the tiered KV-chunk store an inference engine talks to.
//
//   auto engine = Engine::Open(options);            // validates everything once
//   LookupResult hit = engine->Lookup(keys);         // leading chunks available, per tier
//   auto op = engine->Load(keys, destinations);      // asynchronous; returns a handle
//   OpResult r = op->Wait();                         // r.chunks leading chunks were loaded
//
// Tiers: L1 is the host-memory MemoryTier; L2, when configured, is a FileTier on a local or
// shared filesystem. Write policies decide when L1's chunks reach L2, and what an acknowledged
// store is promised (docs/protocol.md, "What a store is promised"):
//   kWriteThrough: every store also goes to L2, asynchronously. An acknowledged store is kept:
//                  it stays in L1 until L2 has it (or, if L2 fails it, until a retry succeeds),
//                  and a store that could only be placed by evicting such a chunk is refused
//                  (kRejected, retryable; counted in MemoryTierStats::dirty_refusals):
//                  backpressure, never a silent loss;
//   kWriteBack:    a chunk goes to L2 only as it nears eviction from L1 (and is not there yet).
//                  An acknowledged store is in L1; stores that outrun the disk for longer than
//                  the flusher's headroom absorbs evict chunks before they reach L2 (counted in
//                  EngineStats::dirty_evictions and logged): the newest data wins;
//   kNone:         L2 is only read (chunks other hosts wrote), never written.
// No store waits on L2. A background flusher keeps the chunks next in L1's eviction order clean
// (written to L2) at the disk's pace, `flush_headroom` of L1's slots ahead, so evictions find
// clean victims. A chunk that is lost or refused is recomputed on a later miss, as it would be
// without kvtier.
//
// Store and Load copy between caller memory and L1 on a fixed worker pool whose bounded queue
// refuses (kRejected) rather than blocks. Loads deliver the longest available prefix; a chunk
// after a miss is not loaded. A load from L2 is read into the file tier's own buffer and takes
// an L1 slot only once the data is there; it is reported as a miss if it misses the load
// deadline, so a stalled storage server never stalls inference (the caller recomputes) and holds
// no L1 slot while it hangs.
//
// Thread-safety: every method is thread-safe. Caller buffers must stay valid until the
// operation's handle reports done.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/file_tier.h"
#include "kvtier/memory_tier.h"
#include "kvtier/status.h"
#include "kvtier/store.h"

namespace kvtier {

enum class WritePolicy : uint8_t { kWriteThrough, kWriteBack, kNone };
Result<WritePolicy> ParseWritePolicy(std::string_view name);  // write_through|write_back|none
std::string_view WritePolicyName(WritePolicy policy);

struct EngineOptions {
  KeyNamespace ns;           // REQUIRED: model id etc.; validated at Open
  uint64_t chunk_bytes = 0;  // REQUIRED: bytes of one chunk (Layout::bytes_per_chunk)
  MemoryTierOptions memory;  // its chunk_bytes is taken from above
  // L2, if set. Its ns and chunk_bytes are taken from above.
  std::optional<FileTierOptions> file;
  WritePolicy write_policy = WritePolicy::kWriteBack;
  bool promote_on_load = true;  // chunks loaded from L2 stay in L1 afterwards
  // A load still waiting on L2 this long after it started reports the missing chunks as misses
  // (the caller recomputes them). Zero = no deadline.
  std::chrono::milliseconds load_deadline{2000};
  int worker_threads = 2;           // copy threads for Store and Load
  size_t max_queued_chunks = 1024;  // per-chunk tasks queued before Store/Load are rejected
  // The share of L1's slots, in eviction order, the flusher keeps clean or free (0 < x <= 1).
  // Larger absorbs longer bursts of stores without losing chunks to L2, at the price of
  // writing chunks that might have been overwritten or evicted clean later.
  double flush_headroom = 0.125;
};

// A handle to an asynchronous Store or Load. Copyable; thread-safe.
class OpHandle {
 public:
  struct State;
  explicit OpHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
  bool Done() const;
  OpResult Wait() const;
  // The result if done within `timeout`, else nullopt (the operation goes on).
  std::optional<OpResult> WaitFor(std::chrono::nanoseconds timeout) const;
  // Completion notification: `done` runs once with the result when the operation ends (every
  // chunk reported, its deadline passed, or the engine shut down), on the thread that ended it
  // (an engine or file-tier thread, or the engine's deadline thread), or here at once if it has
  // ended already. It must not block. Nothing needs to wait on the handle: a load ends at its
  // deadline on its own. REQUIRES: called at most once per operation.
  void OnDone(std::function<void(const OpResult&)> done) const;

 private:
  std::shared_ptr<State> state_;
};

struct TierCounters {
  // Chunks Lookup() found in this tier (hits) or asked of it and did not find (misses).
  uint64_t lookups = 0, hits = 0, misses = 0;
  uint64_t served = 0;  // chunks this tier delivered to loads (what a hit is worth)
  uint64_t bytes_in = 0, bytes_out = 0;
  uint64_t evictions = 0, rejections = 0, errors = 0;
};

struct EngineStats {
  TierCounters memory;
  MemoryTierStats memory_detail;
  bool has_file = false;
  TierCounters file;
  FileTierStats file_detail;
  uint64_t promotions = 0;       // chunks copied from L2 into L1 by loads
  uint64_t shared_reads = 0;     // chunks a load took from another load's L2 read under way
  uint64_t deadline_misses = 0;  // chunks reported missing because L2 missed the load deadline
  // Write-through chunks L2's full write queue refused: retried as writes complete (deferred),
  // or, past the bound, left dirty in L1 for the flusher (dropped). Both logged.
  uint64_t write_through_deferred = 0, write_through_dropped = 0;
  uint64_t write_backs = 0;          // chunks the flusher wrote to L2
  uint64_t write_back_failures = 0;  // flusher writes L2 refused or failed (retried later)
  uint64_t dirty_evictions = 0;      // chunks evicted from L1 before they reached L2 (lost)
  uint64_t dirty_refusals = 0;       // memory_detail.dirty_refusals, with the engine's counters
  uint64_t stores = 0, loads = 0, rejected_ops = 0;
};

// The schema of the engine's counters: one row per counter, from which the server's /stats and
// /metrics and the Python binding's stats dicts are all written, so that a new counter is its
// field and one row, and the four cannot drift apart. `name` is the key in /stats and in Python;
// in Prometheus a tier's counter is kvtier_<name>_total{tier=...} and an engine counter a series
// of kvtier_engine_ops_total{op=...}. engine.cc checks at compile time that every counter field
// has its row.
struct TierCounterField {
  std::string_view name;
  std::string_view help;
  uint64_t TierCounters::*field;
};
struct EngineCounterField {
  std::string_view name;
  std::string_view op;  // the `op` label of kvtier_engine_ops_total
  std::string_view help;
  uint64_t EngineStats::*field;
};
// In the order they are shown.
std::span<const TierCounterField> TierCounterFields();
std::span<const EngineCounterField> EngineCounterFields();

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Open(const EngineOptions& options);
  // Finishes queued operations and write-backs; gives up on file-tier operations stuck in the
  // kernel after the file tier's stall timeout (bounded, see FileTierOptions::stall_timeout).
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Leading chunks of `keys` that a Load would find now. Never blocks on I/O.
  LookupResult Lookup(std::span<const ChunkKey> keys);

  // Copies each src[i] (chunk_bytes long) into L1 under keys[i]. Keys already present are
  // skipped (stores are idempotent). keys[i-1] is taken as keys[i]'s predecessor in the prefix.
  // Returns kInvalidArgument for mismatched sizes and kRejected if the queue is full (nothing
  // was started); otherwise a handle.
  Result<OpHandle> Store(std::span<const ChunkKey> keys,
                         std::span<const std::span<const uint8_t>> src);
  // Copies the longest available prefix of `keys` into dst[i] (each chunk_bytes long).
  Result<OpHandle> Load(std::span<const ChunkKey> keys, std::span<const std::span<uint8_t>> dst);

  // --- Zero-copy interface, for a server whose clients map the L1 arena themselves. ---
  //
  // Reserves one L1 slot per key for the caller to fill in place. slots[i] is kNoSlot when
  // keys[i] is already stored (nothing to write). Stops at the first key that cannot get a slot:
  // the returned vector is then shorter than keys (possibly empty) and the tier is full of
  // pinned chunks. Never blocks on I/O.
  std::vector<SlotId> ReserveSlots(std::span<const ChunkKey> keys);
  // Publishes filled slots (kNoSlot entries are skipped) and applies the write policy to them.
  void CommitSlots(std::span<const ChunkKey> keys, std::span<const SlotId> slots);
  // Gives reserved, unfilled slots back.
  void AbortSlots(std::span<const SlotId> slots);
  // Pins the longest available prefix of `keys` in L1, promoting chunks from lower tiers into L1
  // first if needed. Asynchronous: the result's `slots` lists the pinned slots; each must be
  // released with Unpin.
  Result<OpHandle> PrepareLoad(std::span<const ChunkKey> keys);
  // PrepareLoad's answer when L1 alone gives it, taken at once without an operation: if L1 holds
  // every key, or the first key it lacks is in no lower tier, the leading chunks are pinned and
  // their slots returned (possibly none), counted as PrepareLoad counts them. Otherwise nullopt,
  // nothing pinned or counted: the prefix goes on in a lower tier, and PrepareLoad must fetch it.
  // Never blocks on I/O.
  std::optional<std::vector<SlotId>> PrepareLoadFromMemory(std::span<const ChunkKey> keys);
  void Unpin(std::span<const SlotId> slots);

  // Blocks until every queued operation, and every write to L2 already started or deferred, has
  // finished, and the flusher has cleaned its headroom: true. False if it stopped waiting on
  // file-tier operations stuck in the kernel.
  bool Drain();
  // Writes every L1 chunk not yet in L2 to L2 (write-back at shutdown), then drains. Blocking,
  // but bounded when L2 is stuck (kTimeout). Returns the first error, if any; a no-op without
  // L2 or with write policy kNone.
  Status FlushDirty();
  EngineStats Stats() const;
  const EngineOptions& options() const;
  bool has_file_tier() const;
  // FileTier::ReadDescriptor of the file tier (NotFound without one): the descriptor in the
  // header of `key`'s chunk file. Blocks for one 4 KiB read; thread-safe.
  Result<std::string> ReadChunkDescriptor(const ChunkKey& key);

  // --- The L1 arena, for a server that shares it with its clients' processes. ---
  struct Pool {
    uint8_t* base = nullptr;  // page-aligned; slot i at base + i * slot_bytes
    uint64_t bytes = 0;
    int fd = -1;  // the arena's memfd (owned by the engine): another process maps the same pool
    uint32_t num_slots = 0;
    uint64_t slot_bytes = 0;  // chunk_bytes rounded up to the slot alignment (4 KiB)
  };
  Pool pool() const;
  // The bytes of one L1 slot; valid while the engine lives. What they hold is only defined
  // while the caller holds the slot (reserved, or pinned by PrepareLoad).
  std::span<uint8_t> SlotData(SlotId slot) const;

 private:
  friend struct EngineInternals;  // tests' view of the tiers (src/engine/engine_internals.h)
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;  // the tiers, the worker pool, the flusher (engine.cc)
};

}  // namespace kvtier
