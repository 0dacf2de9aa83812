#include "kvtier/memory_tier.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier {
namespace {

constexpr uint64_t kMaxChunkBytes = 16ull << 30;
constexpr uint64_t kSlotAlign = 4096;
constexpr uint64_t kHugePage = 2ull << 20;

uint64_t RoundUp(uint64_t n, uint64_t align) { return (n + align - 1) / align * align; }

// Fixes the arena's size for good. The descriptor is handed to other processes; one that could
// shrink it would make every other mapping of the pool, the server's included, die of SIGBUS
// on its next access.
bool SealSize(int fd) {
  return fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0;
}

// The word in brackets of a transparent-huge-page setting ("always [advise] never"), or "".
std::string ThpSetting(const char* path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t open = text.find('['), close = text.find(']', open);
  if (open == std::string::npos || close == std::string::npos) return "";
  return text.substr(open + 1, close - open - 1);
}

// Whether shared memory mapped with MADV_HUGEPAGE gets 2 MiB pages, and the setting that says.
std::pair<bool, std::string> ShmemHugePagesAllowed() {
  constexpr char kTop[] = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
  constexpr char k2M[] = "/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled";
  std::string setting = ThpSetting(k2M);
  if (setting.empty() || setting == "inherit") setting = ThpSetting(kTop);
  const bool allowed = setting == "always" || setting == "within_size" ||
                       setting == "advise" || setting == "force";
  return {allowed, setting.empty() ? "absent" : setting};
}

// Faults every page of the mapping in, writing, so that an out-of-memory is an error here and
// not a SIGBUS or an OOM kill at the first store.
Status Populate(uint8_t* p, uint64_t bytes, int fd) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older C libraries lack the name
#endif
  if (madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return Status::Ok();
  if (errno != EINVAL) return Status::FromErrno(errno, "populating the memory tier");
  // Older kernels: reserve the backing, then touch a byte of every page.
  if (fallocate(fd, 0, 0, static_cast<off_t>(bytes)) != 0) {
    return Status::FromErrno(errno, fmt::format("reserving {} bytes for the memory tier", bytes));
  }
  for (uint64_t off = 0; off < bytes; off += 4096) p[off] = 0;
  return Status::Ok();
}

struct Arena {
  int fd = -1;
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  bool huge = false;
};

// A memfd on ordinary shared memory, mapped shared, so the pool can be handed to other processes.
// Never hugetlbfs, even for huge pages: every client maps the descriptor read-write, and with
// that it can deallocate any page (fallocate PUNCH_HOLE, madvise MADV_REMOVE: no seal forbids it
// while allowing writable mappings). A shared-memory hole reads as zeros and the next touch
// brings a new page; a hugetlbfs page must come back from the system's huge page pool, and once
// another process has taken it, every process mapping the pool, the server first, died of
// SIGBUS at its next touch. Huge pages are transparent ones (MADV_HUGEPAGE), where the kernel's
// shmem_enabled setting allows them.
Result<Arena> MapArena(uint64_t bytes, bool want_huge, bool prefault) {
  bool huge = false;
  if (want_huge) {
    auto [allowed, setting] = ShmemHugePagesAllowed();
    if (allowed) {
      huge = true;
      bytes = RoundUp(bytes, kHugePage);
    } else {
      spdlog::warn(
          "memory tier: 2 MiB pages for shared memory are off (transparent huge pages for shmem: "
          "'{}'); using 4 KiB pages (echo advise > "
          "/sys/kernel/mm/transparent_hugepage/shmem_enabled to enable)",
          setting);
    }
  }
  int fd = memfd_create("kvtier-l1", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Status::FromErrno(errno, "memfd_create for the memory tier");
  auto fail = [fd](int err, std::string what) {
    close(fd);
    return Status::FromErrno(err, std::move(what));
  };
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail(errno, fmt::format("sizing the memory tier to {} bytes", bytes));
  }
  if (!SealSize(fd)) return fail(errno, "sealing the size of the memory tier");
  // Aligned to a huge page, so that the kernel can map the arena with them.
  const uint64_t span = bytes + (huge ? kHugePage : 0);
  void* reserved = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (reserved == MAP_FAILED) return fail(errno, "reserving address space for the memory tier");
  auto* start = reinterpret_cast<uint8_t*>(
      RoundUp(reinterpret_cast<uint64_t>(reserved), huge ? kHugePage : 4096));
  void* p = mmap(start, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    munmap(reserved, span);
    return fail(err, "mapping the memory tier");
  }
  // The reservation's unused ends.
  auto* r = static_cast<uint8_t*>(reserved);
  if (start > r) munmap(r, static_cast<size_t>(start - r));
  const uint64_t tail = static_cast<uint64_t>((r + span) - (start + bytes));
  if (tail > 0) munmap(start + bytes, tail);
  if (huge && madvise(p, bytes, MADV_HUGEPAGE) != 0) {
    spdlog::warn("memory tier: madvise(MADV_HUGEPAGE) failed ({}); using 4 KiB pages",
                 std::strerror(errno));
    huge = false;
  }
  if (prefault) {
    if (Status s = Populate(static_cast<uint8_t*>(p), bytes, fd); !s.ok()) {
      munmap(p, bytes);
      close(fd);
      return s;
    }
  }
  return Arena{fd, static_cast<uint8_t*>(p), bytes, huge};
}

}  // namespace

// Every slot's state and the keys' index, changed together under mu_. Reserve evicts and
// Commit inserts in the policy under the same lock, so the index, the policy's order and the
// counters always agree.
class MemoryTier::Table {
 public:
  Table(uint32_t num_slots, EvictionPolicyKind eviction, std::shared_ptr<TierListener> listener);

  size_t LookupPrefix(std::span<const ChunkKey> keys);
  bool Contains(const ChunkKey& key) const;
  Result<SlotId> Pin(const ChunkKey& key);
  void Unpin(SlotId slot);
  Result<Reservation> Reserve(const ChunkKey& key, const ChunkKey* parent, Victims victims);
  void Commit(SlotId slot, bool dirty);
  void Abort(SlotId slot);
  std::vector<ChunkKey> DirtyKeys() const;
  Result<SlotId> BeginClean(const ChunkKey& key);
  std::vector<Dirty> TakeFlushCandidates(uint32_t headroom, size_t max);
  void EndClean(SlotId slot, bool stored);
  Status Remove(const ChunkKey& key);
  // The table's part of MemoryTier::Stats: the slot counts and the counters it keeps.
  void FillStats(MemoryTierStats& st) const;

 private:
  enum class SlotState : uint8_t { kFree, kReserved, kResident };
  struct Slot {
    ChunkKey key;
    ChunkKey parent;
    bool has_parent = false;
    SlotState state = SlotState::kFree;
    bool dirty = false;
    bool cleaning = false;  // pinned by a writer to a lower tier
    uint32_t pins = 0;
  };

  void ReleaseSlotLocked(SlotId slot);
  void SetDirtyLocked(Slot& s, bool dirty);
  void Tell(const ChunkKey& key, bool stored) {
    if (listener_) listener_->OnTierChange(TierId::kMemory, key, stored);
  }

  std::shared_ptr<TierListener> listener_;  // told under mu_: changes of a key arrive in order

  mutable std::mutex mu_;
  std::unordered_map<ChunkKey, SlotId, ChunkKeyHash> index_;  // reserved and resident keys
  std::vector<Slot> slots_;
  std::vector<SlotId> free_;
  std::unique_ptr<EvictionPolicy> policy_;
  uint32_t resident_ = 0, pinned_ = 0, dirty_ = 0, cleaning_ = 0;
  uint64_t lookups_ = 0, hits_ = 0, misses_ = 0;
  uint64_t evictions_ = 0, dirty_evictions_ = 0, dirty_refusals_ = 0, rejections_ = 0;
};

MemoryTier::Table::Table(uint32_t num_slots, EvictionPolicyKind eviction,
                         std::shared_ptr<TierListener> listener)
    : listener_(std::move(listener)) {
  slots_.resize(num_slots);
  free_.reserve(num_slots);
  // Hand out low slots first: they sit together at the start of the arena.
  for (uint64_t s = num_slots; s-- > 0;) free_.push_back(static_cast<SlotId>(s));
  index_.reserve(static_cast<size_t>(num_slots) * 2);
  policy_ = MakeEvictionPolicy(eviction, num_slots);
}

Result<std::unique_ptr<MemoryTier>> MemoryTier::Open(const MemoryTierOptions& options) {
  if (options.chunk_bytes == 0) {
    return Status::InvalidArgument("memory tier: chunk_bytes must be positive");
  }
  if (options.chunk_bytes > kMaxChunkBytes) {
    return Status::InvalidArgument(fmt::format(
        "memory tier: chunk of {} bytes is over the 16 GiB limit", options.chunk_bytes));
  }
  uint64_t slot_bytes = RoundUp(options.chunk_bytes, kSlotAlign);
  uint64_t num_slots = options.capacity_bytes / slot_bytes;
  if (num_slots == 0) {
    return Status::InvalidArgument(
        fmt::format("memory tier: capacity of {} bytes is below one chunk slot of {} bytes",
                    options.capacity_bytes, slot_bytes));
  }
  if (num_slots >= kNoSlot) {
    return Status::InvalidArgument("memory tier: too many slots; use larger chunks");
  }
  KVTIER_ASSIGN_OR_RETURN(Arena arena,
                          MapArena(num_slots * slot_bytes, options.huge_pages, options.prefault));

  std::unique_ptr<MemoryTier> tier(new MemoryTier());
  tier->fd_ = arena.fd;
  tier->base_ = arena.base;
  tier->arena_bytes_ = arena.bytes;
  tier->huge_pages_ = arena.huge;
  tier->slot_bytes_ = slot_bytes;
  tier->chunk_bytes_ = options.chunk_bytes;
  tier->num_slots_ = static_cast<uint32_t>(num_slots);
  tier->table_ = std::make_unique<Table>(tier->num_slots_, options.eviction, options.listener);
  return tier;
}

MemoryTier::~MemoryTier() {
  if (base_) munmap(base_, arena_bytes_);
  if (fd_ >= 0) close(fd_);
}

size_t MemoryTier::Table::LookupPrefix(std::span<const ChunkKey> keys) {
  std::lock_guard lock(mu_);
  ++lookups_;
  size_t n = 0;
  for (; n < keys.size(); ++n) {
    auto it = index_.find(keys[n]);
    if (it == index_.end() || slots_[it->second].state != SlotState::kResident) break;
  }
  hits_ += n;
  if (n < keys.size()) ++misses_;
  return n;
}

bool MemoryTier::Table::Contains(const ChunkKey& key) const {
  std::lock_guard lock(mu_);
  auto it = index_.find(key);
  return it != index_.end() && slots_[it->second].state == SlotState::kResident;
}

Result<SlotId> MemoryTier::Table::Pin(const ChunkKey& key) {
  std::lock_guard lock(mu_);
  auto it = index_.find(key);
  if (it == index_.end() || slots_[it->second].state != SlotState::kResident) {
    return Status::NotFound("not in the memory tier");
  }
  Slot& slot = slots_[it->second];
  if (slot.pins++ == 0) ++pinned_;
  policy_->OnAccess(it->second);
  return it->second;
}

void MemoryTier::Table::Unpin(SlotId slot) {
  std::lock_guard lock(mu_);
  Slot& s = slots_[slot];
  if (s.pins > 0 && --s.pins == 0) --pinned_;
}

Result<MemoryTier::Reservation> MemoryTier::Table::Reserve(const ChunkKey& key,
                                                           const ChunkKey* parent,
                                                           Victims victims) {
  std::lock_guard lock(mu_);
  if (index_.contains(key)) {
    Reservation present;
    present.already_present = true;
    return present;
  }

  Reservation r;
  if (!free_.empty()) {
    r.slot = free_.back();
    free_.pop_back();
  } else {
    // A clean victim costs nothing; a dirty one is lost to the lower tiers, so it goes only when
    // no clean chunk can (the flusher fell behind), and the caller is told.
    auto evictable = [this](SlotId s) {
      return slots_[s].state == SlotState::kResident && slots_[s].pins == 0;
    };
    if (resident_ > dirty_) {
      r.slot = policy_->PickVictim([&](SlotId s) { return evictable(s) && !slots_[s].dirty; });
    }
    if (r.slot == kNoSlot && dirty_ > 0) {
      if (victims == Victims::kCleanOnly) {
        ++dirty_refusals_;
        return Status::Rejected("memory tier full: no clean chunk to evict");
      }
      r.slot = policy_->PickVictim(evictable);
    }
    if (r.slot == kNoSlot) {
      ++rejections_;
      return Status::Rejected("memory tier full: every slot is pinned or being written");
    }
    Slot& victim = slots_[r.slot];
    policy_->OnRemove(r.slot);
    index_.erase(victim.key);
    Tell(victim.key, false);
    --resident_;
    ++evictions_;
    if (victim.dirty) {
      r.evicted_dirty = true;
      r.evicted_key = victim.key;
      ++dirty_evictions_;
      SetDirtyLocked(victim, false);
    }
  }
  Slot& s = slots_[r.slot];
  s.key = key;
  s.has_parent = parent != nullptr;
  if (parent) s.parent = *parent;
  s.state = SlotState::kReserved;
  s.pins = 0;
  index_.emplace(key, r.slot);
  return r;
}

void MemoryTier::Table::Commit(SlotId slot, bool dirty) {
  std::lock_guard lock(mu_);
  Slot& s = slots_[slot];
  s.state = SlotState::kResident;
  SetDirtyLocked(s, dirty);
  ++resident_;
  Tell(s.key, true);
  SlotId parent_slot = kNoSlot;
  if (s.has_parent) {
    auto it = index_.find(s.parent);
    if (it != index_.end()) parent_slot = it->second;  // resident, or reserved by a parallel store
  }
  policy_->OnInsert(slot, parent_slot);
}

void MemoryTier::Table::Abort(SlotId slot) {
  std::lock_guard lock(mu_);
  policy_->OnRemove(slot);  // unlinks children that committed before this reservation failed
  ReleaseSlotLocked(slot);
}

void MemoryTier::Table::ReleaseSlotLocked(SlotId slot) {
  Slot& s = slots_[slot];
  index_.erase(s.key);
  s.state = SlotState::kFree;
  s.pins = 0;
  SetDirtyLocked(s, false);
  free_.push_back(slot);
}

void MemoryTier::Table::SetDirtyLocked(Slot& s, bool dirty) {
  if (s.dirty == dirty) return;
  s.dirty = dirty;
  if (dirty) {
    ++dirty_;
  } else {
    --dirty_;
  }
}

Result<SlotId> MemoryTier::Table::BeginClean(const ChunkKey& key) {
  std::lock_guard lock(mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return Status::NotFound("not in the memory tier");
  Slot& s = slots_[it->second];
  if (s.state != SlotState::kResident || !s.dirty) return Status::NotFound("nothing to clean");
  if (s.cleaning) return Status::Rejected("another writer is cleaning it");
  s.cleaning = true;
  ++cleaning_;
  if (s.pins++ == 0) ++pinned_;
  return it->second;
}

std::vector<MemoryTier::Dirty> MemoryTier::Table::TakeFlushCandidates(uint32_t headroom,
                                                                      size_t max) {
  std::vector<Dirty> taken;
  std::lock_guard lock(mu_);
  // Chunks being cleaned count once, whether or not the walk meets them (the prefix-aware
  // policy walks only leaves, and a chunk may stop being one while it is written): so writes
  // never pin more than the headroom.
  if (dirty_ == cleaning_ || free_.size() + cleaning_ >= headroom || max == 0) return taken;
  size_t budget = headroom - free_.size() - cleaning_;
  // Walks the eviction order without evicting: the predicate never accepts, except to stop.
  policy_->PickVictim([&](SlotId id) {
    Slot& s = slots_[id];
    if (s.state != SlotState::kResident || s.pins > 0) return false;
    if (s.dirty && !s.cleaning) {
      s.cleaning = true;
      ++cleaning_;
      if (s.pins++ == 0) ++pinned_;
      taken.push_back(Dirty{s.key, id});
    }
    return --budget == 0 || taken.size() == max;
  });
  return taken;
}

void MemoryTier::Table::EndClean(SlotId slot, bool stored) {
  std::lock_guard lock(mu_);
  Slot& s = slots_[slot];
  if (!s.cleaning) return;
  s.cleaning = false;
  --cleaning_;
  if (stored) SetDirtyLocked(s, false);
  if (s.pins > 0 && --s.pins == 0) --pinned_;
}

std::vector<ChunkKey> MemoryTier::Table::DirtyKeys() const {
  std::lock_guard lock(mu_);
  std::vector<ChunkKey> keys;
  for (const Slot& s : slots_) {
    if (s.state == SlotState::kResident && s.dirty) keys.push_back(s.key);
  }
  return keys;
}

Status MemoryTier::Table::Remove(const ChunkKey& key) {
  std::lock_guard lock(mu_);
  auto it = index_.find(key);
  if (it == index_.end() || slots_[it->second].state != SlotState::kResident) {
    return Status::NotFound("not in the memory tier");
  }
  SlotId slot = it->second;
  if (slots_[slot].pins > 0) return Status::Rejected("chunk is pinned by a reader");
  policy_->OnRemove(slot);
  --resident_;
  Tell(slots_[slot].key, false);
  ReleaseSlotLocked(slot);
  return Status::Ok();
}

void MemoryTier::Table::FillStats(MemoryTierStats& st) const {
  std::lock_guard lock(mu_);
  st.resident = resident_;
  st.pinned = pinned_;
  st.lookups = lookups_;
  st.hits = hits_;
  st.misses = misses_;
  st.dirty = dirty_;
  st.cleaning = cleaning_;
  st.evictions = evictions_;
  st.dirty_evictions = dirty_evictions_;
  st.dirty_refusals = dirty_refusals_;
  st.rejections = rejections_;
}

// The tier's methods on slots: the table's, under its lock.
size_t MemoryTier::LookupPrefix(std::span<const ChunkKey> keys) {
  return table_->LookupPrefix(keys);
}
bool MemoryTier::Contains(const ChunkKey& key) const { return table_->Contains(key); }
Result<SlotId> MemoryTier::Pin(const ChunkKey& key) { return table_->Pin(key); }
void MemoryTier::Unpin(SlotId slot) { table_->Unpin(slot); }
Result<MemoryTier::Reservation> MemoryTier::Reserve(const ChunkKey& key, const ChunkKey* parent,
                                                    Victims victims) {
  return table_->Reserve(key, parent, victims);
}
void MemoryTier::Commit(SlotId slot, bool dirty) { table_->Commit(slot, dirty); }
void MemoryTier::Abort(SlotId slot) { table_->Abort(slot); }
std::vector<ChunkKey> MemoryTier::DirtyKeys() const { return table_->DirtyKeys(); }
Result<SlotId> MemoryTier::BeginClean(const ChunkKey& key) { return table_->BeginClean(key); }
std::vector<MemoryTier::Dirty> MemoryTier::TakeFlushCandidates(uint32_t headroom, size_t max) {
  return table_->TakeFlushCandidates(headroom, max);
}
void MemoryTier::EndClean(SlotId slot, bool stored) { table_->EndClean(slot, stored); }
Status MemoryTier::Remove(const ChunkKey& key) { return table_->Remove(key); }

MemoryTierStats MemoryTier::Stats() const {
  MemoryTierStats st;
  st.capacity_bytes = arena_bytes_;
  st.slot_bytes = slot_bytes_;
  st.num_slots = num_slots_;
  st.huge_pages = huge_pages_;
  st.bytes_in = bytes_in_.load(std::memory_order_relaxed);
  st.bytes_out = bytes_out_.load(std::memory_order_relaxed);
  table_->FillStats(st);
  return st;
}

}  // namespace kvtier
