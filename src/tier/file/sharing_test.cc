// Tiers in separate processes share one directory: each sees the other's chunks, and racing
// writers of the same keys all succeed, leaving one valid file per key.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>
#include <thread>

#include "kvtier/cache_dir.h"
#include "kvtier/file_tier.h"
#include "testing/temp_dir.h"
#include "tier/file/test_chunks.h"
#include "tier/file/tier_keys.h"
#include "tier/file/worker_process.h"

namespace kvtier {
namespace {

namespace fs = std::filesystem;
using testing::TestKey;

constexpr uint64_t kChunk = 100000;  // not a multiple of 4 KiB, on purpose

std::vector<ChunkKey> Keys(uint64_t first, uint64_t count) {
  std::vector<ChunkKey> keys;
  for (uint64_t i = first; i < first + count; ++i) keys.push_back(TestKey(i));
  return keys;
}

std::unique_ptr<FileTier> OpenHere(const std::string& root) {
  FileTierOptions o;
  o.root = root;
  o.ns = testing::TestNamespace();
  o.chunk_bytes = kChunk;
  o.negative_cache_ttl = std::chrono::milliseconds(100);
  auto tier = FileTier::Open(o);
  EXPECT_TRUE(tier.ok()) << tier.status().ToString();
  return std::move(tier).value();
}

TEST(FileTierSharingTest, TwoProcessesSeeEachOthersChunks) {
  testing::TempDir dir;
  auto here = OpenHere(dir.path());
  testing::WorkerProcess other;
  ASSERT_TRUE(other.Start({"serve", dir.path(), std::to_string(kChunk), "0"}));
  ASSERT_EQ(other.ReadLine(), "ready");

  EXPECT_EQ(here->LookupPrefix(Keys(0, 10)), 0u);  // nothing yet: a probe finds key 0 absent
  ASSERT_TRUE(other.Send("write 0 10"));
  ASSERT_EQ(other.ReadLine(), "ok 10 0");
  // Lookups answer from the index: the other process's chunks appear once the negative cache
  // (100 ms here) has forgotten key 0 and the probe that the next lookup queues has found them.
  EXPECT_EQ(testing::LookupEventually(*here, Keys(0, 10)), 10u);
  AlignedBuffer buf(kChunk);
  for (uint64_t i = 0; i < 10; ++i) {
    ASSERT_TRUE(here->Read(TestKey(i), buf.first(kChunk)).ok());
    EXPECT_TRUE(testing::VerifyChunk(TestKey(i), buf.first(kChunk)));
  }
  EXPECT_EQ(here->Stats().found_on_disk, 10u);
  EXPECT_GE(here->Stats().probe_hits, 10u);

  for (uint64_t i = 10; i < 20; ++i) {
    testing::FillChunk(TestKey(i), buf.first(kChunk));
    ASSERT_TRUE(here->Write(TestKey(i), buf.first(kChunk)).ok());
  }
  // The other process catches up at once with a rescan (a listing of the namespace).
  ASSERT_TRUE(other.Send("rescan"));
  EXPECT_EQ(other.ReadLine(), "ok");
  ASSERT_TRUE(other.Send("lookup 0 20"));
  EXPECT_EQ(other.ReadLine(), "prefix 20");
  ASSERT_TRUE(other.Send("read 10 10"));
  EXPECT_EQ(other.ReadLine(), "ok 10 0 0 0");
  ASSERT_TRUE(other.Send("quit"));
  EXPECT_EQ(other.Wait(), 0);
}

TEST(FileTierSharingTest, RacingWritersOfTheSameKeysAllSucceedWithOneValidFile) {
  testing::TempDir dir;
  auto here = OpenHere(dir.path());
  testing::WorkerProcess b, c;
  ASSERT_TRUE(b.Start({"serve", dir.path(), std::to_string(kChunk), "0"}));
  ASSERT_TRUE(c.Start({"serve", dir.path(), std::to_string(kChunk), "0"}));
  ASSERT_EQ(b.ReadLine(), "ready");
  ASSERT_EQ(c.ReadLine(), "ready");
  constexpr uint64_t kCount = 60;
  for (uint64_t first : {uint64_t{100}, uint64_t{200}, uint64_t{300}}) {
    // Two other processes and this one write the same keys at the same time.
    ASSERT_TRUE(b.Send(fmt::format("write {} {}", first, kCount)));
    ASSERT_TRUE(c.Send(fmt::format("write {} {}", first, kCount)));
    AlignedBuffer buf(kChunk);
    int failed_here = 0;
    for (uint64_t i = first; i < first + kCount; ++i) {
      testing::FillChunk(TestKey(i), buf.first(kChunk));
      failed_here += !here->Write(TestKey(i), buf.first(kChunk)).ok();
    }
    EXPECT_EQ(failed_here, 0);
    EXPECT_EQ(b.ReadLine(), fmt::format("ok {} 0", kCount));
    EXPECT_EQ(c.ReadLine(), fmt::format("ok {} 0", kCount));
    for (uint64_t i = first; i < first + kCount; ++i) {
      std::string path = here->ChunkPath(TestKey(i));
      size_t files = 0;
      for (auto& e : fs::directory_iterator(fs::path(path).parent_path())) {
        files += e.path().filename().string().starts_with(TestKey(i).ToHex());
      }
      EXPECT_EQ(files, 1u) << "key " << i << ": exactly one file, no temporary left";
      ASSERT_TRUE(here->Read(TestKey(i), buf.first(kChunk)).ok());
      EXPECT_TRUE(testing::VerifyChunk(TestKey(i), buf.first(kChunk)));
    }
  }
  ASSERT_TRUE(b.Send("read 100 300"));
  EXPECT_EQ(b.ReadLine(), fmt::format("ok {} {} 0 0", 3 * kCount, 300 - 3 * kCount));
  b.Send("quit");
  c.Send("quit");
  EXPECT_EQ(b.Wait(), 0);
  EXPECT_EQ(c.Wait(), 0);
  auto report = FsckCacheDir(dir.path(), FsckOptions{});
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->clean());
  EXPECT_EQ(report->good, 3 * kCount);
  EXPECT_EQ(report->fresh_temps + report->stale_temps, 0u);
}

}  // namespace
}  // namespace kvtier
