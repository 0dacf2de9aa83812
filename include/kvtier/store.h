// The vocabulary every part of kvtier speaks: pool slots, the results of lookups and operations,
// and the ChunkStore interface an inference integration programs against, whichever store is
// behind it (an in-process Engine, kvtier/engine.h, or a `kvtier serve` daemon, kvtier/client.h;
// kvtier/chunk_store.h opens either). It depends on nothing but keys and statuses, so that every
// layer may use it without reaching up to the layers that implement it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/status.h"

namespace kvtier {

// A slot of the L1 pool (the memory tier's arena, shared with clients in server mode).
using SlotId = uint32_t;
inline constexpr SlotId kNoSlot = UINT32_MAX;

struct LookupResult {
  size_t total = 0;   // leading chunks available, each in one tier or another
  size_t memory = 0;  // leading chunks resident in L1 (a prefix of the total)
};

struct OpResult {
  Status status;      // OK if every chunk was done
  size_t chunks = 0;  // Load: leading chunks delivered; Store: chunks now stored
  // PrepareLoad only: the pinned L1 slot of each of the `chunks` leading chunks. The caller
  // owns these pins and must give each back with Unpin (Engine::Unpin, ChunkStore::Unpin).
  std::vector<SlotId> slots;
};

// A handle to an asynchronous operation of a ChunkStore, with the shape of Engine's OpHandle.
// Copyable. An AsyncOp of PrepareLoad whose result is never taken (Wait/WaitFor) releases its
// pins itself when the last copy is destroyed.
class AsyncOp {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual bool Done() = 0;
    virtual std::optional<OpResult> WaitFor(std::optional<std::chrono::nanoseconds> timeout) = 0;
  };
  explicit AsyncOp(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  // An already finished operation.
  static AsyncOp Finished(OpResult result);

  bool Done() const { return impl_->Done(); }
  OpResult Wait() const { return *impl_->WaitFor(std::nullopt); }
  // The result if done within `timeout`, else nullopt (the operation goes on).
  std::optional<OpResult> WaitFor(std::chrono::nanoseconds timeout) const {
    return impl_->WaitFor(timeout);
  }

 private:
  std::shared_ptr<Impl> impl_;
};

// What an inference integration needs from the KV store, in process or through a server.
class ChunkStore {
 public:
  virtual ~ChunkStore() = default;

  // Bytes of one chunk; every buffer passed to Store/Load has exactly this size.
  virtual uint64_t chunk_bytes() const = 0;
  // Leading chunks of `keys` a Load would find now. In server mode a broken connection reports
  // zero hits (the caller recomputes). Never blocks on file I/O.
  virtual LookupResult Lookup(std::span<const ChunkKey> keys) = 0;
  // Stores src[i] under keys[i] (idempotent: keys already stored are skipped). kInvalidArgument
  // for mismatched sizes, kRejected if the copy queue is full, kUnavailable if the server is
  // gone; otherwise a handle whose result counts the chunks now stored. Caller buffers must stay
  // valid until the handle is done.
  virtual Result<AsyncOp> Store(std::span<const ChunkKey> keys,
                                std::span<const std::span<const uint8_t>> src) = 0;
  // Copies the longest available prefix of `keys` into dst; result.chunks says how many.
  virtual Result<AsyncOp> Load(std::span<const ChunkKey> keys,
                               std::span<const std::span<uint8_t>> dst) = 0;

  // --- Zero-copy: the caller reads and writes pool slots itself (see SlotData). ---
  // Reserves a slot per key; kNoSlot where the key is already stored. The vector may be shorter
  // than `keys` when the pool is full of pinned chunks. Fill, then CommitSlots or AbortSlots.
  virtual Result<std::vector<SlotId>> ReserveSlots(std::span<const ChunkKey> keys) = 0;
  // REQUIRES: keys and slots as given to and returned by ReserveSlots.
  virtual Status CommitSlots(std::span<const ChunkKey> keys, std::span<const SlotId> slots) = 0;
  virtual Status AbortSlots(std::span<const SlotId> slots) = 0;
  // Pins the longest available prefix of `keys` in the pool (promoting from lower tiers).
  // result.slots lists the pinned slots; give each back with Unpin.
  virtual Result<AsyncOp> PrepareLoad(std::span<const ChunkKey> keys) = 0;
  virtual Status Unpin(std::span<const SlotId> slots) = 0;
  // The pool's bytes of `slot`: writable while reserved, readable while pinned.
  virtual std::span<uint8_t> SlotData(SlotId slot) const = 0;
  // The whole pool, e.g. for cudaHostRegister.
  virtual uint8_t* pool_base() const = 0;
  virtual uint64_t pool_bytes() const = 0;
};

}  // namespace kvtier
