#include "kvtier/memory_tier.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/memfd.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

struct Arena {
  int fd = -1;
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  bool huge = false;
};

// memfd + shared mapping, so the pool can later be handed to other processes.
Result<Arena> MapArena(uint64_t bytes, bool want_huge, bool prefault) {
  Arena a;
  if (want_huge) {
    uint64_t huge_bytes = RoundUp(bytes, kHugePage);
    int fd =
        memfd_create("kvtier-l1", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB | MFD_HUGE_2MB);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(huge_bytes)) == 0 && SealSize(fd)) {
      void* p = mmap(nullptr, huge_bytes, PROT_READ | PROT_WRITE,
                     MAP_SHARED | (prefault ? MAP_POPULATE : 0), fd, 0);
      if (p != MAP_FAILED) {
        return Arena{fd, static_cast<uint8_t*>(p), huge_bytes, true};
      }
    }
    int err = errno;
    if (fd >= 0) close(fd);
    spdlog::warn(
        "memory tier: 2 MiB huge pages unavailable ({}); using 4 KiB pages "
        "(reserve pages via /proc/sys/vm/nr_hugepages to enable)",
        std::strerror(err));
  }
  int fd = memfd_create("kvtier-l1", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Status::FromErrno(errno, "memfd_create for the memory tier");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    return Status::FromErrno(err, fmt::format("sizing the memory tier to {} bytes", bytes));
  }
  // Allocating the backing pages up front turns an out-of-memory at first touch (SIGBUS) into
  // an error here, and makes the populate below a pure mapping step.
  if (prefault) {
    int rc = fallocate(fd, 0, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
      int err = errno;
      close(fd);
      return Status::FromErrno(err, fmt::format("reserving {} bytes for the memory tier", bytes));
    }
  }
  if (!SealSize(fd)) {
    int err = errno;
    close(fd);
    return Status::FromErrno(err, "sealing the size of the memory tier");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (prefault ? MAP_POPULATE : 0),
                 fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    close(fd);
    return Status::FromErrno(err, "mapping the memory tier");
  }
  return Arena{fd, static_cast<uint8_t*>(p), bytes, false};
}

}  // namespace

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
  tier->slots_.resize(num_slots);
  tier->free_.reserve(num_slots);
  // Hand out low slots first: they sit together at the start of the arena.
  for (uint64_t s = num_slots; s-- > 0;) tier->free_.push_back(static_cast<SlotId>(s));
  tier->index_.reserve(num_slots * 2);
  tier->policy_ = MakeEvictionPolicy(options.eviction, static_cast<uint32_t>(num_slots));
  return tier;
}

MemoryTier::~MemoryTier() {
  if (base_) munmap(base_, arena_bytes_);
  if (fd_ >= 0) close(fd_);
}

size_t MemoryTier::LookupPrefix(std::span<const ChunkKey> keys) {
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

bool MemoryTier::Contains(const ChunkKey& key) const {
  std::lock_guard lock(mu_);
  auto it = index_.find(key);
  return it != index_.end() && slots_[it->second].state == SlotState::kResident;
}

Result<SlotId> MemoryTier::Pin(const ChunkKey& key) {
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

void MemoryTier::Unpin(SlotId slot) {
  std::lock_guard lock(mu_);
  Slot& s = slots_[slot];
  if (s.pins > 0 && --s.pins == 0) --pinned_;
}

Result<MemoryTier::Reservation> MemoryTier::Reserve(const ChunkKey& key, const ChunkKey* parent,
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

void MemoryTier::Commit(SlotId slot, bool dirty) {
  std::lock_guard lock(mu_);
  Slot& s = slots_[slot];
  s.state = SlotState::kResident;
  SetDirtyLocked(s, dirty);
  ++resident_;
  SlotId parent_slot = kNoSlot;
  if (s.has_parent) {
    auto it = index_.find(s.parent);
    if (it != index_.end()) parent_slot = it->second;  // resident, or reserved by a parallel store
  }
  policy_->OnInsert(slot, parent_slot);
}

void MemoryTier::Abort(SlotId slot) {
  std::lock_guard lock(mu_);
  policy_->OnRemove(slot);  // unlinks children that committed before this reservation failed
  ReleaseSlotLocked(slot);
}

void MemoryTier::ReleaseSlotLocked(SlotId slot) {
  Slot& s = slots_[slot];
  index_.erase(s.key);
  s.state = SlotState::kFree;
  s.pins = 0;
  SetDirtyLocked(s, false);
  free_.push_back(slot);
}

void MemoryTier::SetDirtyLocked(Slot& s, bool dirty) {
  if (s.dirty == dirty) return;
  s.dirty = dirty;
  if (dirty) {
    ++dirty_;
  } else {
    --dirty_;
  }
}

Result<SlotId> MemoryTier::BeginClean(const ChunkKey& key) {
  std::lock_guard lock(mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return Status::NotFound("not in the memory tier");
  Slot& s = slots_[it->second];
  if (s.state != SlotState::kResident || !s.dirty || s.cleaning) {
    return Status::NotFound("nothing to clean");
  }
  s.cleaning = true;
  ++cleaning_;
  if (s.pins++ == 0) ++pinned_;
  return it->second;
}

std::vector<MemoryTier::Dirty> MemoryTier::TakeFlushCandidates(uint32_t headroom, size_t max) {
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

void MemoryTier::EndClean(SlotId slot, bool stored) {
  std::lock_guard lock(mu_);
  Slot& s = slots_[slot];
  if (!s.cleaning) return;
  s.cleaning = false;
  --cleaning_;
  if (stored) SetDirtyLocked(s, false);
  if (s.pins > 0 && --s.pins == 0) --pinned_;
}

std::vector<ChunkKey> MemoryTier::DirtyKeys() const {
  std::lock_guard lock(mu_);
  std::vector<ChunkKey> keys;
  for (const Slot& s : slots_) {
    if (s.state == SlotState::kResident && s.dirty) keys.push_back(s.key);
  }
  return keys;
}

Status MemoryTier::Remove(const ChunkKey& key) {
  std::lock_guard lock(mu_);
  auto it = index_.find(key);
  if (it == index_.end() || slots_[it->second].state != SlotState::kResident) {
    return Status::NotFound("not in the memory tier");
  }
  SlotId slot = it->second;
  if (slots_[slot].pins > 0) return Status::Rejected("chunk is pinned by a reader");
  policy_->OnRemove(slot);
  --resident_;
  ReleaseSlotLocked(slot);
  return Status::Ok();
}

MemoryTierStats MemoryTier::Stats() const {
  std::lock_guard lock(mu_);
  MemoryTierStats st;
  st.capacity_bytes = arena_bytes_;
  st.slot_bytes = slot_bytes_;
  st.num_slots = num_slots_;
  st.resident = resident_;
  st.pinned = pinned_;
  st.huge_pages = huge_pages_;
  st.lookups = lookups_;
  st.hits = hits_;
  st.misses = misses_;
  st.bytes_in = bytes_in_.load(std::memory_order_relaxed);
  st.bytes_out = bytes_out_.load(std::memory_order_relaxed);
  st.dirty = dirty_;
  st.cleaning = cleaning_;
  st.evictions = evictions_;
  st.dirty_evictions = dirty_evictions_;
  st.rejections = rejections_;
  return st;
}

}  // namespace kvtier
