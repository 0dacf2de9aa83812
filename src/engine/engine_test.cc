#include "kvtier/engine.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <thread>

#include "engine/engine_internals.h"

namespace kvtier {
namespace {

constexpr uint64_t kChunk = 16 * 1024 + 100;  // deliberately not a multiple of 4 KiB

EngineOptions Options(uint32_t slots) {
  EngineOptions o;
  o.ns.model_id = "test-model";
  o.ns.chunk_tokens = 16;
  o.chunk_bytes = kChunk;
  o.memory.capacity_bytes = slots * 20480ull;
  return o;
}

std::vector<ChunkKey> Keys(size_t n, uint32_t seed = 0) {
  KeyNamespace ns;
  ns.model_id = "test-model";
  ns.chunk_tokens = 16;
  std::vector<uint32_t> tokens(n * 16);
  std::iota(tokens.begin(), tokens.end(), seed * 100000);
  return *ComputeChunkKeys(ns, tokens);
}

struct Buffers {
  Buffers(size_t n, uint8_t seed) : data(n, std::vector<uint8_t>(kChunk)) {
    std::mt19937 rng(seed);
    for (auto& d : data)
      for (auto& b : d) b = static_cast<uint8_t>(rng());
  }
  std::vector<std::span<const uint8_t>> In() const { return {data.begin(), data.end()}; }
  std::vector<std::span<uint8_t>> Out() { return {data.begin(), data.end()}; }
  std::vector<std::vector<uint8_t>> data;
};

TEST(EngineTest, OpenValidatesOptions) {
  EngineOptions o = Options(4);
  o.ns.model_id.clear();
  EXPECT_EQ(Engine::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(4);
  o.chunk_bytes = 0;
  EXPECT_EQ(Engine::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(4);
  o.memory.capacity_bytes = 1000;  // below one chunk
  auto r = Engine::Open(o);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("below one chunk"), std::string::npos);
  o = Options(4);
  o.worker_threads = 0;
  EXPECT_FALSE(Engine::Open(o).ok());
  EXPECT_EQ(ParseWritePolicy("sometimes").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseWritePolicy("write_back"), WritePolicy::kWriteBack);
}

TEST(EngineTest, StoreThenLoadRoundTrips) {
  auto engine = *Engine::Open(Options(8));
  auto keys = Keys(4);
  Buffers in(4, 1), out(4, 2);
  auto st = engine->Store(keys, in.In());
  ASSERT_TRUE(st.ok());
  OpResult sr = st->Wait();
  EXPECT_TRUE(sr.status.ok()) << sr.status.ToString();
  EXPECT_EQ(sr.chunks, 4u);
  EXPECT_EQ(engine->Lookup(keys).total, 4u);
  auto ld = engine->Load(keys, out.Out());
  ASSERT_TRUE(ld.ok());
  OpResult lr = ld->Wait();
  EXPECT_TRUE(lr.status.ok());
  EXPECT_EQ(lr.chunks, 4u);
  EXPECT_EQ(out.data, in.data);
  EngineStats stats = engine->Stats();
  EXPECT_EQ(stats.memory.bytes_in, 4 * kChunk);
  EXPECT_EQ(stats.memory.bytes_out, 4 * kChunk);
  EXPECT_EQ(stats.memory.hits, 4u);    // what the lookup found
  EXPECT_EQ(stats.memory.served, 4u);  // what the load delivered (not counted as found again)
  EXPECT_EQ(stats.memory.lookups, 1u);
  EXPECT_EQ(stats.stores, 1u);
}

TEST(EngineTest, LoadDeliversOnlyTheLeadingPrefix) {
  auto engine = *Engine::Open(Options(8));
  auto keys = Keys(4);
  Buffers in(4, 1), out(4, 2);
  // Store chunks 0, 1 and 3: chunk 3 is useless without chunk 2.
  std::vector<ChunkKey> some = {keys[0], keys[1], keys[3]};
  std::vector<std::span<const uint8_t>> src = {in.data[0], in.data[1], in.data[3]};
  ASSERT_TRUE(engine->Store(some, src)->Wait().status.ok());
  EXPECT_EQ(engine->Lookup(keys).total, 2u);
  auto before = out.data[3];
  OpResult lr = engine->Load(keys, out.Out())->Wait();
  EXPECT_EQ(lr.status.code(), StatusCode::kNotFound);
  EXPECT_EQ(lr.chunks, 2u);
  EXPECT_EQ(out.data[0], in.data[0]);
  EXPECT_EQ(out.data[1], in.data[1]);
  EXPECT_EQ(out.data[3], before);  // not touched
}

TEST(EngineTest, StoresAreIdempotent) {
  auto engine = *Engine::Open(Options(8));
  auto keys = Keys(2);
  Buffers a(2, 1), b(2, 9);
  ASSERT_TRUE(engine->Store(keys, a.In())->Wait().status.ok());
  OpResult again = engine->Store(keys, b.In())->Wait();
  EXPECT_TRUE(again.status.ok());
  EXPECT_EQ(again.chunks, 2u);
  Buffers out(2, 3);
  ASSERT_TRUE(engine->Load(keys, out.Out())->Wait().status.ok());
  EXPECT_EQ(out.data, a.data);  // the first store's bytes stay
}

TEST(EngineTest, BadBuffersAndEmptyOps) {
  auto engine = *Engine::Open(Options(4));
  auto keys = Keys(2);
  std::vector<uint8_t> small(10);
  std::vector<std::span<const uint8_t>> bad = {small, small};
  EXPECT_EQ(engine->Store(keys, bad).status().code(), StatusCode::kInvalidArgument);
  std::vector<std::span<const uint8_t>> one = {small};
  EXPECT_EQ(engine->Store(keys, one).status().code(), StatusCode::kInvalidArgument);
  auto empty_load = engine->Load({}, {});
  ASSERT_TRUE(empty_load.ok());
  EXPECT_TRUE(empty_load->Wait().status.ok());
  auto empty_store = engine->Store({}, {});
  ASSERT_TRUE(empty_store.ok());
  EXPECT_TRUE(empty_store->Wait().status.ok());
}

TEST(EngineTest, FullQueueRejectsInsteadOfBlocking) {
  EngineOptions o = Options(64);
  o.worker_threads = 1;
  o.max_queued_chunks = 4;
  auto engine = *Engine::Open(o);
  auto keys = Keys(8);
  Buffers in(8, 1);
  auto r = engine->Store(keys, in.In());  // 8 chunks > queue of 4: refused whole
  EXPECT_EQ(r.status().code(), StatusCode::kRejected);
  EXPECT_TRUE(r.status().retryable());
  EXPECT_EQ(engine->Stats().rejected_ops, 1u);
  EXPECT_EQ(engine->Lookup(keys).total, 0u);
}

TEST(EngineTest, FullTierRejectsChunksWhenAllPinned) {
  auto engine = *Engine::Open(Options(2));
  auto keys = Keys(4);
  Buffers in(4, 1);
  auto in_all = in.In();
  ASSERT_TRUE(
      engine->Store(std::span(keys).first(2), std::span(in_all).first(2))->Wait().status.ok());
  auto p0 = EngineInternals::memory(*engine).Pin(keys[0]);
  auto p1 = EngineInternals::memory(*engine).Pin(keys[1]);
  ASSERT_TRUE(p0.ok() && p1.ok());
  auto in_vec = in.In();
  OpResult r = engine->Store(std::span(keys).subspan(2), std::span(in_vec).subspan(2))->Wait();
  EXPECT_EQ(r.status.code(), StatusCode::kRejected);
  EXPECT_EQ(r.chunks, 0u);
  EngineInternals::memory(*engine).Unpin(*p0);
  EngineInternals::memory(*engine).Unpin(*p1);
}

TEST(EngineTest, PollAndWaitFor) {
  auto engine = *Engine::Open(Options(4));
  auto keys = Keys(1);
  Buffers in(1, 1);
  auto h = *engine->Store(keys, in.In());
  auto r = h.WaitFor(std::chrono::seconds(10));
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(h.Done());
}

// Concurrent clients store and load overlapping prefixes through a small tier; every chunk
// loaded must hold exactly the bytes stored under its key (derived from the key itself).
TEST(EngineTest, ConcurrentClientsStress) {
  EngineOptions o = Options(12);
  o.memory.eviction = EvictionPolicyKind::kPrefixAware;
  o.worker_threads = 3;
  o.max_queued_chunks = 64;
  auto engine = *Engine::Open(o);
  auto fill = [](const ChunkKey& k, std::vector<uint8_t>& d) {
    for (size_t i = 0; i < d.size(); ++i) d[i] = k.bytes()[i % 32] ^ static_cast<uint8_t>(i);
  };
  std::atomic<uint64_t> loaded{0}, wrong{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(c);
      for (int iter = 0; iter < 60; ++iter) {
        auto keys = Keys(1 + rng() % 5, rng() % 6);
        std::vector<std::vector<uint8_t>> bufs(keys.size(), std::vector<uint8_t>(kChunk));
        if (rng() % 2) {
          for (size_t i = 0; i < keys.size(); ++i) fill(keys[i], bufs[i]);
          std::vector<std::span<const uint8_t>> src(bufs.begin(), bufs.end());
          auto h = engine->Store(keys, src);
          if (h.ok()) h->Wait();
        } else {
          std::vector<std::span<uint8_t>> dst(bufs.begin(), bufs.end());
          auto h = engine->Load(keys, dst);
          if (!h.ok()) continue;
          OpResult r = h->Wait();
          for (size_t i = 0; i < r.chunks; ++i) {
            std::vector<uint8_t> want(kChunk);
            fill(keys[i], want);
            if (bufs[i] != want) wrong++;
            loaded++;
          }
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  engine->Drain();
  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_GT(loaded.load(), 0u);
  EngineStats st = engine->Stats();
  EXPECT_EQ(st.memory_detail.pinned, 0u);
  EXPECT_LE(st.memory_detail.resident, 12u);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

TEST(EngineZeroCopyTest, ReserveCommitPrepareLoadUnpin) {
  auto engine = *Engine::Open(Options(4));
  auto keys = Keys(3);
  std::vector<SlotId> slots = engine->ReserveSlots(keys);
  ASSERT_EQ(slots.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_NE(slots[i], kNoSlot);
    std::memset(EngineInternals::memory(*engine).SlotData(slots[i]).data(), int(i + 1), kChunk);
  }
  EXPECT_EQ(engine->Lookup(keys).total, 0u);  // invisible until committed
  engine->CommitSlots(keys, slots);
  EXPECT_EQ(engine->Lookup(keys).total, 3u);
  // Stores are idempotent: a second reservation reports "already there".
  std::vector<SlotId> again = engine->ReserveSlots(keys);
  EXPECT_EQ(again, std::vector<SlotId>(3, kNoSlot));

  OpResult r = engine->PrepareLoad(keys)->Wait();
  ASSERT_TRUE(r.status.ok());
  ASSERT_EQ(r.slots.size(), 3u);
  EXPECT_EQ(EngineInternals::memory(*engine).SlotData(r.slots[2])[0], 3);
  EXPECT_EQ(engine->Stats().memory_detail.pinned, 3u);
  engine->Unpin(r.slots);
  EXPECT_EQ(engine->Stats().memory_detail.pinned, 0u);

  // A reservation given back leaves nothing behind.
  auto other = Keys(1, 5);
  auto s = engine->ReserveSlots(other);
  ASSERT_EQ(s.size(), 1u);
  engine->AbortSlots(s);
  EXPECT_EQ(engine->Lookup(other).total, 0u);
  EXPECT_EQ(engine->ReserveSlots(other).size(), 1u);
}

}  // namespace
}  // namespace kvtier
