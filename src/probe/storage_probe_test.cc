#include "probe/storage_probe.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "kvtier/io.h"
#include "testing/nfs_target.h"
#include "testing/temp_dir.h"

namespace kvtier::probe {
namespace {

namespace fs = std::filesystem;

StorageProbeOptions SmallOptions(const std::string& dir) {
  StorageProbeOptions o;
  o.directory = dir;
  o.file_size = 256 << 10;
  o.block_size = 64 << 10;
  o.reader_counts = {1, 3};
  o.files_per_reader = 1;
  o.control_files = 2;
  o.writers = 2;
  return o;
}

size_t Entries(const std::string& dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++n;
  return n;
}

bool IsTmpfs(const std::string& path) {
  struct statfs sf;
  return ::statfs(path.c_str(), &sf) == 0 && sf.f_type == 0x01021994;
}

// Finds the probe's private directory while it runs.
std::string RunDir(const std::string& parent) {
  for (const auto& e : fs::directory_iterator(parent)) {
    if (e.path().filename().string().rfind(".kvtier-probe-", 0) == 0) return e.path().string();
  }
  return "";
}

TEST(StorageProbe, MeasuresEveryPhaseAndCleansUp) {
  testing::TempDir dir("probe");
  std::vector<std::string> lines;
  auto options = SmallOptions(dir.path());
  options.progress = [&](const std::string& line) { lines.push_back(line); };
  auto report = RunStorageProbe(options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->pool_files, 3);
  EXPECT_EQ(report->control_files, 2);
  ASSERT_EQ(report->reads.size(), 2u);
  EXPECT_EQ(report->reads[0].streams, 1);
  EXPECT_EQ(report->reads[1].streams, 3);
  for (const auto& phase : report->reads) {
    EXPECT_EQ(phase.bytes, 3u * (256 << 10));
    EXPECT_GT(phase.GBps(), 0);
  }
  EXPECT_EQ(report->write.bytes, 5u * (256 << 10));
  EXPECT_EQ(report->control.bytes, 2u * (256 << 10));
  EXPECT_GT(report->buffered_warm.GBps(), 0);
  // Every byte read was checked: 2 reader phases and 2 buffered ones over the 3 pool files, the
  // control and its re-read over the 2 control files.
  EXPECT_EQ(report->verified_bytes, (4u * 3 + 2u * 2) * (256 << 10));
  EXPECT_FALSE(report->nfs);
  EXPECT_TRUE(report->o_direct.applicable);
  EXPECT_FALSE(lines.empty());
  // Everything it wrote is gone.
  EXPECT_EQ(Entries(dir.path()), 0u);
  if (!IsTmpfs(dir.path())) {
    // The test directory sits on a disk filesystem on the machines this project runs on.
    EXPECT_TRUE(report->o_direct.honoured) << report->o_direct.detail;
    EXPECT_LT(report->o_direct.resident_fraction, 0.02);
  }
  auto json = nlohmann::json::parse(StorageProbeReportToJson(*report));
  for (const char* key :
       {"readers", "control_GBps", "buffered_read_GBps", "write_GBps", "o_direct"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
  ASSERT_EQ(json["readers"].size(), 2u);
  EXPECT_EQ(json["readers"][1]["readers"], 3);
  EXPECT_GT(json["readers"][1]["read_GBps"].get<double>(), 0);
  EXPECT_NE(StorageProbeReportToText(*report).find("3 readers"), std::string::npos);
}

TEST(StorageProbe, SeesThatTmpfsDoesNotHonourODirect) {
  if (!fs::is_directory("/dev/shm") || !IsTmpfs("/dev/shm")) GTEST_SKIP() << "no tmpfs at /dev/shm";
  char pattern[] = "/dev/shm/kvtier-probe-test-XXXXXX";
  ASSERT_NE(mkdtemp(pattern), nullptr);
  const std::string shm = pattern;
  auto report = RunStorageProbe(SmallOptions(shm));
  std::error_code ec;
  const size_t left = Entries(shm);
  fs::remove_all(shm, ec);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(left, 0u);
  EXPECT_EQ(report->filesystem, "tmpfs");
  EXPECT_FALSE(report->o_direct.honoured);
  EXPECT_GT(report->o_direct.resident_fraction, 0.5);
  ASSERT_FALSE(report->warnings.empty());
  EXPECT_NE(report->warnings.front().find("not honoured"), std::string::npos);
}

TEST(StorageProbe, MeasuresPageCacheResidencyOfFiles) {
  if (!fs::is_directory("/dev/shm") || !IsTmpfs("/dev/shm")) GTEST_SKIP() << "no tmpfs at /dev/shm";
  char pattern[] = "/dev/shm/kvtier-probe-test-XXXXXX";
  ASSERT_NE(mkdtemp(pattern), nullptr);
  const std::string shm = pattern;
  {
    std::ofstream f(shm + "/a", std::ios::binary);
    f << std::string(10000, 'x');  // not a multiple of the page size
  }
  // On tmpfs every byte of a file is in the page cache; a missing file is skipped.
  const PageCacheResidency r = MeasurePageCacheResidency({shm + "/a", shm + "/missing"});
  std::error_code ec;
  fs::remove_all(shm, ec);
  EXPECT_EQ(r.total_bytes, 10000u);
  EXPECT_EQ(r.resident_bytes, 10000u);
}

// A progress hook that, as the read phases start, zeroes a sector of pool file 1 in the run
// directory under `local_parent` (this host's view of the probed directory): something else
// rewriting a file behind the probe's back, which its stamps must catch.
std::function<void(const std::string&)> RewritePoolFileWhenReading(
    const std::string& local_parent) {
  return [local_parent](const std::string& line) {
    if (line.rfind("reading", 0) != 0) return;
    const std::string victim = RunDir(local_parent) + "/pool-00001";
    int fd = ::open(victim.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    std::vector<char> zeros(4096, 0);
    ASSERT_EQ(::pwrite(fd, zeros.data(), zeros.size(), 8192), 4096);
    ::fsync(fd);
    ::close(fd);
  };
}

void ExpectCorruptionOfPoolFile1(const Result<StorageProbeReport>& report) {
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kCorruption) << report.status().ToString();
  EXPECT_NE(report.status().message().find("pool-00001"), std::string::npos);
}

TEST(StorageProbe, DetectsBytesItDidNotWrite) {
  testing::TempDir dir("probe");
  auto options = SmallOptions(dir.path());
  options.progress = RewritePoolFileWhenReading(dir.path());
  ExpectCorruptionOfPoolFile1(RunStorageProbe(options));
  EXPECT_EQ(Entries(dir.path()), 0u);
}

TEST(StorageProbe, StopsWhenAskedAndCleansUp) {
  testing::TempDir dir("probe");
  std::atomic<bool> stop{false};
  auto options = SmallOptions(dir.path());
  options.stop = &stop;
  options.progress = [&](const std::string& line) {
    if (line.rfind("reading", 0) == 0) stop = true;  // as a SIGINT handler would
  };
  auto report = RunStorageProbe(options);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kAborted);
  EXPECT_EQ(Entries(dir.path()), 0u);
}

TEST(StorageProbe, KeepsFilesOnlyWhenAsked) {
  testing::TempDir dir("probe");
  auto options = SmallOptions(dir.path());
  options.keep_files = true;
  ASSERT_TRUE(RunStorageProbe(options).ok());
  const std::string run = RunDir(dir.path());
  ASSERT_FALSE(run.empty());
  EXPECT_EQ(Entries(run), 5u);  // 3 pool + 2 control files
}

TEST(StorageProbe, RejectsBadInput) {
  testing::TempDir dir("probe");
  auto missing = SmallOptions(dir.Sub("missing"));
  EXPECT_EQ(RunStorageProbe(missing).status().code(), StatusCode::kInvalidArgument);

  const std::string file = dir.Sub("plain-file");
  std::ofstream(file) << "x";
  EXPECT_EQ(RunStorageProbe(SmallOptions(file)).status().code(), StatusCode::kInvalidArgument);

  auto misaligned = SmallOptions(dir.path());
  misaligned.block_size = 1000;
  EXPECT_EQ(RunStorageProbe(misaligned).status().code(), StatusCode::kInvalidArgument);

  auto odd_file = SmallOptions(dir.path());
  odd_file.file_size = 4097;
  EXPECT_EQ(RunStorageProbe(odd_file).status().code(), StatusCode::kInvalidArgument);

  auto no_readers = SmallOptions(dir.path());
  no_readers.reader_counts = {};
  EXPECT_EQ(RunStorageProbe(no_readers).status().code(), StatusCode::kInvalidArgument);

  auto huge = SmallOptions(dir.path());
  huge.file_size = 1ull << 50;  // a PiB per file: no disk here has room
  auto status = RunStorageProbe(huge).status();
  EXPECT_EQ(status.code(), StatusCode::kNoSpace) << status.ToString();
  EXPECT_EQ(Entries(dir.path()), 1u);  // only plain-file; the probe left nothing

  auto s3 = SmallOptions("s3://bucket/kv");  // not a filesystem: bench tier is the S3 benchmark
  status = RunStorageProbe(s3).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("bench tier"), std::string::npos) << status.ToString();
}

// ---- nfs://: the probe through the user-space NFS client, against the loopback server ----

TEST(StorageProbeNfs, MeasuresTheNfsPhasesVerifiesAndCleansUp) {
  KVTIER_NFS_TEST_DIR(dir, "probe-nfs");
  std::vector<std::string> lines;
  auto options = SmallOptions(dir->url());
  options.progress = [&](const std::string& line) { lines.push_back(line); };
  auto report = RunStorageProbe(options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->nfs);
  EXPECT_EQ(report->filesystem, "nfs (libnfs, user space)");
  EXPECT_EQ(report->nfs_connections, 3);  // 0 = one per reader of the largest count
  EXPECT_EQ(report->pool_files, 3);
  ASSERT_EQ(report->reads.size(), 2u);
  EXPECT_EQ(report->reads[0].streams, 1);
  EXPECT_EQ(report->reads[1].streams, 3);
  for (const auto& phase : report->reads) {
    EXPECT_EQ(phase.bytes, 3u * (256 << 10));
    EXPECT_GT(phase.GBps(), 0);
  }
  EXPECT_EQ(report->write.bytes, 5u * (256 << 10));
  EXPECT_GT(report->write.GBps(), 0);
  EXPECT_EQ(report->control.bytes, 2u * (256 << 10));
  EXPECT_GT(report->control.GBps(), 0);
  EXPECT_EQ(report->control_reread.bytes, 2u * (256 << 10));
  EXPECT_GT(report->control_reread.GBps(), 0);
  // Every byte read over NFS had its stamps checked: 2 reader phases of the pool, the control
  // and its re-read.
  EXPECT_EQ(report->verified_bytes, (2u * 3 + 2u * 2) * (256 << 10));
  // No client page cache: the O_DIRECT check and the buffered phases do not apply, and are
  // neither failures nor numbers.
  EXPECT_FALSE(report->o_direct.applicable);
  EXPECT_NE(report->o_direct.detail.find("no page cache"), std::string::npos);
  EXPECT_EQ(report->buffered_cold.bytes, 0u);
  EXPECT_EQ(report->buffered_warm.bytes, 0u);
  for (const auto& w : report->warnings) {
    EXPECT_EQ(w.find("O_DIRECT was not honoured"), std::string::npos) << w;
  }
  auto json = nlohmann::json::parse(StorageProbeReportToJson(*report));
  EXPECT_TRUE(json["o_direct"].is_null());
  EXPECT_FALSE(json["o_direct_applicable"].get<bool>());
  EXPECT_TRUE(json["buffered_read_GBps"].is_null());
  EXPECT_TRUE(json["page_cache_resident_fraction"].is_null());
  EXPECT_EQ(json["nfs_connections"], 3);
  EXPECT_GT(json["control_GBps"].get<double>(), 0);
  const std::string text = StorageProbeReportToText(*report);
  EXPECT_NE(text.find("not applicable"), std::string::npos) << text;
  EXPECT_EQ(text.find("O_DIRECT honoured"), std::string::npos) << text;
  EXPECT_FALSE(lines.empty());
  // Seen from the server's side, everything it wrote is gone.
  EXPECT_EQ(Entries(dir->local()), 0u);
}

TEST(StorageProbeNfs, OneConnectionForManyReaders) {
  KVTIER_NFS_TEST_DIR(dir, "probe-nfs");
  auto options = SmallOptions(dir->url());
  options.nfs_connections = 1;
  auto report = RunStorageProbe(options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->nfs_connections, 1);
  ASSERT_EQ(report->reads.size(), 2u);
  EXPECT_GT(report->reads[1].GBps(), 0);
  EXPECT_EQ(Entries(dir->local()), 0u);
}

TEST(StorageProbeNfs, DetectsBytesItDidNotWrite) {
  KVTIER_NFS_TEST_DIR(dir, "probe-nfs");
  auto options = SmallOptions(dir->url());
  options.progress = RewritePoolFileWhenReading(dir->local());  // the server's side
  ExpectCorruptionOfPoolFile1(RunStorageProbe(options));
  EXPECT_EQ(Entries(dir->local()), 0u);
}

TEST(StorageProbeNfs, StopsWhenAskedAndCleansUp) {
  KVTIER_NFS_TEST_DIR(dir, "probe-nfs");
  std::atomic<bool> stop{false};
  auto options = SmallOptions(dir->url());
  options.stop = &stop;
  options.progress = [&](const std::string& line) {
    if (line.rfind("reading", 0) == 0) stop = true;
  };
  auto report = RunStorageProbe(options);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kAborted);
  EXPECT_EQ(Entries(dir->local()), 0u);
}

TEST(StorageProbeNfs, KeepsFilesOnlyWhenAsked) {
  KVTIER_NFS_TEST_DIR(dir, "probe-nfs");
  auto options = SmallOptions(dir->url());
  options.keep_files = true;
  auto report = RunStorageProbe(options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const std::string run = RunDir(dir->local());
  ASSERT_FALSE(run.empty());
  EXPECT_EQ(Entries(run), 5u);  // 3 pool + 2 control files
}

TEST(StorageProbeNfs, RejectsMissingDirectoryAndExport) {
  KVTIER_NFS_TEST_DIR(dir, "probe-nfs");
  auto missing = SmallOptions(dir->url() + "/missing");
  auto status = RunStorageProbe(missing).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find("does not exist"), std::string::npos) << status.ToString();

  std::ofstream(dir->local() + "/plain-file") << "x";
  status = RunStorageProbe(SmallOptions(dir->url() + "/plain-file")).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();

  // The server is there, the export is not.
  const std::string url = dir->url();
  const std::string host = url.substr(6, url.find('/', 6) - 6);
  status = RunStorageProbe(SmallOptions("nfs://" + host + "/no-such-export/x")).status();
  EXPECT_EQ(status.code(), StatusCode::kNotFound) << status.ToString();
  EXPECT_NE(status.message().find("exports no prefix"), std::string::npos) << status.ToString();

  auto bad = SmallOptions(dir->url());
  bad.nfs_connections = 257;
  EXPECT_EQ(RunStorageProbe(bad).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Entries(dir->local()), 1u);  // only plain-file; the probe left nothing
}

TEST(StorageProbeNfs, RejectsBadUrlsAndUnreachableServers) {
  if (!NfsSupported()) GTEST_SKIP() << "built without libnfs";
  for (const char* url : {"nfs://", "nfs://host", "nfs://host:2049/export"}) {
    auto status = RunStorageProbe(SmallOptions(url)).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << url << ": " << status.ToString();
  }
  // Loopback, but nothing listens there: refused at once.
  auto status = RunStorageProbe(SmallOptions("nfs://127.0.0.3/export/x")).status();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
  EXPECT_NE(status.message().find("cannot reach"), std::string::npos) << status.ToString();
}

}  // namespace
}  // namespace kvtier::probe
