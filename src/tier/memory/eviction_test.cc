#include "kvtier/eviction.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

auto kAll = [](SlotId) { return true; };

TEST(LruPolicyTest, EvictsLeastRecentlyUsed) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kLru, 4);
  for (SlotId s = 0; s < 4; ++s) p->OnInsert(s, kNoSlot);
  EXPECT_EQ(p->PickVictim(kAll), 0u);
  p->OnAccess(0);
  EXPECT_EQ(p->PickVictim(kAll), 1u);
  p->OnRemove(1);
  EXPECT_EQ(p->PickVictim(kAll), 2u);
  // Non-evictable (pinned) slots are skipped.
  EXPECT_EQ(p->PickVictim([](SlotId s) { return s != 2; }), 3u);
  EXPECT_EQ(p->PickVictim([](SlotId) { return false; }), kNoSlot);
}

TEST(LruPolicyTest, IgnoresPrefixStructure) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kLru, 3);
  p->OnInsert(0, kNoSlot);
  p->OnInsert(1, 0);
  p->OnInsert(2, 1);
  EXPECT_EQ(p->PickVictim(kAll), 0u);  // the head of the prefix goes first: what LRU gets wrong
}

TEST(PrefixAwarePolicyTest, FirstChunkOutlivesItsTail) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kPrefixAware, 8);
  // Prefix A: 0 -> 1 -> 2, inserted first (oldest). Prefix B: 3 -> 4.
  p->OnInsert(0, kNoSlot);
  p->OnInsert(1, 0);
  p->OnInsert(2, 1);
  p->OnInsert(3, kNoSlot);
  p->OnInsert(4, 3);
  // Eviction order must take A's tail before its head, and never a parent before its child.
  std::vector<SlotId> order;
  for (int i = 0; i < 5; ++i) {
    SlotId v = p->PickVictim(kAll);
    ASSERT_NE(v, kNoSlot);
    order.push_back(v);
    p->OnRemove(v);
  }
  EXPECT_EQ(p->PickVictim(kAll), kNoSlot);
  auto pos = [&](SlotId s) { return std::find(order.begin(), order.end(), s) - order.begin(); };
  EXPECT_LT(pos(2), pos(1));
  EXPECT_LT(pos(1), pos(0));
  EXPECT_LT(pos(4), pos(3));
  EXPECT_EQ(order.front(), 2u);  // A's tail is the oldest leaf
}

TEST(PrefixAwarePolicyTest, PinnedLeafProtectsItsAncestorsWhileAnotherLeafCanGo) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kPrefixAware, 4);
  p->OnInsert(0, kNoSlot);
  p->OnInsert(1, 0);
  p->OnInsert(2, kNoSlot);
  // Leaf 1 is pinned: 0 is not a leaf, so 2 goes first.
  EXPECT_EQ(p->PickVictim([](SlotId s) { return s != 1; }), 2u);
}

// Every leaf pinned (reads, or writes to a lower tier that hang): the tier still has chunks
// that may go, and a store must get one rather than a refusal.
TEST(PrefixAwarePolicyTest, WhenEveryLeafIsPinnedTheNearestFreeAncestorGoes) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kPrefixAware, 8);
  // Prefix A: 0 -> 1 -> 2 (oldest); prefix B: 3 -> 4 -> 5. Both leaves pinned, and A's parent.
  for (SlotId s : {0u, 3u}) p->OnInsert(s, kNoSlot);
  for (SlotId s : {1u, 2u, 4u, 5u}) p->OnInsert(s, s - 1);
  auto unpinned = [](SlotId s) { return s != 2 && s != 5 && s != 1; };
  EXPECT_EQ(p->PickVictim(unpinned), 0u);  // A is the colder leaf; 1 is pinned, so its parent
  p->OnRemove(0);
  EXPECT_EQ(p->PickVictim(unpinned), 4u);  // A has nothing left to give: B's nearest ancestor
  p->OnRemove(4);
  EXPECT_EQ(p->PickVictim(unpinned), 3u);  // 3 is a leaf now
  p->OnRemove(3);
  EXPECT_EQ(p->PickVictim(unpinned), kNoSlot);  // only pinned chunks remain
  EXPECT_EQ(p->PickVictim(kAll), 2u);           // unpinned, leaves go first again
}

TEST(PrefixAwarePolicyTest, SharedParentStaysWhileAnyChildStays) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kPrefixAware, 4);
  p->OnInsert(0, kNoSlot);  // shared system prompt
  p->OnInsert(1, 0);        // user A
  p->OnInsert(2, 0);        // user B
  EXPECT_EQ(p->PickVictim(kAll), 1u);
  p->OnRemove(1);
  EXPECT_EQ(p->PickVictim(kAll), 2u);
  p->OnRemove(2);
  EXPECT_EQ(p->PickVictim(kAll), 0u);
}

TEST(PrefixAwarePolicyTest, AccessRefreshesLeaves) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kPrefixAware, 4);
  p->OnInsert(0, kNoSlot);
  p->OnInsert(1, kNoSlot);
  p->OnAccess(0);
  EXPECT_EQ(p->PickVictim(kAll), 1u);
}

TEST(PrefixAwarePolicyTest, RemovingAParentWithChildrenOrphansThem) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kPrefixAware, 4);
  p->OnInsert(0, kNoSlot);
  p->OnInsert(1, 0);
  p->OnRemove(0);  // explicit removal, not an eviction
  EXPECT_EQ(p->PickVictim(kAll), 1u);
  p->OnRemove(1);
  EXPECT_EQ(p->PickVictim(kAll), kNoSlot);
  p->OnInsert(0, kNoSlot);  // the slot can be reused cleanly
  EXPECT_EQ(p->PickVictim(kAll), 0u);
}

// A child may commit while its parent is still being filled. If the child goes before the
// parent is inserted, the parent must not be listed twice (a cycle in the leaf list).
TEST(PrefixAwarePolicyTest, ChildEvictedBeforeItsReservedParentIsInserted) {
  auto p = MakeEvictionPolicy(EvictionPolicyKind::kPrefixAware, 4);
  p->OnInsert(1, 0);  // slot 0 is reserved, not inserted
  p->OnRemove(1);     // the child is evicted first
  p->OnInsert(0, kNoSlot);
  p->OnInsert(2, kNoSlot);
  std::vector<SlotId> order;
  for (SlotId v; (v = p->PickVictim(kAll)) != kNoSlot;) {
    ASSERT_LT(order.size(), 4u) << "victim list loops";
    order.push_back(v);
    p->OnRemove(v);
  }
  EXPECT_EQ(order, (std::vector<SlotId>{0, 2}));
}

TEST(EvictionPolicyTest, ParseNames) {
  EXPECT_EQ(*ParseEvictionPolicy("lru"), EvictionPolicyKind::kLru);
  EXPECT_EQ(*ParseEvictionPolicy("prefix-aware"), EvictionPolicyKind::kPrefixAware);
  EXPECT_EQ(ParseEvictionPolicy("fifo").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier
