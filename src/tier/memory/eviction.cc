#include "kvtier/eviction.h"

#include <fmt/format.h>

#include <vector>

namespace kvtier {
namespace {

// Intrusive doubly linked list over slot ids: O(1) insert, remove and move-to-front with no
// allocation after construction. Head = most recently used.
class SlotList {
 public:
  explicit SlotList(uint32_t capacity)
      : prev_(capacity, kNoSlot), next_(capacity, kNoSlot), linked_(capacity, false) {}
  bool Contains(SlotId s) const { return linked_[s]; }
  void PushFront(SlotId s) {
    Remove(s);  // never link a slot twice: that would close the list into a cycle
    prev_[s] = kNoSlot;
    next_[s] = head_;
    if (head_ != kNoSlot) prev_[head_] = s;
    head_ = s;
    if (tail_ == kNoSlot) tail_ = s;
    linked_[s] = true;
  }
  void PushBack(SlotId s) {
    Remove(s);
    next_[s] = kNoSlot;
    prev_[s] = tail_;
    if (tail_ != kNoSlot) next_[tail_] = s;
    tail_ = s;
    if (head_ == kNoSlot) head_ = s;
    linked_[s] = true;
  }
  void Remove(SlotId s) {
    if (!linked_[s]) return;
    if (prev_[s] != kNoSlot)
      next_[prev_[s]] = next_[s];
    else
      head_ = next_[s];
    if (next_[s] != kNoSlot)
      prev_[next_[s]] = prev_[s];
    else
      tail_ = prev_[s];
    linked_[s] = false;
  }
  SlotId tail() const { return tail_; }
  SlotId Prev(SlotId s) const { return prev_[s]; }

 private:
  std::vector<SlotId> prev_, next_;
  std::vector<bool> linked_;
  SlotId head_ = kNoSlot, tail_ = kNoSlot;
};

class LruPolicy final : public EvictionPolicy {
 public:
  explicit LruPolicy(uint32_t capacity) : list_(capacity) {}
  void OnInsert(SlotId slot, SlotId) override { list_.PushFront(slot); }
  void OnAccess(SlotId slot) override {
    list_.Remove(slot);
    list_.PushFront(slot);
  }
  void OnRemove(SlotId slot) override { list_.Remove(slot); }
  SlotId PickVictim(const std::function<bool(SlotId)>& evictable) override {
    for (SlotId s = list_.tail(); s != kNoSlot; s = list_.Prev(s)) {
      if (evictable(s)) return s;
    }
    return kNoSlot;
  }

 private:
  SlotList list_;
};

// Only leaves (slots no resident chunk points to as its parent) are candidates, kept in their
// own LRU list so a victim is found without walking interior chunks. When a leaf goes, its
// parent may become a leaf: it joins the cold end, so a prefix is evicted tail-first. Interior
// chunks are candidates only when no leaf may go.
class PrefixAwarePolicy final : public EvictionPolicy {
 public:
  explicit PrefixAwarePolicy(uint32_t capacity)
      : leaves_(capacity),
        parent_(capacity, kNoSlot),
        children_(capacity, 0),
        inserted_(capacity, false) {}

  void OnInsert(SlotId slot, SlotId parent) override {
    // A parent may still be reserved (being filled) when its child commits: the child is linked
    // already, and the parent joins the leaves only if no child came first.
    parent_[slot] = parent;
    inserted_[slot] = true;
    if (parent != kNoSlot) {
      if (children_[parent]++ == 0) leaves_.Remove(parent);
    }
    if (children_[slot] == 0) leaves_.PushFront(slot);
  }
  void OnAccess(SlotId slot) override {
    if (leaves_.Contains(slot)) {
      leaves_.Remove(slot);
      leaves_.PushFront(slot);
    }
  }
  void OnRemove(SlotId slot) override {
    leaves_.Remove(slot);
    inserted_[slot] = false;
    SlotId parent = parent_[slot];
    // A parent still reserved (not inserted yet) joins the leaves when it is inserted.
    if (parent != kNoSlot && --children_[parent] == 0 && inserted_[parent]) {
      leaves_.PushBack(parent);
    }
    parent_[slot] = kNoSlot;
    // A slot removed while it still had children (an explicit removal, not an eviction):
    // orphan them so they stay accounted as leaves.
    if (children_[slot] != 0) {
      for (SlotId s = 0; s < parent_.size(); ++s) {
        if (parent_[s] == slot) {
          parent_[s] = kNoSlot;
        }
      }
      children_[slot] = 0;
    }
  }
  SlotId PickVictim(const std::function<bool(SlotId)>& evictable) override {
    for (SlotId s = leaves_.tail(); s != kNoSlot; s = leaves_.Prev(s)) {
      if (evictable(s)) return s;
    }
    // No leaf may go (each is pinned: read, or written to a lower tier). Keeping their
    // ancestors would let a few pinned leaves fill the tier and refuse every store, so the
    // nearest ancestor that may go does, coldest leaf first: its chain loses the least.
    std::vector<bool> seen(parent_.size(), false);
    for (SlotId leaf = leaves_.tail(); leaf != kNoSlot; leaf = leaves_.Prev(leaf)) {
      for (SlotId s = parent_[leaf]; s != kNoSlot && !seen[s]; s = parent_[s]) {
        seen[s] = true;
        if (evictable(s)) return s;
      }
    }
    return kNoSlot;
  }

 private:
  SlotList leaves_;
  std::vector<SlotId> parent_;
  std::vector<uint32_t> children_;
  std::vector<bool> inserted_;  // OnInsert seen and no OnRemove since
};

}  // namespace

Result<EvictionPolicyKind> ParseEvictionPolicy(std::string_view name) {
  if (name == "lru" || name == "LRU") return EvictionPolicyKind::kLru;
  if (name == "prefix-aware" || name == "prefix_aware" || name == "prefix") {
    return EvictionPolicyKind::kPrefixAware;
  }
  return Status::InvalidArgument(
      fmt::format("unknown eviction policy \"{}\" (expected lru or prefix-aware)", name));
}

std::string_view EvictionPolicyName(EvictionPolicyKind kind) {
  return kind == EvictionPolicyKind::kLru ? "lru" : "prefix-aware";
}

std::unique_ptr<EvictionPolicy> MakeEvictionPolicy(EvictionPolicyKind kind, uint32_t capacity) {
  if (kind == EvictionPolicyKind::kLru) return std::make_unique<LruPolicy>(capacity);
  return std::make_unique<PrefixAwarePolicy>(capacity);
}

}  // namespace kvtier
