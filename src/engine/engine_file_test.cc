// The engine with a file tier (L2) on a real filesystem: write policies, promotion, restart
// recovery, and load deadlines against stalled storage.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "common/sync_point.h"
#include "common/task_pool.h"
#include "engine/engine_internals.h"
#include "io/env_wrapper.h"
#include "io/fault_injection_env.h"
#include "kvtier/engine.h"
#include "kvtier/io.h"
#include "testing/temp_dir.h"
#include "testing/wait.h"

namespace kvtier {
namespace {

constexpr uint64_t kChunk = 64 * 1024;

std::vector<ChunkKey> Keys(size_t n, uint32_t seed = 0) {
  KeyNamespace ns;
  ns.model_id = "file-test-model";
  ns.chunk_tokens = 16;
  std::vector<uint32_t> tokens(n * 16);
  std::iota(tokens.begin(), tokens.end(), seed * 100000);
  return *ComputeChunkKeys(ns, tokens);
}

struct Chunks {
  Chunks(size_t n, uint8_t seed) : data(n, std::vector<uint8_t>(kChunk)) {
    std::mt19937 rng(seed);
    for (auto& d : data)
      for (auto& b : d) b = static_cast<uint8_t>(rng());
  }
  std::vector<std::span<const uint8_t>> In() const { return {data.begin(), data.end()}; }
  std::vector<std::span<uint8_t>> Out() { return {data.begin(), data.end()}; }
  std::vector<std::vector<uint8_t>> data;
};

// After a test released its stalled storage: the threads abandoned to it finish, so that nothing
// of theirs outlives the test.
void ExpectAbandonedThreadsFinish() {
  EXPECT_TRUE(testing::WaitUntil([] { return TaskPool::DetachedRunning() == 0; }))
      << TaskPool::DetachedRunning() << " abandoned threads still running";
}

EngineOptions Options(const std::string& dir, uint32_t l1_slots, WritePolicy policy) {
  EngineOptions o;
  o.ns.model_id = "file-test-model";
  o.ns.chunk_tokens = 16;
  o.chunk_bytes = kChunk;
  o.memory.capacity_bytes = l1_slots * kChunk;
  o.write_policy = policy;
  // One copy thread: these tests store more chunks than L1 has slots, and parallel stores may
  // find every slot reserved by another in-flight store (a rejection, tested in engine_test).
  o.worker_threads = 1;
  FileTierOptions f;
  f.root = dir;
  o.file = f;
  return o;
}

std::unique_ptr<Engine> OpenEngine(const EngineOptions& o) {
  auto e = Engine::Open(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

// An engine whose file tier goes through `env` (the caller's, outliving the engine): env's faults
// are off while the engine opens and on from then.
std::unique_ptr<Engine> OpenEngineThenFault(EngineOptions o, FaultInjectionEnv& env) {
  env.SetEnabled(false);
  o.file->env = &env;
  auto engine = OpenEngine(o);
  env.SetEnabled(true);
  return engine;
}

// The flusher writes the chunks next in eviction order (its headroom: one slot of two here)
// ahead of time, so each eviction finds a clean victim and nothing is lost.
TEST(EngineFileTest, WriteBackMovesChunksToFilesBeforeEviction) {
  testing::TempDir dir;
  auto engine = OpenEngine(Options(dir.path(), 2, WritePolicy::kWriteBack));
  ASSERT_TRUE(engine);
  auto keys = Keys(4);
  Chunks in(4, 1);
  const auto src = in.In();
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(engine->Store(std::span(keys).subspan(i, 1), std::span(src).subspan(i, 1))
                    ->Wait()
                    .status.ok());
    ASSERT_TRUE(engine->Drain());
  }
  EngineStats st = engine->Stats();
  EXPECT_EQ(st.write_backs, 3u);  // the last chunk is still the newest: not written yet
  EXPECT_EQ(st.file_detail.chunks, 3u);
  EXPECT_EQ(st.dirty_evictions, 0u);
  EXPECT_EQ(st.memory_detail.dirty, 1u);
  // The prefix now alternates between L1 and L2; it is still whole.
  EXPECT_EQ(engine->Lookup(keys).total, 4u);
  Chunks out(4, 9);
  OpResult r = engine->Load(keys, out.Out())->Wait();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(out.data, in.data);
  // The load's promotions took clean victims or none (the dirty newest chunk stays): whether
  // one found a clean victim unpinned depends on timing, that none lost a chunk does not.
  EXPECT_EQ(engine->Stats().dirty_evictions, 0u);
}

TEST(EngineFileTest, WriteThroughWritesEveryStoreAndSurvivesRestart) {
  testing::TempDir dir;
  auto keys = Keys(3);
  Chunks in(3, 2);
  {
    auto engine = OpenEngine(Options(dir.path(), 8, WritePolicy::kWriteThrough));
    ASSERT_TRUE(engine);
    ASSERT_TRUE(engine->Store(keys, in.In())->Wait().status.ok());
    engine->Drain();
    EXPECT_EQ(engine->Stats().file_detail.chunks, 3u);
    EXPECT_TRUE(EngineInternals::memory(*engine).DirtyKeys().empty());
  }
  // A new engine (a restarted process) finds the chunks on disk.
  auto engine = OpenEngine(Options(dir.path(), 8, WritePolicy::kWriteThrough));
  ASSERT_TRUE(engine);
  LookupResult hit = engine->Lookup(keys);
  EXPECT_EQ(hit.total, 3u);
  EXPECT_EQ(hit.memory, 0u);
  Chunks out(3, 7);
  ASSERT_TRUE(engine->Load(keys, out.Out())->Wait().status.ok());
  EXPECT_EQ(out.data, in.data);
  engine->Drain();  // promotion commits the L1 slot just after the copy is delivered
  EXPECT_EQ(engine->Lookup(keys).memory, 3u);
}

TEST(EngineFileTest, PolicyNoneNeverWrites) {
  testing::TempDir dir;
  auto engine = OpenEngine(Options(dir.path(), 1, WritePolicy::kNone));
  ASSERT_TRUE(engine);
  Chunks in(3, 3);
  ASSERT_TRUE(engine->Store(Keys(3), in.In())->Wait().status.ok());
  ASSERT_TRUE(engine->FlushDirty().ok());
  EXPECT_EQ(engine->Stats().file_detail.chunks, 0u);
  EXPECT_EQ(engine->Stats().write_backs, 0u);
}

TEST(EngineFileTest, FlushDirtyWritesBackEverythingAtShutdown) {
  testing::TempDir dir;
  auto engine = OpenEngine(Options(dir.path(), 8, WritePolicy::kWriteBack));
  ASSERT_TRUE(engine);
  Chunks in(3, 4);
  ASSERT_TRUE(engine->Store(Keys(3), in.In())->Wait().status.ok());
  EXPECT_EQ(EngineInternals::memory(*engine).DirtyKeys().size(), 3u);
  EXPECT_EQ(engine->Stats().file_detail.chunks, 0u);  // write-back: nothing yet
  ASSERT_TRUE(engine->FlushDirty().ok());
  EXPECT_EQ(engine->Stats().file_detail.chunks, 3u);
  EXPECT_TRUE(EngineInternals::memory(*engine).DirtyKeys().empty());
}

TEST(EngineFileTest, PrepareLoadPromotesAndPins) {
  testing::TempDir dir;
  auto keys = Keys(2);
  Chunks in(2, 5);
  {
    auto writer = OpenEngine(Options(dir.path(), 4, WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer->Store(keys, in.In())->Wait().status.ok());
  }
  auto engine = OpenEngine(Options(dir.path(), 4, WritePolicy::kWriteThrough));
  OpResult r = engine->PrepareLoad(keys)->Wait();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.slots.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    auto d = EngineInternals::memory(*engine).SlotData(r.slots[i]);
    EXPECT_TRUE(std::equal(d.begin(), d.end(), in.data[i].begin()));
  }
  EXPECT_EQ(engine->Stats().memory_detail.pinned, 2u);
  engine->Unpin(r.slots);
  EXPECT_EQ(engine->Stats().memory_detail.pinned, 0u);
}

// A load into caller buffers promotes what it reads from L2 only into room a clean chunk makes:
// with every evictable L1 chunk dirty (their writes failing), it leaves the chunk in L2 rather
// than lose one of them, and the caller still gets its data. PrepareLoad hands out the L1 slot
// itself, so it takes the room as a store would.
TEST(EngineFileTest, OptionalPromotionNeverEvictsADirtyChunk) {
  testing::TempDir dir;
  auto on_disk = Keys(1, 21);
  Chunks disk_data(1, 21);
  {
    auto writer = OpenEngine(Options(dir.path(), 2, WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer);
    ASSERT_TRUE(writer->Store(on_disk, disk_data.In())->Wait().status.ok());
    ASSERT_TRUE(writer->Drain());
  }
  FaultInjectionOptions f;
  f.write_error = 1;  // every write to L2 fails: L1's chunks stay dirty
  FaultInjectionEnv env(Env::Default(), f);
  auto engine = OpenEngineThenFault(Options(dir.path(), 2, WritePolicy::kWriteBack), env);
  ASSERT_TRUE(engine);
  auto in_memory = Keys(2, 22);
  Chunks memory_data(2, 22);
  ASSERT_TRUE(engine->Store(in_memory, memory_data.In())->Wait().status.ok());
  engine->Drain();
  ASSERT_EQ(EngineInternals::memory(*engine).DirtyKeys().size(), 2u);

  Chunks out(1, 0);
  OpResult r = engine->Load(on_disk, out.Out())->Wait();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(out.data, disk_data.data);
  engine->Drain();
  EngineStats st = engine->Stats();
  EXPECT_EQ(st.dirty_evictions, 0u);
  EXPECT_EQ(st.promotions, 0u);
  EXPECT_EQ(st.memory_detail.rejections, 0u);
  EXPECT_EQ(engine->Lookup(in_memory).memory, 2u);

  r = engine->PrepareLoad(on_disk)->Wait();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.slots.size(), 1u);
  engine->Unpin(r.slots);
  EXPECT_EQ(engine->Stats().dirty_evictions, 1u);
  env.SetEnabled(false);
}

// The synchronous answer takes only prefixes L1 ends: one that goes on in the file tier is left
// to PrepareLoad, with nothing pinned or counted by the attempt.
TEST(EngineFileTest, PrepareLoadFromMemoryOnlyWhenL1EndsThePrefix) {
  testing::TempDir dir;
  auto keys = Keys(3);
  Chunks in(3, 6);
  {
    auto writer = OpenEngine(Options(dir.path(), 4, WritePolicy::kWriteThrough));
    auto src = in.In();
    ASSERT_TRUE(
        writer->Store(std::span(keys).first(2), std::span(src).first(2))->Wait().status.ok());
  }
  auto engine = OpenEngine(Options(dir.path(), 4, WritePolicy::kWriteThrough));
  // Chunk 0 in L2 only: the prefix needs a read.
  EXPECT_FALSE(engine->PrepareLoadFromMemory(keys).has_value());
  EngineStats before = engine->Stats();
  EXPECT_EQ(before.memory_detail.pinned, 0u);
  EXPECT_EQ(before.memory.lookups, 0u);
  EXPECT_EQ(before.loads, 0u);

  OpResult promoted = engine->PrepareLoad(keys)->Wait();  // chunks 0 and 1 now in L1 as well
  ASSERT_EQ(promoted.slots.size(), 2u);
  engine->Unpin(promoted.slots);
  EXPECT_EQ(engine->Stats().file.served, 2u);  // read from the file tier and delivered
  const EngineStats after_promotion = engine->Stats();

  // L1 holds 0 and 1, and chunk 2 is nowhere: answered at once, counted as PrepareLoad counts.
  auto pinned = engine->PrepareLoadFromMemory(keys);
  ASSERT_TRUE(pinned.has_value());
  ASSERT_EQ(pinned->size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    auto d = engine->SlotData((*pinned)[i]);
    EXPECT_TRUE(std::equal(d.begin(), d.end(), in.data[i].begin()));
  }
  EngineStats s = engine->Stats();
  EXPECT_EQ(s.memory_detail.pinned, 2u);
  EXPECT_EQ(s.loads, after_promotion.loads + 1);
  // A load is not a lookup: it counts what it delivered, not what it found.
  EXPECT_EQ(s.memory.lookups, after_promotion.memory.lookups);
  EXPECT_EQ(s.memory.hits, after_promotion.memory.hits);
  EXPECT_EQ(s.memory.served, after_promotion.memory.served + 2);
  EXPECT_EQ(s.file.lookups, after_promotion.file.lookups);
  EXPECT_EQ(s.file.served, after_promotion.file.served);
  engine->Unpin(*pinned);
  EXPECT_EQ(engine->Stats().memory_detail.pinned, 0u);

  // A prefix nobody has: an empty answer, not a read.
  auto none = engine->PrepareLoadFromMemory(Keys(2, 7));
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->empty());
}

// An Env whose reads block while `stalled` is set: a storage server that stopped answering.
class StallingEnv : public EnvWrapper {
 public:
  explicit StallingEnv(Env* base) : EnvWrapper(base) {}
  void Stall(bool on) {
    std::lock_guard lock(mu_);
    stalled_ = on;
    cv_.notify_all();
  }
  void WaitWhileStalled() {
    std::unique_lock lock(mu_);
    if (stalled_) ++reads_stalled_;
    cv_.wait(lock, [this] { return !stalled_; });
  }
  // Reads that have waited (or wait now) for Stall(false).
  int reads_stalled() {
    std::lock_guard lock(mu_);
    return reads_stalled_;
  }
  std::string io_engine_name() const override { return "stalling " + base()->io_engine_name(); }
  Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& o) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stalled_ = false;
  int reads_stalled_ = 0;
};

class StallingFile : public File {
 public:
  StallingFile(std::unique_ptr<File> f, StallingEnv* env) : f_(std::move(f)), env_(env) {}
  const std::string& path() const override { return f_->path(); }
  bool direct() const override { return f_->direct(); }
  Status Submit(std::span<IoOp> ops, IoObserver* observer) override {
    if (!ops.empty() && ops[0].kind == IoOp::Kind::kRead) env_->WaitWhileStalled();
    return f_->Submit(ops, observer);
  }
  Status Sync() override { return f_->Sync(); }
  Result<uint64_t> Size() override { return f_->Size(); }

 private:
  std::unique_ptr<File> f_;
  StallingEnv* env_;
};

Result<std::unique_ptr<File>> StallingEnv::Open(const std::string& path, const OpenOptions& o) {
  KVTIER_ASSIGN_OR_RETURN(auto f, base()->Open(path, o));
  return std::unique_ptr<File>(new StallingFile(std::move(f), this));
}

TEST(EngineFileTest, StalledStorageBecomesAMissAtTheDeadline) {
  testing::TempDir dir;
  auto keys = Keys(2);
  Chunks in(2, 6);
  {
    auto writer = OpenEngine(Options(dir.path(), 4, WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer->Store(keys, in.In())->Wait().status.ok());
  }
  StallingEnv env(Env::Default());
  EngineOptions o = Options(dir.path(), 4, WritePolicy::kWriteThrough);
  o.file->env = &env;
  o.load_deadline = std::chrono::milliseconds(150);
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  env.Stall(true);
  Chunks out(2, 0);
  auto before = out.data;
  auto t0 = std::chrono::steady_clock::now();
  OpResult r = engine->Load(keys, out.Out())->Wait();
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.status.code(), StatusCode::kNotFound);
  EXPECT_EQ(r.chunks, 0u);
  EXPECT_LT(waited, 5.0);  // returned at the deadline, not when storage came back
  EXPECT_GE(engine->Stats().deadline_misses, 2u);
  env.Stall(false);  // storage comes back: the late reads land in L1, never in `out`
  engine->Drain();
  EXPECT_EQ(out.data, before);
  // The late chunks were promoted, so the next load is an L1 hit.
  EXPECT_EQ(engine->Lookup(keys).memory, 2u);
}

TEST(EngineFileTest, CorruptFileIsAMissNeverWrongData) {
  testing::TempDir dir;
  auto keys = Keys(1);
  Chunks in(1, 8);
  std::string path;
  {
    auto writer = OpenEngine(Options(dir.path(), 4, WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer->Store(keys, in.In())->Wait().status.ok());
    writer->Drain();
    path = EngineInternals::file(*writer)->ChunkPath(keys[0]);
  }
  {
    FILE* f = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, 4096 + 1000, SEEK_SET);
    int c = std::fgetc(f);
    std::fseek(f, 4096 + 1000, SEEK_SET);
    std::fputc(c ^ 0x10, f);
    std::fclose(f);
  }
  auto engine = OpenEngine(Options(dir.path(), 4, WritePolicy::kWriteThrough));
  Chunks out(1, 0);
  OpResult r = engine->Load(keys, out.Out())->Wait();
  EXPECT_EQ(r.chunks, 0u);
  EXPECT_NE(out.data, in.data);
  EXPECT_GE(engine->Stats().file_detail.corrupt, 1u);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

using namespace std::chrono_literals;

// Write-through under a burst larger than L2's write queue: every chunk reaches L2; the refused
// ones are deferred (counted, logged) and retried, never skipped in silence.
TEST(EngineFileTest, WriteThroughBurstSkipsNothing) {
  testing::TempDir dir;
  EngineOptions o = Options(dir.path(), 256, WritePolicy::kWriteThrough);
  o.file->write_threads = 1;
  o.file->max_queued_writes = 4;
  o.file->sync_data = false;  // the queue is the point here, not the disk
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  auto keys = Keys(200, 7);
  Chunks in(200, 7);
  ASSERT_TRUE(engine->Store(keys, in.In())->Wait().status.ok());
  EXPECT_TRUE(engine->Drain());
  EngineStats st = engine->Stats();
  EXPECT_EQ(st.file_detail.chunks, 200u);
  EXPECT_GT(st.write_through_deferred, 0u);
  EXPECT_EQ(st.write_through_dropped, 0u);
  EXPECT_EQ(st.file.errors, 0u);
  EXPECT_EQ(st.memory_detail.pinned, 0u);
}

// The same burst, and then nothing: no further store, no drain. Every deferred write-through
// reaches L2 by itself, including one deferred while the last write in flight was completing
// (no completion is left to retry it: the flusher's periodic pass does).
TEST(EngineFileTest, WriteThroughBurstReachesL2WithNothingAfterIt) {
  for (int round = 0; round < 5; ++round) {
    testing::TempDir dir;
    EngineOptions o = Options(dir.path(), 256, WritePolicy::kWriteThrough);
    o.file->write_threads = 1;
    o.file->max_queued_writes = 4;
    o.file->sync_data = false;
    auto engine = OpenEngine(o);
    ASSERT_TRUE(engine);
    auto keys = Keys(200, 8 + round);
    Chunks in(200, 8 + round);
    ASSERT_TRUE(engine->Store(keys, in.In())->Wait().status.ok());
    // A few milliseconds of writes; the deadline only bounds a failure.
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (engine->Stats().memory_detail.dirty > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(5ms);
    }
    EngineStats st = engine->Stats();
    EXPECT_EQ(st.memory_detail.dirty, 0u) << "round " << round;
    EXPECT_EQ(st.file_detail.chunks, 200u) << "round " << round;
  }
}

// The race that could leave a write-through chunk dirty for good after a burst. The flusher takes
// a dirty chunk next in eviction order just as a deferred write-through of it is retried: the
// retry finds the chunk being written and gives it up, and then the flusher's write is refused
// (L2's write queue is full). The chunk had no write left to come: the flusher retries only the
// chunks next in eviction order, and this one was read meanwhile. A sync point makes the retry
// run while the flusher holds the chunk; the chunk must still reach L2, with nothing stored after.
TEST(EngineFileTest, WriteThroughChunkWhoseFlusherWriteIsRefusedStillReachesL2) {
  testing::TempDir dir;
  static FaultInjectionEnv* env = new FaultInjectionEnv(Env::Default(), {});  // outlives writes
  constexpr uint32_t kSlots = 8;
  EngineOptions o = Options(dir.path(), kSlots, WritePolicy::kWriteThrough);
  o.memory.eviction = EvictionPolicyKind::kLru;
  o.file->env = env;
  o.file->write_threads = 1;
  o.file->max_queued_writes = 1;
  o.file->sync_data = false;
  o.file->stall_timeout = 0ms;  // the stalled write below holds its thread until released
  auto keys = Keys(kSlots, 41);
  Chunks in(kSlots, 41);
  auto blockers = Keys(2, 42);
  Chunks blocker_data(2, 42);
  SyncPointScope sync;
  std::atomic<bool> raced{false};
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  struct Release {
    ~Release() { env->ReleaseStalls(); }
  } release;  // before the engine goes, whatever fails
  MemoryTier& l1 = EngineInternals::memory(*engine);
  FileTier& l2 = *EngineInternals::file(*engine);
  // L2's write queue held full by writes of the test's own: one stuck in the kernel, one queued.
  // Every write-through is refused (deferred), and so is every flusher write.
  env->StallOpens(l2.ChunkPath(blockers[0]));
  ASSERT_TRUE(l2.WriteAsync(blockers[0], blocker_data.In()[0], nullptr).ok());
  ASSERT_EQ(env->WaitForStalls(1, 30000ms), 1u);
  ASSERT_TRUE(l2.WriteAsync(blockers[1], blocker_data.In()[1], nullptr).ok());
  // L1 full of dirty chunks: the flusher takes the coldest, keys[0], to keep one slot clean.
  SyncPoint::Get().SetCallBack("Engine::FlushPass:Taken", [&](void* arg) {
    auto* taken = static_cast<std::vector<MemoryTier::Dirty>*>(arg);
    if (raced || taken->size() != 1 || taken->front().key != keys[0]) return;
    // A completing write retries the deferred write-throughs now, keys[0]'s first.
    EngineInternals::ResubmitDeferred(*engine);
    // keys[0] is read: no longer next in eviction order, so the flusher will not come back to it.
    auto pinned = l1.Pin(keys[0]);
    ASSERT_TRUE(pinned.ok());
    l1.Unpin(*pinned);
    raced = true;
  });  // ... and the flusher's write of keys[0] is refused.
  ASSERT_TRUE(engine->Store(keys, in.In())->Wait().status.ok());
  ASSERT_TRUE(testing::WaitUntil([&] { return raced.load(); })) << "the flusher never took it";
  // The queue empties; nothing is stored or flushed after this.
  env->ReleaseStalls();
  ASSERT_TRUE(testing::WaitUntil([&] { return l2.LookupPrefix(std::span(keys).subspan(1)) == 7; }))
      << "the other chunks never reached L2";
  EXPECT_TRUE(testing::WaitUntil([&] { return l1.Stats().dirty == 0; }, 10000ms))
      << l1.Stats().dirty << " chunk(s) left dirty in L1, with no write to come";
  EXPECT_EQ(l2.LookupPrefix(std::span(keys).first(1)), 1u);
  EXPECT_EQ(engine->Stats().dirty_evictions, 0u);
}

// A write-through whose write failed (the storage, not the queue, said no) is tried again until
// L2 has it, with nothing stored or flushed after it. Under write-through nothing evicts a chunk
// L2 does not have, and the flusher, which retries its own failed writes, looks only at the
// chunks next in eviction order: here none (L1 has room).
TEST(EngineFileTest, FailedWriteThroughIsRetriedUntilL2HasIt) {
  testing::TempDir dir;
  FaultInjectionOptions f;
  f.write_error = 1;
  FaultInjectionEnv env(Env::Default(), f);
  auto engine = OpenEngineThenFault(Options(dir.path(), 8, WritePolicy::kWriteThrough), env);
  ASSERT_TRUE(engine);
  auto keys = Keys(2, 43);
  Chunks in(2, 43);
  ASSERT_TRUE(engine->Store(keys, in.In())->Wait().status.ok());
  ASSERT_TRUE(testing::WaitUntil([&] { return engine->Stats().file.errors >= 2; }));
  env.SetEnabled(false);  // the storage recovers
  EXPECT_TRUE(testing::WaitUntil([&] { return engine->Stats().memory_detail.dirty == 0; }, 10000ms))
      << engine->Stats().memory_detail.dirty << " chunk(s) left dirty in L1";
  EXPECT_EQ(engine->Stats().file_detail.chunks, 2u);
}

// Write-through keeps every store it acknowledges. With the file tier's storage hung, L1 fills
// with chunks the tier has not taken; the next store, by Store or by the server's ReserveSlots,
// is refused (retryable, counted) instead of evicting one of them. A burst of 3x L1: after the
// storage recovers, a restarted engine finds every acknowledged store on disk, byte for byte.
// (Write-back promises less: WriteBackNeverWaitsOnHungStorage.)
TEST(EngineFileTest, WriteThroughRefusesAStoreRatherThanLoseAnAcknowledgedOne) {
  testing::TempDir dir;
  static FaultInjectionEnv* env = new FaultInjectionEnv(Env::Default(), {});  // outlives writes
  constexpr uint32_t kSlots = 8;
  EngineOptions o = Options(dir.path(), kSlots, WritePolicy::kWriteThrough);
  o.file->env = env;
  auto keys = Keys(3 * kSlots, 21);
  Chunks in(3 * kSlots, 21);
  const auto src = in.In();
  std::vector<size_t> acknowledged;
  {
    auto engine = OpenEngine(o);
    ASSERT_TRUE(engine);
    env->StallOpens(dir.path());
    size_t refused = 0;
    for (size_t i = 0; i < 2 * kSlots; ++i) {
      OpResult r =
          engine->Store(std::span(keys).subspan(i, 1), std::span(src).subspan(i, 1))->Wait();
      if (r.status.ok()) {
        acknowledged.push_back(i);
      } else {
        EXPECT_TRUE(r.status.IsRejected()) << r.status.ToString();
        EXPECT_TRUE(r.status.retryable());
        ++refused;
      }
    }
    EXPECT_EQ(acknowledged.size(), kSlots);  // L1's slots, each holding an unwritten chunk
    EXPECT_EQ(refused, kSlots);
    // The server's path: a reservation is short (here empty) rather than evicting.
    const auto later = std::span(keys).subspan(2 * kSlots);
    EXPECT_TRUE(engine->ReserveSlots(later).empty());
    EngineStats st = engine->Stats();
    EXPECT_EQ(st.dirty_evictions, 0u);
    EXPECT_GE(st.memory_detail.dirty_refusals, refused + 1);
    // The storage recovers: the writes the stall failed are retried (the flusher retries those
    // next in eviction order; a flush, all), and stores are taken again.
    env->ReleaseStalls();
    ASSERT_TRUE(testing::WaitUntil([&] {
      if (engine->Stats().memory_detail.dirty == 0) return true;
      static_cast<void>(engine->FlushDirty());  // a failed flush is retried next poll
      return false;
    })) << engine->Stats().memory_detail.dirty << " chunks still dirty";
    std::vector<SlotId> slots = engine->ReserveSlots(later);
    ASSERT_EQ(slots.size(), later.size());
    for (size_t j = 0; j < slots.size(); ++j) {
      ASSERT_NE(slots[j], kNoSlot);
      auto d = EngineInternals::memory(*engine).SlotData(slots[j]);
      std::memcpy(d.data(), src[2 * kSlots + j].data(), d.size());
      acknowledged.push_back(2 * kSlots + j);
    }
    engine->CommitSlots(later, slots);
    EXPECT_TRUE(engine->Drain());
    EXPECT_EQ(engine->Stats().dirty_evictions, 0u);
  }
  // A restarted engine: every acknowledged store is on disk.
  o.file->env = nullptr;
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  for (size_t i : acknowledged) {
    Chunks out(1, 0);
    OpResult r = engine->Load(std::span(keys).subspan(i, 1), out.Out())->Wait();
    ASSERT_TRUE(r.status.ok()) << "acknowledged store " << i << " lost: " << r.status.ToString();
    EXPECT_EQ(out.data[0], in.data[i]) << "chunk " << i;
  }
  ExpectAbandonedThreadsFinish();
}

// A load of more chunks than the file tier's read queue holds waits for room instead of
// reporting the rest of the prefix as missing; so do loads running side by side.
TEST(EngineFileTest, LoadLargerThanTheReadQueueDeliversEverything) {
  testing::TempDir dir;
  auto keys = Keys(40, 8);
  Chunks in(40, 8);
  {
    auto writer = OpenEngine(Options(dir.path(), 64, WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer->Store(keys, in.In())->Wait().status.ok());
  }
  EngineOptions o = Options(dir.path(), 128, WritePolicy::kWriteThrough);
  o.file->read_threads = 1;
  o.file->max_queued_reads = 3;
  o.worker_threads = 2;
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  OpResult r = engine->PrepareLoad(keys)->Wait();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.slots.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    auto d = EngineInternals::memory(*engine).SlotData(r.slots[i]);
    ASSERT_TRUE(std::equal(d.begin(), d.end(), in.data[i].begin())) << "chunk " << i;
  }
  engine->Unpin(r.slots);
  // Two Loads into caller buffers at once, from a fresh engine (nothing in L1).
  auto cold = OpenEngine(o);
  ASSERT_TRUE(cold);
  Chunks out_a(40, 0), out_b(40, 0);
  auto a = cold->Load(keys, out_a.Out());
  auto b = cold->Load(keys, out_b.Out());
  ASSERT_TRUE(a.ok() && b.ok());
  OpResult ra = a->Wait(), rb = b->Wait();
  EXPECT_TRUE(ra.status.ok()) << ra.status.ToString();
  EXPECT_TRUE(rb.status.ok()) << rb.status.ToString();
  EXPECT_EQ(out_a.data, in.data);
  EXPECT_EQ(out_b.data, in.data);
  EXPECT_GT(cold->Stats().file_detail.read_queue_full, 0u);  // the queue did fill
}

// One failed L2 write is one error in the engine's stats (it was two: the tier's and the
// engine's). The write is retried (FailedWriteThroughIsRetriedUntilL2HasIt), each attempt
// failing once, until the storage recovers.
TEST(EngineFileTest, FailedWriteIsCountedOnce) {
  testing::TempDir dir;
  FaultInjectionOptions f;
  f.write_error = 1;
  FaultInjectionEnv env(Env::Default(), f);
  auto engine = OpenEngineThenFault(Options(dir.path(), 8, WritePolicy::kWriteThrough), env);
  ASSERT_TRUE(engine);
  auto keys = Keys(1, 9);
  Chunks in(1, 9);
  ASSERT_TRUE(engine->Store(keys, in.In())->Wait().status.ok());
  EXPECT_TRUE(engine->Drain());
  env.SetEnabled(false);
  EXPECT_TRUE(engine->Drain());  // a retry that failed before the recovery has been counted
  EngineStats st = engine->Stats();
  const uint64_t failed_writes = env.counters().write_errors;
  EXPECT_GE(failed_writes, 1u);
  EXPECT_EQ(st.file.errors, failed_writes);
  EXPECT_EQ(st.file_detail.errors, failed_writes);
  EXPECT_EQ(st.file.rejections, 0u);
}

// Write-back onto storage that hangs: stores never wait for it. With no clean victim, evictions
// lose dirty chunks, and every one is counted; the flusher's stuck write holds no more of L1
// than its headroom. Under either policy: a stuck leaf must not keep its ancestors from going.
TEST(EngineFileTest, WriteBackNeverWaitsOnHungStorage) {
  for (auto policy : {EvictionPolicyKind::kLru, EvictionPolicyKind::kPrefixAware}) {
    SCOPED_TRACE(EvictionPolicyName(policy));
    testing::TempDir dir;
    static FaultInjectionEnv* env = new FaultInjectionEnv(Env::Default(), {});
    EngineOptions o = Options(dir.path(), 4, WritePolicy::kWriteBack);
    o.memory.eviction = policy;
    o.file->env = env;
    o.file->stall_timeout = 100ms;
    auto engine = OpenEngine(o);
    ASSERT_TRUE(engine);
    env->StallOpens(dir.path());
    auto keys = Keys(12, 14);
    Chunks in(12, 14);
    const auto t0 = std::chrono::steady_clock::now();
    OpResult stored = engine->Store(keys, in.In())->Wait();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);  // the stall is endless
    EXPECT_TRUE(stored.status.ok()) << stored.status.ToString();
    EXPECT_EQ(stored.chunks, keys.size());
    EngineStats st = engine->Stats();
    EXPECT_EQ(st.memory_detail.evictions, 8u);
    EXPECT_EQ(st.dirty_evictions, 8u);
    EXPECT_EQ(st.memory_detail.rejections, 0u);
    EXPECT_EQ(st.write_backs, 0u);
    EXPECT_EQ(st.memory_detail.resident, 4u);
    EXPECT_LE(st.memory_detail.pinned, 1u);  // the headroom: one slot
    EXPECT_EQ(st.memory_detail.pinned, st.memory_detail.cleaning);
    engine.reset();  // bounded: the stuck write is abandoned after the stall timeout
    env->ReleaseStalls();
    ExpectAbandonedThreadsFinish();
  }
}

// A load cut at its deadline leaves none of its queued reads behind to delay the next load: with
// one read thread, the load's first read stalls and the others wait in the file tier's queue;
// once the load is over they are skipped, not read, and a later load's reads come right after
// the one that was under way.
TEST(EngineFileTest, ALoadCutAtItsDeadlineLeavesNoQueuedReads) {
  testing::TempDir dir;
  auto keys = Keys(6, 17);
  auto later = Keys(2, 18);
  Chunks in(6, 17), later_in(2, 18);
  {
    auto writer = OpenEngine(Options(dir.path(), 8, WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer->Store(keys, in.In())->Wait().status.ok());
    ASSERT_TRUE(writer->Store(later, later_in.In())->Wait().status.ok());
  }
  StallingEnv env(Env::Default());
  EngineOptions o = Options(dir.path(), 8, WritePolicy::kNone);
  o.file->env = &env;
  o.file->read_threads = 1;
  o.file->stall_timeout = 60s;  // no replacement thread takes a second read out of the queue
  // Long enough for the read thread to take up the first read on a slow machine, and for the
  // later loads (two and five reads, one at a time) to finish within it.
  o.load_deadline = 2s;
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  env.Stall(true);
  Chunks out(6, 0);
  auto op = engine->Load(keys, out.Out());
  ASSERT_TRUE(testing::WaitUntil([&] { return env.reads_stalled() == 1; }))
      << "the first read was not taken up";
  OpResult r = op->Wait();
  EXPECT_EQ(r.chunks, 0u);
  EXPECT_GE(engine->Stats().deadline_misses, 6u);
  env.Stall(false);
  Chunks later_out(2, 0);
  r = engine->Load(later, later_out.Out())->Wait();
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(later_out.data, later_in.data);
  ASSERT_TRUE(engine->Drain());
  EngineStats st = engine->Stats();
  EXPECT_EQ(st.file_detail.reads_unwanted, 5u);
  EXPECT_EQ(st.file_detail.reads, 1u + 2u);  // the stalled read and the later load's
  EXPECT_EQ(st.promotions, 1u + 2u);         // the stalled read's chunk came, and was kept
  // The skipped reads were forgotten: a new load of the chunks reads them.
  r = engine->Load(keys, out.Out())->Wait();
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(out.data, in.data);
}

// A load from storage that hangs in the kernel: a miss at the deadline with no L1 slot held for
// it, and the engine's destruction is bounded. The env outlives the test (abandoned reads return
// into it).
TEST(EngineFileTest, HungStorageHoldsNoSlotAndShutdownIsBounded) {
  testing::TempDir dir;
  static FaultInjectionEnv* env = new FaultInjectionEnv(Env::Default(), {});
  const uint32_t slots = 4;
  auto keys = Keys(2, 11);
  Chunks in(2, 11);
  {
    auto writer = OpenEngine(Options(dir.path(), slots, WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer->Store(keys, in.In())->Wait().status.ok());
  }
  EngineOptions o = Options(dir.path(), slots, WritePolicy::kWriteBack);
  o.file->env = env;
  o.file->read_threads = 1;
  o.file->stall_timeout = 100ms;
  o.load_deadline = 100ms;
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  env->StallOpens(keys[0].ToHex());
  Chunks out(2, 0);
  OpResult r = engine->Load(keys, out.Out())->Wait();
  EXPECT_EQ(r.chunks, 0u);
  EXPECT_GE(engine->Stats().deadline_misses, 1u);
  r = engine->PrepareLoad(keys)->Wait();
  EXPECT_EQ(r.chunks, 0u);
  EXPECT_TRUE(r.slots.empty());
  // Every L1 slot is free to use: none is reserved for the stuck reads.
  auto others = Keys(slots, 12);
  Chunks more(slots, 12);
  OpResult stored = engine->Store(others, more.In())->Wait();
  EXPECT_TRUE(stored.status.ok()) << stored.status.ToString();
  EXPECT_EQ(stored.chunks, slots);
  const MemoryTierStats m = engine->Stats().memory_detail;
  EXPECT_EQ(m.pinned, m.cleaning);  // only the flusher's writes in flight hold a slot
  // Shutdown gives up on the stuck reads instead of waiting for the kernel.
  auto t0 = std::chrono::steady_clock::now();
  engine.reset();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  env->ReleaseStalls();
  ExpectAbandonedThreadsFinish();
}

// Completion notification: OnDone runs once when a load ends, with nobody waiting on it: at the
// deadline when storage hangs (on the engine's deadline thread), at once when the load has ended
// already, and at shutdown for a load whose deadline has not come.
TEST(EngineFileTest, OnDoneComesAtTheDeadlineOnHungStorageWithNobodyWaiting) {
  testing::TempDir dir;
  static FaultInjectionEnv* env = new FaultInjectionEnv(Env::Default(), {});
  auto keys = Keys(2, 15);
  Chunks in(2, 15);
  {
    auto writer = OpenEngine(Options(dir.path(), 2, WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer->Store(keys, in.In())->Wait().status.ok());
  }
  EngineOptions o = Options(dir.path(), 4, WritePolicy::kNone);
  o.file->env = env;
  o.file->stall_timeout = 100ms;
  o.load_deadline = 200ms;
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  env->StallOpens(keys[0].ToHex());

  struct Seen {
    std::mutex mu;
    std::condition_variable cv;
    int calls = 0;
    OpResult result;
    std::thread::id thread;
  };
  auto watch = [](const std::shared_ptr<Seen>& seen) {
    return [seen](const OpResult& r) {
      std::lock_guard lock(seen->mu);
      seen->calls++;
      seen->result = r;
      seen->thread = std::this_thread::get_id();
      seen->cv.notify_all();
    };
  };
  auto wait_for = [](Seen& seen, std::chrono::milliseconds limit) {
    std::unique_lock lock(seen.mu);
    return seen.cv.wait_for(lock, limit, [&] { return seen.calls > 0; });
  };

  auto hung = std::make_shared<Seen>();
  const auto t0 = std::chrono::steady_clock::now();
  auto op = engine->PrepareLoad(keys);
  ASSERT_TRUE(op.ok());
  op->OnDone(watch(hung));
  ASSERT_TRUE(wait_for(*hung, testing::kWaitDeadline)) << "no completion at the deadline";
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, 10s);  // at the deadline, not at shutdown; generous for a loaded machine
  EXPECT_EQ(hung->result.chunks, 0u);
  EXPECT_TRUE(hung->result.slots.empty());
  EXPECT_NE(hung->thread, std::this_thread::get_id());
  EXPECT_TRUE(op->Done());
  EXPECT_GE(engine->Stats().deadline_misses, 1u);

  // Ended already: the callback runs here, at once.
  auto l1 = engine->Load({}, {});
  ASSERT_TRUE(l1.ok());
  auto now = std::make_shared<Seen>();
  l1->OnDone(watch(now));
  EXPECT_EQ(now->calls, 1);
  EXPECT_EQ(now->thread, std::this_thread::get_id());

  // Shutdown ends a load whose deadline is far off, and runs its callback.
  engine.reset();
  o.load_deadline = 60s;
  engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  auto late = std::make_shared<Seen>();
  op = engine->PrepareLoad(keys);
  ASSERT_TRUE(op.ok());
  op->OnDone(watch(late));
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(late->calls, 0);
  engine.reset();
  EXPECT_EQ(late->calls, 1);
  EXPECT_EQ(late->result.chunks, 0u);
  env->ReleaseStalls();
  ExpectAbandonedThreadsFinish();
}

// Concurrent loads of one L2 chunk share one read and one promotion: a second load of a chunk
// whose read is under way waits for that read rather than opening the file again; a read older
// than the load deadline (stuck in the kernel) is not waited for, a new one starts.
TEST(EngineFileTest, ConcurrentLoadsOfAChunkShareOneRead) {
  testing::TempDir dir;
  auto keys = Keys(3, 16);
  Chunks in(3, 16);
  {
    auto writer = OpenEngine(Options(dir.path(), 3, WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer->Store(keys, in.In())->Wait().status.ok());
  }
  // Bytes and promotion: several loads at once, every one gets the chunks, each read once.
  {
    EngineOptions o = Options(dir.path(), 8, WritePolicy::kNone);
    o.worker_threads = 4;
    auto engine = OpenEngine(o);
    ASSERT_TRUE(engine);
    std::vector<Chunks> outs(4, Chunks(3, 0));
    std::vector<OpHandle> ops;
    for (auto& out : outs) ops.push_back(*engine->Load(keys, out.Out()));
    for (size_t i = 0; i < ops.size(); ++i) {
      OpResult r = ops[i].Wait();
      EXPECT_TRUE(r.status.ok()) << r.status.ToString();
      EXPECT_EQ(outs[i].data, in.data);
    }
    EngineStats st = engine->Stats();
    EXPECT_EQ(st.promotions, 3u);
    EXPECT_EQ(st.file_detail.reads, 3u) << "a chunk was read from L2 more than once";
  }
  // Joining a read under way: ordered through the engine's sync points.
  if (!kSyncPointsBuiltIn) GTEST_SKIP() << "built with KVTIER_SYNC_POINTS=OFF";
  static FaultInjectionEnv* env = new FaultInjectionEnv(Env::Default(), {});
  EngineOptions o = Options(dir.path(), 4, WritePolicy::kNone);
  o.file->env = env;
  o.file->stall_timeout = 100ms;
  // The second load must come within the deadline of the first's read to join it: long enough
  // for a loaded machine (a sanitizer build's test process may not run for a second), short
  // because the test waits it out twice.
  o.load_deadline = 3s;
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  SyncPointScope sync;
  constexpr char kJoined[] = "Engine::StartFileReads:AfterJoin";  // joined, or started a read
  env->StallOpens(keys[0].ToHex());
  auto first = engine->PrepareLoad(std::span(keys).first(1));
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(env->WaitForStalls(1, testing::kWaitDeadline), 1u);
  auto second = engine->PrepareLoad(std::span(keys).first(1));
  ASSERT_TRUE(second.ok());
  // Until the second load has chosen between joining the read and starting its own.
  ASSERT_TRUE(SyncPoint::Get().WaitForHits(kJoined, 2, testing::kWaitDeadline));
  EXPECT_EQ(engine->Stats().shared_reads, 1u) << "the second load did not join the read";
  EXPECT_EQ(env->stalled_now(), 1u) << "the second load opened the chunk again";
  EXPECT_EQ(first->Wait().chunks, 0u);  // misses at the deadline, both
  EXPECT_EQ(second->Wait().chunks, 0u);
  // The stuck read is older than the deadline now: a new load reads the chunk itself.
  auto third = engine->PrepareLoad(std::span(keys).first(1));
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(env->WaitForStalls(2, testing::kWaitDeadline), 2u);
  EXPECT_EQ(third->Wait().chunks, 0u);
  engine.reset();
  env->ReleaseStalls();
  ExpectAbandonedThreadsFinish();
}

// A FIFO where an indexed chunk was: a miss at once (not a read thread lost to a blocking open).
TEST(EngineFileTest, FifoAtChunkPathIsAMiss) {
  testing::TempDir dir;
  auto keys = Keys(2, 13);
  Chunks in(2, 13);
  EngineOptions o = Options(dir.path(), 2, WritePolicy::kWriteThrough);
  o.promote_on_load = false;
  auto engine = OpenEngine(o);
  ASSERT_TRUE(engine);
  ASSERT_TRUE(engine->Store(keys, in.In())->Wait().status.ok());
  EXPECT_TRUE(engine->Drain());
  // Push both out of L1, then put a FIFO at the second's path.
  auto others = Keys(2, 14);
  Chunks more(2, 14);
  ASSERT_TRUE(engine->Store(others, more.In())->Wait().status.ok());
  const std::string path = EngineInternals::file(*engine)->ChunkPath(keys[1]);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  Chunks out(2, 0);
  for (int round = 0; round < 3; ++round) {
    OpResult r = engine->Load(keys, out.Out())->Wait();
    EXPECT_EQ(r.chunks, 1u);
    EXPECT_EQ(out.data[0], in.data[0]);
  }
  EngineStats st = engine->Stats();
  EXPECT_EQ(st.deadline_misses, 0u);
  EXPECT_EQ(st.file.errors, 0u);
}

}  // namespace
}  // namespace kvtier
