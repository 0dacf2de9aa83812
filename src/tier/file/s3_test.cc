// The file tier on a real S3-compatible server (scripts/s3-server.sh; skipped without one): the
// same chunk format as objects, published whole by one PUT (no temporary objects), the index
// rebuilt by listing the prefix, capacity enforced by LRU eviction, corrupt, truncated and
// vanished objects as misses, two tiers sharing one prefix, fsck, stats and purge over s3://,
// throttling absorbed by retries, and a hung server costing an engine load its deadline as a miss.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/task_pool.h"
#include "kvtier/cache_dir.h"
#include "kvtier/file_tier.h"
#ifdef KVTIER_S3_TEST_ENGINE
#include "kvtier/engine.h"
#endif
#include "testing/s3_fault_front.h"
#include "testing/s3_target.h"
#include "testing/wait.h"
#include "tier/file/test_chunks.h"
#include "tier/file/tier_keys.h"

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;
using testing::EnvOr;
using testing::FillChunk;
using testing::TestKey;
using testing::VerifyChunk;

constexpr uint64_t kChunk = 100000;  // not a multiple of 4 KiB, on purpose

FileTierOptions Options(const std::string& root) {
  FileTierOptions o;
  o.root = root;
  o.ns = testing::TestNamespace();
  o.chunk_bytes = kChunk;
  o.negative_cache_ttl = std::chrono::milliseconds(0);  // every miss asks the server
  o.connections = 4;
  return o;
}

std::unique_ptr<FileTier> OpenTier(const FileTierOptions& o) {
  auto tier = FileTier::Open(o);
  EXPECT_TRUE(tier.ok()) << o.root << ": " << tier.status().ToString();
  return tier.ok() ? std::move(tier).value() : nullptr;
}

void WriteKeys(FileTier& tier, uint64_t first, uint64_t count) {
  testing::WriteKeys(tier, first, count, kChunk);
}
void ExpectKeys(FileTier& tier, uint64_t first, uint64_t count) {
  testing::ExpectKeys(tier, first, count, kChunk);
}

// Every object below `dir`, by path relative to it.
std::vector<std::string> Objects(Env& env, const std::string& dir) {
  auto tree = env.ListTree(dir);
  EXPECT_TRUE(tree.ok()) << tree.status().ToString();
  std::vector<std::string> out;
  if (tree.ok()) {
    for (const TreeEntry& e : *tree) out.push_back(e.path);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Replaces the object at `path` with `bytes` (written from the side, as another host would).
void PutObject(Env& env, const std::string& path, std::span<const uint8_t> bytes) {
  OpenOptions o;
  o.write = o.create = o.truncate = true;
  auto f = env.Open(path, o);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  IoOp op = IoOp::Write(0, bytes);
  ASSERT_TRUE(WriteExact(**f, std::span<IoOp>(&op, 1)).ok());
  ASSERT_TRUE((*f)->Sync().ok());
}

std::vector<uint8_t> GetObject(Env& env, const std::string& path) {
  auto info = env.Stat(path);
  EXPECT_TRUE(info.ok()) << info.status().ToString();
  if (!info.ok()) return {};
  std::vector<uint8_t> out(info->size);
  auto f = env.Open(path, OpenOptions{});
  EXPECT_TRUE(f.ok());
  IoOp op = IoOp::Read(0, out);
  EXPECT_TRUE(ReadExact(**f, std::span<IoOp>(&op, 1)).ok());
  return out;
}

TEST(S3FileTierTest, ChunksAreObjectsPublishedWholeAndTheIndexIsRebuiltByListing) {
  KVTIER_S3_TEST_DIR(dir, "tier");
  std::string ns_dir;
  {
    auto tier = OpenTier(Options(dir->url()));
    ASSERT_NE(tier, nullptr);
    EXPECT_EQ(tier->Stats().io_engine, "s3");
    WriteKeys(*tier, 0, 12);
    ExpectKeys(*tier, 0, 12);
    ns_dir = tier->namespace_dir();
    auto info = dir->env().Stat(tier->ChunkPath(TestKey(3)));
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_EQ(info->size, tier->file_bytes());
    FileTierStats st = tier->Stats();
    EXPECT_EQ(st.chunks, 12u);
    EXPECT_EQ(st.errors, 0u);
  }
  // Twelve chunk objects, the two small files of the format, and nothing temporary.
  auto objects = Objects(dir->env(), dir->url());
  EXPECT_EQ(objects.size(), 14u);
  for (const std::string& o : objects) EXPECT_EQ(o.find(".tmp."), std::string::npos) << o;

  // A new tier (a restarted server) finds every chunk by listing, and reads them.
  auto again = OpenTier(Options(dir->url()));
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->Stats().chunks, 12u);
  std::vector<ChunkKey> keys;
  for (uint64_t i = 0; i < 12; ++i) keys.push_back(TestKey(i));
  EXPECT_EQ(again->LookupPrefix(keys), 12u);
  ExpectKeys(*again, 0, 12);
  EXPECT_EQ(again->Stats().disk_rechecks, 0u);  // all from the index
}

TEST(S3FileTierTest, CapacityEvictsTheLeastRecentlyUsedObjects) {
  KVTIER_S3_TEST_DIR(dir, "capacity");
  FileTierOptions o = Options(dir->url());
  {
    auto probe = OpenTier(o);
    ASSERT_NE(probe, nullptr);
    o.capacity_bytes = 4 * probe->file_bytes();
  }
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  WriteKeys(*tier, 0, 4);
  ExpectKeys(*tier, 0, 1);  // key 0 is now the most recently used
  WriteKeys(*tier, 4, 2);   // evicts keys 1 and 2
  FileTierStats st = tier->Stats();
  EXPECT_EQ(st.chunks, 4u);
  EXPECT_EQ(st.evictions, 2u);
  for (uint64_t gone : {1, 2}) {
    EXPECT_TRUE(dir->env().Stat(tier->ChunkPath(TestKey(gone))).status().IsNotFound()) << gone;
  }
  for (uint64_t kept : {0, 3, 4, 5}) {
    EXPECT_TRUE(dir->env().Stat(tier->ChunkPath(TestKey(kept))).ok()) << kept;
  }
}

TEST(S3FileTierTest, CorruptTruncatedAndVanishedObjectsAreMissesNeverWrongBytes) {
  KVTIER_S3_TEST_DIR(dir, "corrupt");
  auto tier = OpenTier(Options(dir->url()));
  ASSERT_NE(tier, nullptr);
  WriteKeys(*tier, 0, 3);
  Env& side = dir->env();
  // Key 0: one payload byte flipped. Key 1: cut short. Key 2: deleted.
  auto bytes = GetObject(side, tier->ChunkPath(TestKey(0)));
  ASSERT_FALSE(bytes.empty());
  bytes[4096 + 1234] ^= 0x01;
  PutObject(side, tier->ChunkPath(TestKey(0)), bytes);
  bytes = GetObject(side, tier->ChunkPath(TestKey(1)));
  bytes.resize(4096 + 5000);
  PutObject(side, tier->ChunkPath(TestKey(1)), bytes);
  ASSERT_TRUE(side.Unlink(tier->ChunkPath(TestKey(2))).ok());

  AlignedBuffer buf(kChunk);
  for (uint64_t i = 0; i < 3; ++i) {
    Status s = tier->Read(TestKey(i), buf.first(kChunk));
    EXPECT_TRUE(s.IsNotFound()) << i << ": " << s.ToString();
  }
  FileTierStats st = tier->Stats();
  EXPECT_EQ(st.corrupt, 2u);
  EXPECT_EQ(st.errors, 0u);
  EXPECT_EQ(st.chunks, 0u);
  // The corrupt ones were removed; rewriting brings every key back.
  EXPECT_TRUE(side.Stat(tier->ChunkPath(TestKey(0))).status().IsNotFound());
  WriteKeys(*tier, 0, 3);
  ExpectKeys(*tier, 0, 3);
}

TEST(S3FileTierTest, TwoTiersOnOnePrefixShareChunks) {
  KVTIER_S3_TEST_DIR(dir, "share");
  auto a = OpenTier(Options(dir->url()));
  auto b = OpenTier(Options(dir->url()));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  WriteKeys(*a, 0, 5);
  std::vector<ChunkKey> keys;
  for (uint64_t i = 0; i < 5; ++i) keys.push_back(TestKey(i));
  // A lookup answers from the index; the probe its miss queues finds the objects (HEAD).
  EXPECT_EQ(testing::LookupEventually(*b, keys), 5u);
  ExpectKeys(*b, 0, 5);
  EXPECT_EQ(b->Stats().found_on_disk, 5u);
  EXPECT_EQ(b->Stats().probe_hits, 5u);
  WriteKeys(*b, 10, 2);
  ExpectKeys(*a, 10, 2);
  // A rescan (one listing) indexes what the other wrote at once.
  WriteKeys(*b, 20, 3);
  ASSERT_TRUE(a->Rescan().ok());
  EXPECT_EQ(a->LookupPrefix(std::vector<ChunkKey>{TestKey(20), TestKey(21), TestKey(22)}), 3u);
  EXPECT_GE(a->Stats().rescans, 1u);
  EXPECT_EQ(a->Stats().rescan_failures, 0u);
}

TEST(S3FileTierTest, FsckStatsAndPurgeWorkOnS3) {
  KVTIER_S3_TEST_DIR(dir, "fsck");
  std::string damaged;
  {
    auto tier = OpenTier(Options(dir->url()));
    ASSERT_NE(tier, nullptr);
    WriteKeys(*tier, 0, 6);
    damaged = tier->ChunkPath(TestKey(4));
  }
  auto bytes = GetObject(dir->env(), damaged);
  bytes[4096 + 7] ^= 0x80;
  PutObject(dir->env(), damaged, bytes);

  auto summary = SummarizeCacheDir(dir->url());
  ASSERT_TRUE(summary.ok()) << summary.status().ToString();
  EXPECT_EQ(summary->chunks, 6u);
  ASSERT_EQ(summary->namespaces.size(), 1u);
  EXPECT_EQ(summary->namespaces[0].chunk_bytes, kChunk);

  FsckOptions fo;
  fo.repair = true;
  auto report = FsckCacheDir(dir->url(), fo);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->good, 5u);
  EXPECT_EQ(report->corrupt, 1u);
  EXPECT_EQ(report->removed, 1u);
  EXPECT_TRUE(report->clean());
  EXPECT_TRUE(dir->env().Stat(damaged).status().IsNotFound());

  auto purged = PurgeCacheDir(dir->url());
  ASSERT_TRUE(purged.ok()) << purged.status().ToString();
  EXPECT_EQ(purged->files, 5u + 1u);            // the chunks and namespace.json
  EXPECT_TRUE(CheckCacheDir(dir->url()).ok());  // the marker stays
  EXPECT_EQ(Objects(dir->env(), dir->url()), std::vector<std::string>{"kvtier-cache.json"});
}

TEST(S3FileTierTest, WrongCredentialsFailTheTierWithTheReason) {
  KVTIER_S3_TEST_DIR(dir, "creds");
  const std::string secret = EnvOr("AWS_SECRET_ACCESS_KEY");
  setenv("AWS_SECRET_ACCESS_KEY", (secret + "x").c_str(), 1);
  auto tier = FileTier::Open(Options(dir->url()));
  setenv("AWS_SECRET_ACCESS_KEY", secret.c_str(), 1);
  ASSERT_FALSE(tier.ok());
  EXPECT_EQ(tier.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(tier.status().message().find("AWS_SECRET_ACCESS_KEY"), std::string::npos)
      << tier.status().ToString();
}

// The tier through a fault front: an env of its own pointed at the front.
class S3FaultTierTest : public testing::S3FaultFixture {
 protected:
  // A request's deadline covers its retries: long by default, so that a throttled request that
  // must succeed does so on a slow machine; a short one only where a hang is tested.
  std::unique_ptr<Env> FrontEnv(const std::string& url,
                                std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    auto env = NewS3Env(FrontOptions(url, timeout));
    EXPECT_TRUE(env.ok()) << env.status().ToString();
    return env.ok() ? std::move(*env) : nullptr;
  }
};

TEST_F(S3FaultTierTest, ThrottledWritesAreRetriedAndPersistentThrottlingIsAnError) {
  KVTIER_S3_TEST_DIR(dir, "throttle");
  auto env = FrontEnv(dir->url());
  ASSERT_NE(env, nullptr);
  FileTierOptions o = Options(dir->url());
  o.env = env.get();
  auto tier = OpenTier(o);
  ASSERT_NE(tier, nullptr);
  front_->Inject(testing::S3FaultFront::Mode::kSlowDown, 3);
  WriteKeys(*tier, 0, 2);
  ExpectKeys(*tier, 0, 2);
  EXPECT_EQ(front_->injected(), 3);

  front_->Inject(testing::S3FaultFront::Mode::kSlowDown);
  AlignedBuffer buf(kChunk);
  FillChunk(TestKey(7), buf.first(kChunk));
  Status s = tier->Write(TestKey(7), buf.first(kChunk));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("SlowDown"), std::string::npos) << s.ToString();
  Status r = tier->Read(TestKey(0), buf.first(kChunk));
  EXPECT_FALSE(r.ok());
  EXPECT_FALSE(r.IsNotFound()) << "throttled is an error, not a miss: " << r.ToString();
  EXPECT_GE(tier->Stats().errors, 2u);
  front_->Inject(testing::S3FaultFront::Mode::kPass);
  ExpectKeys(*tier, 0, 2);  // nothing was lost
}

#ifdef KVTIER_S3_TEST_ENGINE
// A hung server: the engine's load ends at its deadline, as a miss; once the server answers
// again, loads hit again; shutting down does not hang.
TEST_F(S3FaultTierTest, AHungServerCostsTheLoadDeadlineNotAHang) {
  KVTIER_S3_TEST_DIR(dir, "hung");
  auto env = FrontEnv(dir->url(), std::chrono::milliseconds(1500));  // the reader's
  auto write_env = FrontEnv(dir->url());  // the setup's writes: the default, long deadline
  ASSERT_NE(env, nullptr);
  ASSERT_NE(write_env, nullptr);
  constexpr auto kDeadline = std::chrono::milliseconds(800);
  auto options = [&](WritePolicy policy) {
    EngineOptions o;
    o.ns = testing::TestNamespace();
    o.chunk_bytes = kChunk;
    o.memory.capacity_bytes = 4 * AlignUp(kChunk);
    o.memory.prefault = false;
    o.write_policy = policy;
    o.worker_threads = 1;
    o.file = Options(dir->url());
    o.file->env = policy == WritePolicy::kNone ? env.get() : write_env.get();
    // The writer (setup) waits for its writes however loaded the machine (a sanitizer build
    // beside other work took over 500 ms); only the reader meets the hang.
    o.file->stall_timeout = std::chrono::milliseconds(policy == WritePolicy::kNone ? 500 : 0);
    o.load_deadline = kDeadline;
    return o;
  };
  constexpr size_t kChunks = 2;
  std::vector<ChunkKey> keys;
  std::vector<std::vector<uint8_t>> in(kChunks, std::vector<uint8_t>(kChunk)),
      out(kChunks, std::vector<uint8_t>(kChunk));
  for (size_t i = 0; i < kChunks; ++i) {
    keys.push_back(TestKey(i));
    FillChunk(keys[i], in[i]);
  }
  std::vector<std::span<const uint8_t>> src(in.begin(), in.end());
  std::vector<std::span<uint8_t>> dst(out.begin(), out.end());
  {
    auto writer = Engine::Open(options(WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    auto stored = (*writer)->Store(keys, src);
    ASSERT_TRUE(stored.ok());
    ASSERT_TRUE(stored->Wait().status.ok());
    ASSERT_TRUE((*writer)->Drain());
  }
  auto reader = Engine::Open(options(WritePolicy::kNone));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();

  // Hung until the next Inject: a load that waited for the answer takes a minute, not the
  // deadline, however loaded the machine.
  front_->Inject(testing::S3FaultFront::Mode::kHang, -1, std::chrono::seconds(60));
  const auto t0 = Clock::now();
  auto loaded = (*reader)->Load(keys, dst);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  OpResult r = loaded->Wait();
  const auto took = Clock::now() - t0;
  EXPECT_LT(r.chunks, kChunks);
  EXPECT_LT(took, kDeadline + std::chrono::seconds(10))
      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  EXPECT_GT((*reader)->Stats().deadline_misses, 0u);

  front_->Inject(testing::S3FaultFront::Mode::kPass);
  bool hit = false;
  for (auto until = Clock::now() + std::chrono::seconds(20); !hit && Clock::now() < until;) {
    for (auto& o : out) std::fill(o.begin(), o.end(), 0);
    auto again = (*reader)->Load(keys, dst);
    ASSERT_TRUE(again.ok());
    OpResult a = again->Wait();
    hit = a.status.ok() && a.chunks == kChunks;
    if (!hit) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_TRUE(hit) << "no full hit within 20 s of the server answering again";
  for (size_t i = 0; i < kChunks; ++i) EXPECT_TRUE(VerifyChunk(keys[i], out[i])) << i;
  const auto t1 = Clock::now();
  reader->reset();
  EXPECT_LT(Clock::now() - t1, std::chrono::seconds(10));
  // Reads the engine abandoned at shutdown still use `env` until their requests end.
  EXPECT_TRUE(testing::WaitUntil([] { return TaskPool::DetachedRunning() == 0; }))
      << TaskPool::DetachedRunning() << " abandoned reads still running";
}
#endif  // KVTIER_S3_TEST_ENGINE

}  // namespace
}  // namespace kvtier
