// RunTierBench on small runs against a real file tier in a temporary directory.
#include "benchmarks/tier_bench.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "testing/temp_dir.h"

namespace kvtier::benchmarks {
namespace {

namespace fs = std::filesystem;

TierBenchOptions Small(const std::string& dir) {
  TierBenchOptions o;
  o.dir = dir;
  o.chunk_mib = 1;
  o.chunks = 4;
  o.readers = 2;
  o.writers = 2;
  o.repeats = 2;
  return o;
}

// Every file under `dir`, relative to it.
std::vector<std::string> FilesUnder(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) files.push_back(fs::relative(e.path(), dir).string());
  }
  return files;
}

TEST(TierBench, MeasuresTierAndReferenceAndCleansUp) {
  testing::TempDir tmp("kvtier-tier-bench");
  TierBenchOptions o = Small(tmp.Sub("cache"));  // missing: created
  std::vector<std::string> lines;
  o.log = [&](const std::string& line) { lines.push_back(line); };
  auto r = RunTierBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const uint64_t bytes = uint64_t{2} * 4 << 20;  // repeats x chunks x 1 MiB
  for (const Throughput* t : {&r->tier_write, &r->tier_read, &r->raw_write, &r->raw_read}) {
    EXPECT_EQ(t->bytes, bytes);
    EXPECT_GT(t->seconds, 0);
    EXPECT_GT(t->GBps(), 0);
  }
  EXPECT_GT(r->write_ratio(), 0);
  EXPECT_GT(r->read_ratio(), 0);
  EXPECT_EQ(r->reference, "raw O_DIRECT");
  EXPECT_FALSE(r->remote());
  EXPECT_EQ(r->connections, 0);
  EXPECT_FALSE(r->io_engine.empty());
  EXPECT_TRUE(r->kept_namespaces.empty());
  // tmpfs (a temporary directory may be one) makes the figures page-cache figures: said, then.
  EXPECT_EQ(r->o_direct(), r->warning.empty());
  if (!r->warning.empty()) {
    EXPECT_NE(r->warning.find("O_DIRECT"), std::string::npos);
  }
  // The start line, then four timed phases per repeat.
  ASSERT_EQ(lines.size(), 1u + 2 * 4);
  EXPECT_EQ(lines[0].rfind("kvtier bench tier: 4 chunks of 1 MiB in ", 0), 0u) << lines[0];
  for (size_t i = 1; i < lines.size(); ++i) EXPECT_NE(lines[i].find("GB/s"), std::string::npos);
  // Neither the reference's files nor the tier's chunks are left behind.
  for (const auto& f : FilesUnder(o.dir)) {
    EXPECT_EQ(f.find("kvtier-bench-raw"), std::string::npos) << f;
    EXPECT_LT(fs::file_size(fs::path(o.dir) / f), 1u << 20) << f;
  }
}

TEST(TierBench, KeepLeavesTheChunksOfEveryRepeat) {
  testing::TempDir tmp("kvtier-tier-bench");
  TierBenchOptions o = Small(tmp.path());
  o.keep = true;
  auto r = RunTierBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->kept_namespaces.size(), 2u);
  EXPECT_NE(r->kept_namespaces[0], r->kept_namespaces[1]);  // a fresh namespace per repeat
  uint64_t chunk_files = 0;
  for (const auto& f : FilesUnder(o.dir)) {
    if (fs::file_size(fs::path(o.dir) / f) >= (1u << 20)) ++chunk_files;
  }
  EXPECT_EQ(chunk_files, 2u * 4);
}

TEST(TierBench, JsonCarriesTheFigures) {
  testing::TempDir tmp("kvtier-tier-bench");
  TierBenchOptions o = Small(tmp.path());
  o.repeats = 1;
  auto r = RunTierBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  nlohmann::json j = TierBenchResultToJson(o, *r);
  EXPECT_EQ(j["dir"], o.dir);
  EXPECT_EQ(j["chunks"], 4);
  EXPECT_DOUBLE_EQ(j["write_GBps"].get<double>(), r->tier_write.GBps());
  EXPECT_DOUBLE_EQ(j["raw_read_GBps"].get<double>(), r->raw_read.GBps());
  EXPECT_DOUBLE_EQ(j["read_ratio"].get<double>(), r->read_ratio());
  EXPECT_EQ(j["o_direct"], r->o_direct());
  EXPECT_EQ(j["warnings"].size(), r->warning.empty() ? 0u : 1u);
  EXPECT_EQ(j["reference"], "raw O_DIRECT");
  EXPECT_EQ(j["nfs_connections"], 0);
  EXPECT_EQ(j["page_cache_resident_bytes"],
            r->tier_page_cache_resident_bytes + r->raw_page_cache_resident_bytes);
}

TEST(TierBench, PageCacheFiguresAreFlagged) {
  // tmpfs accepts O_DIRECT (recent kernels) and serves every read from memory.
  if (!fs::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  testing::TempDir tmp("kvtier-tier-bench");  // only for a unique name
  const std::string dir = "/dev/shm/" + fs::path(tmp.path()).filename().string();
  TierBenchOptions o = Small(dir);
  o.repeats = 1;
  auto r = RunTierBench(o);
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (!r.ok()) GTEST_SKIP() << "tmpfs refuses O_DIRECT here: " << r.status().ToString();
  EXPECT_FALSE(r->o_direct());
  EXPECT_FALSE(r->warning.empty());
  EXPECT_NE(r->warning.find(dir), std::string::npos) << r->warning;
}

TEST(TierBench, RefusesBadOptionsNamingTheFlag) {
  struct Case {
    void (*bend)(TierBenchOptions&);
    const char* flag;
  };
  const Case cases[] = {
      {[](TierBenchOptions& o) { o.chunk_mib = 0; }, "--chunk-mib"},
      {[](TierBenchOptions& o) { o.chunk_mib = 4097; }, "--chunk-mib"},
      {[](TierBenchOptions& o) { o.chunks = 0; }, "--chunks"},
      {[](TierBenchOptions& o) { o.readers = 0; }, "--readers"},
      {[](TierBenchOptions& o) { o.writers = 257; }, "--writers"},
      {[](TierBenchOptions& o) { o.repeats = 0; }, "--repeats"},
      {[](TierBenchOptions& o) { o.io_engine = "carrier-pigeon"; }, "carrier-pigeon"},
      {[](TierBenchOptions& o) { o.connections = 300; }, "--connections"},
      {[](TierBenchOptions& o) { o.dir.clear(); }, "--dir"},
  };
  testing::TempDir tmp("kvtier-tier-bench");
  for (const Case& c : cases) {
    TierBenchOptions o = Small(tmp.path());
    c.bend(o);
    auto r = RunTierBench(o);
    ASSERT_FALSE(r.ok()) << c.flag;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.flag;
    EXPECT_NE(r.status().message().find(c.flag), std::string::npos) << r.status().ToString();
  }
  EXPECT_TRUE(FilesUnder(tmp.path()).empty());
}

TEST(TierBench, UnusableDirectoryIsAnError) {
  testing::TempDir tmp("kvtier-tier-bench");
  std::ofstream(tmp.Sub("file")) << "not a directory";
  TierBenchOptions o = Small(tmp.Sub("file") + "/cache");
  auto r = RunTierBench(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot use " + o.dir + " as a directory"), std::string::npos)
      << r.status().ToString();
}

}  // namespace
}  // namespace kvtier::benchmarks
