#include "kvtier/cache_dir.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "kvtier/file_tier.h"
#include "testing/temp_dir.h"
#include "tier/file/test_chunks.h"

namespace kvtier {
namespace {

using testing::FillChunk;
using testing::TestKey;
namespace fs = std::filesystem;

std::unique_ptr<FileTier> FilledTier(const std::string& root, int chunks,
                                     const std::string& model = "test/file-tier") {
  FileTierOptions o;
  o.root = root;
  o.ns = testing::TestNamespace();
  o.ns.model_id = model;
  o.chunk_bytes = 20000;
  auto tier = FileTier::Open(o);
  EXPECT_TRUE(tier.ok()) << tier.status().ToString();
  AlignedBuffer buf(o.chunk_bytes);
  for (int i = 0; i < chunks; ++i) {
    FillChunk(TestKey(i), buf.first(o.chunk_bytes));
    EXPECT_TRUE((*tier)->Write(TestKey(i), buf.first(o.chunk_bytes)).ok());
  }
  return std::move(tier).value();
}

void FlipByte(const std::string& path, uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t b;
  ASSERT_EQ(::pread(fd, &b, 1, offset), 1);
  b ^= 0x80;
  ASSERT_EQ(::pwrite(fd, &b, 1, offset), 1);
  ::close(fd);
}

TEST(CacheDirTest, FsckFindsASingleFlippedByteAndNamesTheFile) {
  testing::TempDir dir;
  auto tier = FilledTier(dir.path(), 5);
  const std::string bad = tier->ChunkPath(TestKey(3));
  tier.reset();
  auto clean = FsckCacheDir(dir.path(), FsckOptions{});
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  EXPECT_EQ(clean->good, 5u);
  EXPECT_TRUE(clean->clean());
  EXPECT_TRUE(clean->findings.empty());

  FlipByte(bad, 4096 + 12345);
  auto report = FsckCacheDir(dir.path(), FsckOptions{});
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->good, 4u);
  EXPECT_EQ(report->corrupt, 1u);
  EXPECT_FALSE(report->clean());
  ASSERT_EQ(report->findings.size(), 1u);
  EXPECT_EQ(report->findings[0].path, bad);
  EXPECT_EQ(report->findings[0].kind, FsckFinding::Kind::kCorrupt);
  EXPECT_NE(report->findings[0].reason.find("checksum"), std::string::npos);
  EXPECT_TRUE(fs::exists(bad));  // a check without --repair changes nothing

  FsckOptions repair;
  repair.repair = true;
  report = FsckCacheDir(dir.path(), repair);
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->removed, 1u);
  EXPECT_TRUE(report->clean());
  EXPECT_FALSE(fs::exists(bad));
  report = FsckCacheDir(dir.path(), FsckOptions{});
  EXPECT_TRUE(report->clean());
  EXPECT_EQ(report->good, 4u);
}

TEST(CacheDirTest, FsckClassifiesTempsForeignAndUnknownFiles) {
  testing::TempDir dir;
  auto tier = FilledTier(dir.path(), 2);
  auto other = FilledTier(dir.path(), 1, "someone/else");
  const std::string leaf = fs::path(tier->ChunkPath(TestKey(0))).parent_path();
  const std::string hex = TestKey(0).ToHex();
  std::string stale = leaf + "/" + hex + ".tmp.h.1.00000000000000aa";
  std::string fresh = leaf + "/" + hex + ".tmp.h.2.00000000000000bb";
  std::ofstream(stale) << "x";
  std::ofstream(fresh) << "x";
  fs::last_write_time(stale, fs::file_time_type::clock::now() - std::chrono::hours(2));
  std::ofstream(leaf + "/README") << "not ours";
  // Another namespace's chunk under our folder and key 1's name: foreign.
  fs::remove(tier->ChunkPath(TestKey(1)));
  fs::copy_file(other->ChunkPath(TestKey(0)), tier->ChunkPath(TestKey(1)));
  FsckOptions repair;
  repair.repair = true;
  auto report = FsckCacheDir(dir.path(), repair);
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->namespaces, 2u);
  EXPECT_EQ(report->good, 2u);  // key 0 of both namespaces
  EXPECT_EQ(report->stale_temps, 1u);
  EXPECT_EQ(report->fresh_temps, 1u);
  EXPECT_EQ(report->foreign, 1u);
  EXPECT_EQ(report->unknown, 1u);
  EXPECT_EQ(report->removed, 1u);
  EXPECT_TRUE(report->clean());
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(fresh));
  EXPECT_TRUE(fs::exists(tier->ChunkPath(TestKey(1))));  // foreign: reported, kept
  EXPECT_TRUE(fs::exists(leaf + "/README"));
}

TEST(CacheDirTest, RefusesDirectoriesThatAreNotCaches) {
  testing::TempDir dir;
  EXPECT_TRUE(CheckCacheDir(dir.Sub("missing")).IsNotFound());
  EXPECT_EQ(CheckCacheDir(dir.path()).code(), StatusCode::kInvalidArgument);
  std::ofstream(dir.Sub("precious")) << "keep me";
  EXPECT_EQ(PurgeCacheDir(dir.path()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(FsckCacheDir(dir.path(), FsckOptions{}).ok());
  EXPECT_FALSE(SummarizeCacheDir(dir.path()).ok());
  EXPECT_TRUE(fs::exists(dir.Sub("precious")));
}

TEST(CacheDirTest, SummarizeAndPurge) {
  testing::TempDir dir;
  auto a = FilledTier(dir.path(), 3);
  auto b = FilledTier(dir.path(), 2, "someone/else");
  const std::string b_id = fs::path(b->namespace_dir()).filename();
  a.reset();
  b.reset();
  auto sum = SummarizeCacheDir(dir.path());
  ASSERT_TRUE(sum.ok()) << sum.status().ToString();
  EXPECT_EQ(sum->chunks, 5u);
  EXPECT_EQ(sum->bytes, 5u * (4096 + 20480));
  ASSERT_EQ(sum->namespaces.size(), 2u);
  for (const auto& ns : sum->namespaces) {
    EXPECT_EQ(ns.chunk_bytes, 20000u);
    EXPECT_EQ(ns.chunks, ns.model_id == "someone/else" ? 2u : 3u);
    EXPECT_GT(ns.oldest_mtime_ns, 0);
    EXPECT_GE(ns.newest_mtime_ns, ns.oldest_mtime_ns);
  }
  EXPECT_FALSE(PurgeCacheDir(dir.path(), "nothex").ok());
  EXPECT_TRUE(PurgeCacheDir(dir.path(), "0000000000000000").status().IsNotFound());
  auto purged = PurgeCacheDir(dir.path(), b_id);
  ASSERT_TRUE(purged.ok());
  EXPECT_EQ(purged->files, 3u);  // two chunks and namespace.json
  sum = SummarizeCacheDir(dir.path());
  EXPECT_EQ(sum->chunks, 3u);
  purged = PurgeCacheDir(dir.path());
  ASSERT_TRUE(purged.ok());
  EXPECT_EQ(purged->files, 4u);
  sum = SummarizeCacheDir(dir.path());  // still a cache, now empty
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(sum->chunks, 0u);
  EXPECT_TRUE(sum->namespaces.empty());
}

// The cache directory removed under a running tier: its next write recreates the marker and the
// namespace's description with the chunk, so fsck, stats and purge accept the directory again
// (they refused it until the tier was restarted).
TEST(CacheDirTest, ADirectoryRemovedUnderARunningTierIsACacheAgainAfterTheNextWrite) {
  testing::TempDir dir;
  const std::string root = dir.Sub("cache");
  auto tier = FilledTier(root, 2);
  fs::remove_all(root);
  EXPECT_FALSE(CheckCacheDir(root).ok());
  AlignedBuffer buf(20000);
  FillChunk(TestKey(9), buf.first(20000));
  ASSERT_TRUE(tier->Write(TestKey(9), buf.first(20000)).ok());
  EXPECT_TRUE(CheckCacheDir(root).ok()) << CheckCacheDir(root).ToString();
  auto sum = SummarizeCacheDir(root);
  ASSERT_TRUE(sum.ok()) << sum.status().ToString();
  EXPECT_EQ(sum->chunks, 1u);
  ASSERT_EQ(sum->namespaces.size(), 1u);
  EXPECT_EQ(sum->namespaces[0].chunk_bytes, 20000u);
  auto report = FsckCacheDir(root, {});
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(PurgeCacheDir(root).ok());
}

}  // namespace
}  // namespace kvtier
