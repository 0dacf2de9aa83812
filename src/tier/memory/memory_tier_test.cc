#include "kvtier/memory_tier.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <map>
#include <random>
#include <thread>

namespace kvtier {
namespace {

ChunkKey Key(uint32_t i) {
  std::vector<uint32_t> t = {i};
  return ChainChunkKey(ChunkKey(), t);
}

std::unique_ptr<MemoryTier> OpenTier(uint32_t slots, uint64_t chunk = 8192,
                                     EvictionPolicyKind policy = EvictionPolicyKind::kLru) {
  MemoryTierOptions o;
  o.chunk_bytes = chunk;
  o.capacity_bytes = slots * ((chunk + 4095) / 4096 * 4096);
  o.eviction = policy;
  auto t = MemoryTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

void Put(MemoryTier& t, const ChunkKey& key, uint8_t fill, bool dirty = false,
         const ChunkKey* parent = nullptr) {
  auto r = t.Reserve(key, parent);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_FALSE(r->already_present);
  std::memset(t.SlotData(r->slot).data(), fill, t.chunk_bytes());
  t.Commit(r->slot, dirty);
}

TEST(MemoryTierTest, BadOptionsAreRefused) {
  MemoryTierOptions o;
  o.chunk_bytes = 0;
  EXPECT_EQ(MemoryTier::Open(o).status().code(), StatusCode::kInvalidArgument);
  o.chunk_bytes = 17ull << 30;
  EXPECT_EQ(MemoryTier::Open(o).status().code(), StatusCode::kInvalidArgument);
  o.chunk_bytes = 1 << 20;
  o.capacity_bytes = 1 << 19;  // below one chunk
  auto r = MemoryTier::Open(o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("below one chunk"), std::string::npos);
}

TEST(MemoryTierTest, SlotsAreAlignedAndShareable) {
  auto t = OpenTier(4, 5000);
  EXPECT_EQ(t->slot_bytes(), 8192u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->SlotData(1).data()) % 4096, 0u);
  Put(*t, Key(1), 0xab);
  // A second mapping of the fd (as another process would make) sees the same bytes.
  void* p = mmap(nullptr, t->arena_bytes(), PROT_READ, MAP_SHARED, t->fd(), 0);
  ASSERT_NE(p, MAP_FAILED);
  auto slot = t->Pin(Key(1));
  ASSERT_TRUE(slot.ok());
  EXPECT_EQ(static_cast<uint8_t*>(p)[t->SlotOffset(*slot) + 4999], 0xab);
  t->Unpin(*slot);
  munmap(p, t->arena_bytes());
}

TEST(MemoryTierTest, HugePagesFallBackCleanly) {
  MemoryTierOptions o;
  o.chunk_bytes = 1 << 20;
  o.capacity_bytes = 4 << 20;
  o.huge_pages = true;
  auto t = MemoryTier::Open(o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();  // huge pages or not, it must open
  EXPECT_EQ((*t)->num_slots(), 4u);
}

TEST(MemoryTierTest, StoreLookupPinAndIdempotence) {
  auto t = OpenTier(4);
  Put(*t, Key(0), 1);
  Put(*t, Key(1), 2);
  std::vector<ChunkKey> keys = {Key(0), Key(1), Key(2)};
  EXPECT_EQ(t->LookupPrefix(keys), 2u);
  auto again = t->Reserve(Key(0), nullptr);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->already_present);
  EXPECT_EQ(t->Pin(Key(2)).status().code(), StatusCode::kNotFound);
  // A reserved key is invisible until committed, and a second store of it is a no-op.
  auto r = t->Reserve(Key(2), nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(t->Contains(Key(2)));
  EXPECT_TRUE(t->Reserve(Key(2), nullptr)->already_present);
  t->Abort(r->slot);
  EXPECT_FALSE(t->Contains(Key(2)));
  EXPECT_FALSE(t->Reserve(Key(2), nullptr)->already_present);
}

// The listener (KV-cache events) hears of every chunk that becomes loadable or stops being:
// a commit, an eviction, a removal; never a reservation or an abort.
TEST(MemoryTierTest, TheListenerHearsCommitsEvictionsAndRemovals) {
  struct Recorder : TierListener {
    std::vector<std::pair<ChunkKey, bool>> calls;
    void OnTierChange(TierId tier, const ChunkKey& key, bool stored) noexcept override {
      EXPECT_EQ(tier, TierId::kMemory);
      calls.emplace_back(key, stored);
    }
  };
  auto recorder = std::make_shared<Recorder>();
  MemoryTierOptions o;
  o.chunk_bytes = 4096;
  o.capacity_bytes = 2 * 4096;
  o.eviction = EvictionPolicyKind::kLru;
  o.listener = recorder;
  auto t = std::move(MemoryTier::Open(o)).value();
  Put(*t, Key(0), 1);
  Put(*t, Key(1), 2);
  auto aborted = t->Reserve(Key(9), nullptr);  // evicts 0, then gives the slot back
  ASSERT_TRUE(aborted.ok());
  t->Abort(aborted->slot);
  ASSERT_TRUE(t->Remove(Key(1)).ok());
  const std::vector<std::pair<ChunkKey, bool>> expected = {
      {Key(0), true}, {Key(1), true}, {Key(0), false}, {Key(1), false}};
  EXPECT_EQ(recorder->calls, expected);
}

TEST(MemoryTierTest, PinnedSlotsAreNeverEvicted) {
  auto t = OpenTier(2);
  Put(*t, Key(0), 1);
  Put(*t, Key(1), 2);
  auto p0 = t->Pin(Key(0));
  auto p1 = t->Pin(Key(1));
  ASSERT_TRUE(p0.ok() && p1.ok());
  auto full = t->Reserve(Key(2), nullptr);
  EXPECT_EQ(full.status().code(), StatusCode::kRejected);
  EXPECT_EQ(t->Stats().rejections, 1u);
  t->Unpin(*p1);
  ASSERT_TRUE(t->Reserve(Key(3), nullptr).ok());  // evicts 1, the only unpinned one
  EXPECT_TRUE(t->Contains(Key(0)));
  EXPECT_FALSE(t->Contains(Key(1)));
  EXPECT_EQ(t->SlotData(*p0)[0], 1);  // the pinned data is intact
  EXPECT_EQ(t->Remove(Key(0)).code(), StatusCode::kRejected);
  t->Unpin(*p0);
  EXPECT_TRUE(t->Remove(Key(0)).ok());
}

TEST(MemoryTierTest, CleanChunksAreEvictedBeforeDirtyOnes) {
  auto t = OpenTier(2);
  Put(*t, Key(0), 7, /*dirty=*/true);
  Put(*t, Key(1), 8, /*dirty=*/false);
  // Key 0 is older, but dirty: the clean key 1 goes first, and nothing is lost.
  auto r = t->Reserve(Key(2), nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->evicted_dirty);
  t->Commit(r->slot, /*dirty=*/true);
  EXPECT_TRUE(t->Contains(Key(0)));
  EXPECT_FALSE(t->Contains(Key(1)));
  // Only dirty chunks left. A promotion (its data safe below) is refused rather than lose one,
  // and that refusal is not a full tier's rejection.
  auto promotion = t->Reserve(Key(3), nullptr, MemoryTier::Victims::kCleanOnly);
  EXPECT_TRUE(promotion.status().IsRejected()) << promotion.status().ToString();
  EXPECT_TRUE(t->Contains(Key(0)));
  EXPECT_FALSE(t->Contains(Key(3)));
  EXPECT_EQ(t->Stats().rejections, 0u);
  // A store: the oldest goes, and the caller is told it reached no lower tier.
  r = t->Reserve(Key(3), nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->evicted_dirty);
  EXPECT_EQ(r->evicted_key, Key(0));
  t->Commit(r->slot, false);
  MemoryTierStats st = t->Stats();
  EXPECT_EQ(st.evictions, 2u);
  EXPECT_EQ(st.dirty_evictions, 1u);
  EXPECT_EQ(st.dirty, 1u);  // key 2
}

TEST(MemoryTierTest, FlushCandidatesFollowEvictionOrderWithinTheHeadroom) {
  auto t = OpenTier(4);
  for (uint32_t i = 0; i < 4; ++i) Put(*t, Key(i), static_cast<uint8_t>(i), /*dirty=*/i != 1);
  // No free slot; a headroom of 3 covers the three oldest (0, 1, 2): 0 and 2 are dirty.
  auto taken = t->TakeFlushCandidates(3, 10);
  ASSERT_EQ(taken.size(), 2u);
  EXPECT_EQ(taken[0].key, Key(0));
  EXPECT_EQ(taken[1].key, Key(2));
  EXPECT_EQ(t->SlotData(taken[0].slot)[0], 0);
  // Being cleaned: pinned (not evictable), not taken twice, not begun again.
  EXPECT_TRUE(t->TakeFlushCandidates(3, 10).empty());
  EXPECT_EQ(t->BeginClean(Key(0)).status().code(), StatusCode::kRejected);  // another writer's
  EXPECT_EQ(t->Stats().cleaning, 2u);
  EXPECT_EQ(t->Remove(Key(0)).code(), StatusCode::kRejected);
  t->EndClean(taken[0].slot, /*stored=*/true);
  t->EndClean(taken[1].slot, /*stored=*/false);  // a failed write: still dirty, taken again
  EXPECT_EQ(t->Stats().dirty, 2u);
  EXPECT_EQ(t->Stats().pinned, 0u);
  taken = t->TakeFlushCandidates(3, 10);
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(taken[0].key, Key(2));
  t->EndClean(taken[0].slot, true);
  // The oldest chunks are clean now: the next evictions lose nothing.
  Put(*t, Key(10), 1);
  Put(*t, Key(11), 1);
  EXPECT_EQ(t->Stats().dirty_evictions, 0u);
  // With enough free slots there is nothing to do.
  ASSERT_TRUE(t->Remove(Key(10)).ok());
  ASSERT_TRUE(t->Remove(Key(11)).ok());
  EXPECT_TRUE(t->TakeFlushCandidates(2, 10).empty());
  // Write-through's way in: one named chunk.
  auto slot = t->BeginClean(Key(3));
  ASSERT_TRUE(slot.ok());
  t->EndClean(*slot, true);
  EXPECT_EQ(t->Stats().dirty, 0u);
  EXPECT_EQ(t->BeginClean(Key(3)).status().code(), StatusCode::kNotFound);  // clean: nothing to do
}

// Under the prefix-aware policy, leaves pinned by writes to a lower tier (slow or hung storage)
// must not make their whole chains unevictable: a tier with unpinned chunks takes a store.
TEST(MemoryTierTest, LeavesBeingCleanedDoNotMakeTheTierRefuseStores) {
  auto t = OpenTier(6, 4096, EvictionPolicyKind::kPrefixAware);
  ChunkKey a[3] = {Key(100), Key(101), Key(102)}, b[3] = {Key(200), Key(201), Key(202)};
  for (int i = 0; i < 3; ++i) {
    Put(*t, a[i], 1, /*dirty=*/true, i ? &a[i - 1] : nullptr);
    Put(*t, b[i], 2, /*dirty=*/true, i ? &b[i - 1] : nullptr);
  }
  auto taken = t->TakeFlushCandidates(2, 10);  // both leaves, the writes hang
  ASSERT_EQ(taken.size(), 2u);
  // A client reserves a batch of four (as a store of one prefix does), then fills them.
  std::vector<SlotId> batch;
  for (uint32_t i = 0; i < 4; ++i) {
    auto r = t->Reserve(Key(300 + i), nullptr);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status().ToString();
    batch.push_back(r->slot);
  }
  for (SlotId slot : batch) t->Commit(slot, false);
  EXPECT_EQ(t->Stats().rejections, 0u);
  // The two leaves being written stayed, with their data.
  for (const auto& d : taken) EXPECT_EQ(t->SlotData(d.slot)[0], d.key == a[2] ? 1 : 2);
  for (const auto& d : taken) t->EndClean(d.slot, true);
  // Now only pinned slots would be left: nothing else may go, and the tier says so.
  for (uint32_t i = 0; i < 6; ++i)
    ASSERT_TRUE(t->Pin(i < 4 ? Key(300 + i) : taken[i - 4].key).ok());
  EXPECT_EQ(t->Reserve(Key(400), nullptr).status().code(), StatusCode::kRejected);
}

// A chunk being cleaned counts towards the headroom even where the walk no longer meets it (a
// leaf that gained a child while its write was in flight): writes never pin more slots than
// the headroom, so storage that hangs cannot take more of L1 than that.
TEST(MemoryTierTest, ChunksBeingCleanedCountTowardsTheHeadroomWhereverTheyAre) {
  auto t = OpenTier(4, 4096, EvictionPolicyKind::kPrefixAware);
  ChunkKey a0 = Key(100), a1 = Key(101), a2 = Key(102);
  Put(*t, a0, 1, /*dirty=*/true);
  Put(*t, a1, 1, true, &a0);
  Put(*t, Key(5), 1, true);
  Put(*t, Key(6), 1, true);
  auto taken = t->TakeFlushCandidates(1, 10);  // the coldest leaf, a1
  ASSERT_EQ(taken.size(), 1u);
  EXPECT_EQ(taken[0].key, a1);
  ASSERT_TRUE(t->Remove(Key(6)).ok());
  Put(*t, a2, 1, true, &a1);  // a1 is no leaf now: the walk passes it by
  EXPECT_TRUE(t->TakeFlushCandidates(1, 10).empty());
  EXPECT_EQ(t->Stats().cleaning, 1u);
  EXPECT_EQ(t->Stats().pinned, 1u);
  t->EndClean(taken[0].slot, /*stored=*/true);
  taken = t->TakeFlushCandidates(1, 10);  // the headroom is free again: the next leaf
  ASSERT_EQ(taken.size(), 1u);
  t->EndClean(taken[0].slot, true);
}

TEST(MemoryTierTest, PrefixAwareTierKeepsHeadsOfPrefixes) {
  auto t = OpenTier(3, 4096, EvictionPolicyKind::kPrefixAware);
  ChunkKey a0 = Key(100), a1 = Key(101), a2 = Key(102);
  Put(*t, a0, 1);
  Put(*t, a1, 1, false, &a0);
  Put(*t, a2, 1, false, &a1);
  Put(*t, Key(5), 1);  // needs room: the tail a2 goes, not the head a0
  EXPECT_TRUE(t->Contains(a0));
  EXPECT_TRUE(t->Contains(a1));
  EXPECT_FALSE(t->Contains(a2));
}

// Many threads store, pin, read and evict at random; every read must see the bytes that were
// stored for that key, and the tier's view must match a model of what can be resident.
TEST(MemoryTierTest, ConcurrentStressAgainstModel) {
  constexpr uint32_t kSlots = 16, kKeys = 64, kThreads = 4, kOps = 4000;
  auto t = OpenTier(kSlots, 4096, EvictionPolicyKind::kPrefixAware);
  std::atomic<uint64_t> verified{0}, bad{0};
  auto fill_of = [](uint32_t k) { return static_cast<uint8_t>(k * 37 + 11); };
  std::vector<std::thread> threads;
  for (uint32_t th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] {
      std::mt19937 rng(th);
      for (uint32_t op = 0; op < kOps; ++op) {
        uint32_t k = rng() % kKeys;
        if (rng() % 2) {
          ChunkKey parent = Key(k - 1);
          auto r = t->Reserve(Key(k), k % 8 ? &parent : nullptr);
          if (!r.ok()) {
            if (!r.status().IsRejected()) bad++;
            continue;
          }
          if (r->already_present) continue;
          std::memset(t->SlotData(r->slot).data(), fill_of(k), t->chunk_bytes());
          if (rng() % 10 == 0) {
            t->Abort(r->slot);
          } else {
            t->Commit(r->slot, false);
          }
        } else {
          auto s = t->Pin(Key(k));
          if (!s.ok()) continue;
          auto d = t->SlotData(*s);
          if (d[0] != fill_of(k) || d[d.size() - 1] != fill_of(k)) bad++;
          verified++;
          t->Unpin(*s);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_GT(verified.load(), 0u);
  MemoryTierStats st = t->Stats();
  EXPECT_EQ(st.pinned, 0u);
  EXPECT_LE(st.resident, kSlots);
  // Model check: every key the tier reports resident holds that key's bytes.
  uint32_t resident = 0;
  for (uint32_t k = 0; k < kKeys; ++k) {
    if (!t->Contains(Key(k))) continue;
    ++resident;
    auto s = t->Pin(Key(k));
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(t->SlotData(*s)[17], fill_of(k));
    t->Unpin(*s);
  }
  EXPECT_EQ(resident, st.resident);
}

}  // namespace
}  // namespace kvtier
