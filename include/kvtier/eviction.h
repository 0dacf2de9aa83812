// Eviction policies for the memory tier (L1), behind one interface.
//
// A policy orders the committed, resident slots of a tier and proposes a victim when the tier
// needs room. It never sees chunk data and never decides about pinned slots: the tier passes a
// predicate saying which slots may go.
//
//  * kLru: least recently used first.
//  * kPrefixAware: least recently used first among chunks that no resident chunk depends on. A
//    chunk's "parent" is the chunk before it in the same prefix; a later chunk is useless
//    without its predecessors, so a parent is not evicted while a child stays, and a
//    conversation loses its tail before its head. Only when no such chunk may go (every leaf
//    pinned) does the nearest evictable ancestor of the coldest leaf go: pinned leaves never
//    make a tier with unpinned chunks refuse a store.
//
// Thread-safety: not thread-safe; the memory tier calls it under its own lock.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>

#include "kvtier/status.h"
#include "kvtier/store.h"

namespace kvtier {

enum class EvictionPolicyKind : uint8_t { kLru, kPrefixAware };
Result<EvictionPolicyKind> ParseEvictionPolicy(std::string_view name);  // "lru", "prefix-aware"
std::string_view EvictionPolicyName(EvictionPolicyKind kind);

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  // `slot` became resident. `parent` is the slot of the previous chunk of its prefix (resident,
  // or reserved and about to be inserted), or kNoSlot. REQUIRES: slot < capacity, not resident.
  virtual void OnInsert(SlotId slot, SlotId parent) = 0;
  // `slot` was read or written again.
  virtual void OnAccess(SlotId slot) = 0;
  // `slot` left the tier (evicted, removed, or a reservation given back before insertion).
  virtual void OnRemove(SlotId slot) = 0;
  // The next slot to evict among those for which `evictable(slot)` is true, or kNoSlot.
  // Does not remove it: the caller calls OnRemove once the slot really goes.
  virtual SlotId PickVictim(const std::function<bool(SlotId)>& evictable) = 0;
};

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(EvictionPolicyKind kind, uint32_t capacity);

}  // namespace kvtier
