// Every injected fault must end as a miss or a clear error: never a crash, never wrong data.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "io/fault_injection_env.h"
#include "kvtier/cache_dir.h"
#include "kvtier/file_tier.h"
#include "testing/storage_dir.h"
#include "tier/file/test_chunks.h"

namespace kvtier {
namespace {

using testing::FillChunk;
using testing::TestKey;
using testing::VerifyChunk;
namespace fs = std::filesystem;

constexpr uint64_t kChunk = 64 << 10;

// Four requests per payload: more places for faults. Over NFS, an NFS env for `dir`.
std::unique_ptr<Env> SmallRequestEnv(const testing::StorageDir& dir) {
  if (dir.nfs()) {
    NfsEnvOptions no;
    no.url = dir.path();
    no.max_request_bytes = 16 << 10;
    auto env = NewNfsEnv(no);
    EXPECT_TRUE(env.ok()) << env.status().ToString();
    return env.ok() ? std::move(env).value() : nullptr;
  }
  PosixEnvOptions eo;
  eo.max_request_bytes = 16 << 10;
  eo.max_write_request_bytes = 16 << 10;
  return NewPosixEnv(eo).value();
}

// The env a test wraps: the default one, or an NFS env for an nfs:// directory (`holder` keeps
// it alive). Null, with a failure recorded, if the NFS server cannot be reached.
Env* BaseEnv(const testing::StorageDir& dir, EnvForPath* holder) {
  auto env = OpenEnvForPath(dir.path());
  EXPECT_TRUE(env.ok()) << env.status().ToString();
  if (!env.ok()) return nullptr;
  *holder = std::move(env).value();
  return holder->env;
}

FileTierOptions Options(const std::string& root, Env* env) {
  FileTierOptions o;
  o.root = root;
  o.ns = testing::TestNamespace();
  o.chunk_bytes = kChunk;
  o.env = env;
  o.negative_cache_ttl = std::chrono::milliseconds(0);
  return o;
}

bool Allowed(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk:
    case StatusCode::kNotFound:
    case StatusCode::kIOError:
    case StatusCode::kNoSpace:
      return true;
    default:
      return false;
  }
}

TEST(FileTierFaultTest, RandomFaultsEndAsMissesOrErrorsNeverWrongData) {
  testing::StorageDir top;
  auto base = SmallRequestEnv(top);
  ASSERT_NE(base, nullptr);
  uint64_t injected = 0, wrong = 0, reads_ok = 0;
  for (uint64_t seed = 1; seed <= 24; ++seed) {
    SCOPED_TRACE(seed);
    const std::string root = top.Sub("seed" + std::to_string(seed));
    FaultInjectionOptions fo;
    fo.seed = seed;
    fo.read_error = 0.03;
    fo.write_error = 0.03;
    fo.no_space = 0.03;
    fo.short_read = 0.15;
    fo.short_write = 0.15;
    fo.bit_flip = 0.04;
    fo.sync_error = 0.05;
    fo.metadata_error = 0.03;
    FaultInjectionEnv env(base.get(), fo);
    env.SetEnabled(false);
    FileTierOptions o = Options(root, &env);
    o.capacity_bytes = 6 * (4096 + kChunk);
    auto tier = FileTier::Open(o);
    ASSERT_TRUE(tier.ok()) << tier.status().ToString();
    env.SetEnabled(true);
    std::mt19937_64 rng(seed);
    AlignedBuffer buf(kChunk);
    for (int op = 0; op < 80; ++op) {
      ChunkKey key = TestKey(rng() % 10);
      if (rng() % 2) {
        FillChunk(key, buf.span());
        Status s = (*tier)->Write(key, buf.span());
        EXPECT_TRUE(Allowed(s)) << s.ToString();
      } else {
        std::memset(buf.data(), 0xab, buf.size());
        Status s = (*tier)->Read(key, buf.span());
        EXPECT_TRUE(Allowed(s)) << s.ToString();
        if (s.ok()) {
          ++reads_ok;
          if (!VerifyChunk(key, buf.span())) ++wrong;
        }
      }
      (void)(*tier)->LookupPrefix(std::vector<ChunkKey>{TestKey(0), TestKey(1)});
    }
    injected += env.counters().total();

    // Faults off: every chunk is right or a miss; the directory checks clean after repair.
    env.SetEnabled(false);
    for (int k = 0; k < 10; ++k) {
      Status s = (*tier)->Read(TestKey(k), buf.span());
      EXPECT_TRUE(s.ok() || s.IsNotFound()) << s.ToString();
      if (s.ok() && !VerifyChunk(TestKey(k), buf.span())) ++wrong;
    }
    FileTierStats st = (*tier)->Stats();
    tier.value().reset();
    FsckOptions fsck;
    fsck.repair = true;
    fsck.temp_grace = std::chrono::seconds(0);
    auto report = FsckCacheDir(root, fsck);
    ASSERT_TRUE(report.ok());
    EXPECT_EQ(report->corrupt, 0u) << "a fault during a write must never publish a bad chunk";
    EXPECT_TRUE(report->clean());
    EXPECT_LE(report->good_bytes, o.capacity_bytes);
    EXPECT_GE(st.errors + st.corrupt, 1u);
  }
  EXPECT_EQ(wrong, 0u);
  EXPECT_GT(injected, 200u) << "the test must actually inject faults";
  EXPECT_GT(reads_ok, 50u) << "and still serve chunks";
}

TEST(FileTierFaultTest, FullDiskIsNoSpaceAndLeavesNothingBehind) {
  testing::StorageDir dir;
  EnvForPath base;
  ASSERT_NE(BaseEnv(dir, &base), nullptr);
  FaultInjectionOptions fo;
  fo.no_space = 1.0;
  FaultInjectionEnv env(base.env, fo);
  env.SetEnabled(false);
  auto tier = FileTier::Open(Options(dir.path(), &env));
  ASSERT_TRUE(tier.ok());
  env.SetEnabled(true);
  AlignedBuffer buf(kChunk);
  FillChunk(TestKey(1), buf.span());
  EXPECT_EQ((*tier)->Write(TestKey(1), buf.span()).code(), StatusCode::kNoSpace);
  EXPECT_TRUE((*tier)->Read(TestKey(1), buf.span()).IsNotFound());
  size_t files = 0;
  for (auto& e : fs::recursive_directory_iterator(dir.LocalOf((*tier)->namespace_dir()))) {
    files += e.is_regular_file() && e.path().filename() != "namespace.json";
  }
  EXPECT_EQ(files, 0u);
  EXPECT_EQ((*tier)->Stats().errors, 1u);
}

TEST(FileTierFaultTest, BitFlipsInTransitAreCaughtByTheChecksum) {
  testing::StorageDir dir;
  EnvForPath base;
  ASSERT_NE(BaseEnv(dir, &base), nullptr);
  FaultInjectionOptions fo;
  fo.bit_flip = 1.0;
  FaultInjectionEnv env(base.env, fo);
  env.SetEnabled(false);
  auto tier = FileTier::Open(Options(dir.path(), &env));
  ASSERT_TRUE(tier.ok());
  AlignedBuffer buf(kChunk);
  for (int i = 0; i < 8; ++i) {
    FillChunk(TestKey(i), buf.span());
    ASSERT_TRUE((*tier)->Write(TestKey(i), buf.span()).ok());
  }
  env.SetEnabled(true);
  for (int i = 0; i < 8; ++i) EXPECT_TRUE((*tier)->Read(TestKey(i), buf.span()).IsNotFound());
  EXPECT_EQ((*tier)->Stats().corrupt, 8u);
  EXPECT_EQ((*tier)->Stats().hits, 0u);
}

// Writes `n` chunks through a tier on `env`, closes it, and simulates a power failure.
void WriteThenCrash(const std::string& root, FaultInjectionEnv* env, bool sync_data,
                    bool sync_directory, int n) {
  FileTierOptions o = Options(root, env);
  o.sync_data = sync_data;
  o.sync_directory = sync_directory;
  {
    auto tier = FileTier::Open(o);
    ASSERT_TRUE(tier.ok());
    AlignedBuffer buf(kChunk);
    for (int i = 0; i < n; ++i) {
      FillChunk(TestKey(i), buf.span());
      ASSERT_TRUE((*tier)->Write(TestKey(i), buf.span()).ok());
    }
  }
  ASSERT_TRUE(env->SimulateCrash().ok());
}

struct AfterCrash {
  int hits = 0, misses = 0, wrong = 0;
  uint64_t corrupt = 0;
};
AfterCrash ReadBack(const std::string& root, int n) {
  AfterCrash r;
  auto tier = FileTier::Open(Options(root, nullptr));
  EXPECT_TRUE(tier.ok()) << tier.status().ToString();
  if (!tier.ok()) return r;
  AlignedBuffer buf(kChunk);
  for (int i = 0; i < n; ++i) {
    Status s = (*tier)->Read(TestKey(i), buf.span());
    EXPECT_TRUE(s.ok() || s.IsNotFound()) << s.ToString();
    if (s.ok()) {
      ++r.hits;
      r.wrong += !VerifyChunk(TestKey(i), buf.span());
    } else {
      ++r.misses;
    }
  }
  r.corrupt = (*tier)->Stats().corrupt;
  return r;
}

TEST(FileTierFaultTest, PowerLossKeepsChunksPublishedWithDataAndDirectorySync) {
  testing::StorageDir dir;
  EnvForPath base;
  ASSERT_NE(BaseEnv(dir, &base), nullptr);
  FaultInjectionEnv env(base.env, FaultInjectionOptions{});
  WriteThenCrash(dir.path(), &env, true, true, 6);
  AfterCrash r = ReadBack(dir.path(), 6);
  EXPECT_EQ(r.hits, 6);
  EXPECT_EQ(r.wrong, 0);
}

TEST(FileTierFaultTest, PowerLossWithoutDirectorySyncLosesChunksAsMisses) {
  testing::StorageDir dir;
  EnvForPath base;
  ASSERT_NE(BaseEnv(dir, &base), nullptr);
  FaultInjectionEnv env(base.env, FaultInjectionOptions{});
  WriteThenCrash(dir.path(), &env, true, false, 6);
  AfterCrash r = ReadBack(dir.path(), 6);
  EXPECT_EQ(r.misses, 6);
  EXPECT_EQ(r.wrong, 0);
}

TEST(FileTierFaultTest, PowerLossWithoutDataSyncIsCaughtByChecksums) {
  testing::StorageDir dir;
  EnvForPath base;
  ASSERT_NE(BaseEnv(dir, &base), nullptr);
  FaultInjectionEnv env(base.env, FaultInjectionOptions{});
  WriteThenCrash(dir.path(), &env, false, true, 6);
  AfterCrash r = ReadBack(dir.path(), 6);
  EXPECT_EQ(r.hits, 0);
  EXPECT_EQ(r.wrong, 0);
  EXPECT_EQ(r.corrupt, 6u);  // the names survived, the data did not: detected, removed
  auto report = FsckCacheDir(dir.path(), FsckOptions{});
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->clean());
}

}  // namespace
}  // namespace kvtier
