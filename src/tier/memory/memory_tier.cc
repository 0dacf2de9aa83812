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

void MemoryTier::SetEvictionSink(EvictionSink sink) {
  std::lock_guard lock(mu_);
  sink_ = std::move(sink);
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

Result<MemoryTier::Reservation> MemoryTier::Reserve(const ChunkKey& key, const ChunkKey* parent) {
  std::unique_lock lock(mu_);
  if (index_.contains(key)) return Reservation{kNoSlot, true};

  SlotId slot = kNoSlot;
  ChunkKey evicted_key;
  bool write_back = false;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    slot = policy_->PickVictim([this](SlotId s) {
      return slots_[s].state == SlotState::kResident && slots_[s].pins == 0;
    });
    if (slot == kNoSlot) {
      ++rejections_;
      return Status::Rejected("memory tier full: every slot is pinned or being written");
    }
    Slot& victim = slots_[slot];
    policy_->OnRemove(slot);
    index_.erase(victim.key);
    --resident_;
    ++evictions_;
    write_back = victim.dirty && sink_;
    evicted_key = victim.key;
  }
  Slot& s = slots_[slot];
  s.key = key;
  s.has_parent = parent != nullptr;
  if (parent) s.parent = *parent;
  s.state = SlotState::kReserved;
  s.dirty = false;
  s.pins = 0;
  index_.emplace(key, slot);
  if (write_back) {
    ++write_backs_;
    EvictionSink sink = sink_;
    // The slot is reserved for `key` and nobody else can reach it, so its old bytes stay
    // intact while the sink writes them out without the lock.
    lock.unlock();
    sink(evicted_key, SlotData(slot));
  }
  return Reservation{slot, false};
}

void MemoryTier::Commit(SlotId slot, bool dirty) {
  std::lock_guard lock(mu_);
  Slot& s = slots_[slot];
  s.state = SlotState::kResident;
  s.dirty = dirty;
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
  s.dirty = false;
  free_.push_back(slot);
}

void MemoryTier::MarkClean(const ChunkKey& key) {
  std::lock_guard lock(mu_);
  auto it = index_.find(key);
  if (it != index_.end()) slots_[it->second].dirty = false;
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
  st.evictions = evictions_;
  st.write_backs = write_backs_;
  st.rejections = rejections_;
  return st;
}

}  // namespace kvtier
