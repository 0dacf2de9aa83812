// The file tier against bad luck: paths that are not chunk files (a FIFO, a directory, a file
// grown past its chunk), storage that hangs in the kernel, and storage that refuses writes (a
// full disk, a read-only or forbidden one). Each must end as a counted, logged miss or
// failure: never wrong data, never a hang, never a silent skip.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "common/task_pool.h"
#include "io/fault_injection_env.h"
#include "kvtier/cache_dir.h"
#include "kvtier/file_tier.h"
#include "testing/temp_dir.h"
#include "testing/wait.h"
#include "tier/file/test_chunks.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
using testing::FillChunk;
using testing::TestKey;
using testing::TestNamespace;
using testing::VerifyChunk;
namespace fs = std::filesystem;

constexpr uint64_t kChunk = 20000;  // not a multiple of 4 KiB: the padded path too

FileTierOptions Options(const std::string& root) {
  FileTierOptions o;
  o.root = root;
  o.ns = TestNamespace();
  o.chunk_bytes = kChunk;
  return o;
}

std::unique_ptr<FileTier> OpenTier(const FileTierOptions& o) {
  auto tier = FileTier::Open(o);
  EXPECT_TRUE(tier.ok()) << tier.status().ToString();
  return tier.ok() ? std::move(tier).value() : nullptr;
}

void WriteChunk(FileTier& tier, uint64_t i) {
  AlignedBuffer buf(kChunk);
  FillChunk(TestKey(i), buf.first(kChunk));
  ASSERT_TRUE(tier.Write(TestKey(i), buf.first(kChunk)).ok());
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// --- paths that are not chunk files ---

// A FIFO where an indexed chunk was (a stand-in for a path whose open would hang): a miss at
// once, counted as foreign, left in place; the open never blocks.
TEST(FileTierHardeningTest, FifoAtChunkPathIsAMissAndNeverBlocks) {
  testing::TempDir dir;
  auto tier = OpenTier(Options(dir.path()));
  ASSERT_TRUE(tier);
  WriteChunk(*tier, 1);
  const std::string path = tier->ChunkPath(TestKey(1));
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  AlignedBuffer buf(kChunk);
  auto t0 = std::chrono::steady_clock::now();
  Status s = tier->Read(TestKey(1), buf.first(kChunk));
  EXPECT_LT(Seconds(t0), 5.0);
  EXPECT_TRUE(s.IsNotFound()) << s.ToString();
  // Asynchronously too, and repeatedly (a negative-cache hit or another miss, never a stuck
  // thread).
  for (int i = 0; i < 8; ++i) {
    std::promise<Status> done;
    ASSERT_TRUE(tier->ReadAsync(TestKey(1),
                                [&](Status st, std::span<const uint8_t>) { done.set_value(st); })
                    .ok());
    auto f = done.get_future();
    ASSERT_EQ(f.wait_for(10s), std::future_status::ready);
    EXPECT_TRUE(f.get().IsNotFound());
  }
  FileTierStats st = tier->Stats();
  EXPECT_EQ(st.errors, 0u);
  EXPECT_EQ(st.non_regular, 1u);
  EXPECT_EQ(st.foreign, 1u);
  EXPECT_EQ(st.hits, 0u);
  EXPECT_TRUE(fs::is_fifo(path));  // not ours to remove
  EXPECT_FALSE(tier->Contains(TestKey(1)));
}

// A directory at a chunk path: a miss, not an I/O error; fsck reports it (and leaves it).
TEST(FileTierHardeningTest, DirectoryAtChunkPathIsAMissAndFsckReportsIt) {
  testing::TempDir dir;
  std::string path;
  {
    auto tier = OpenTier(Options(dir.path()));
    ASSERT_TRUE(tier);
    WriteChunk(*tier, 1);
    WriteChunk(*tier, 2);
    path = tier->ChunkPath(TestKey(1));
    fs::remove(path);
    fs::create_directory(path);
    AlignedBuffer buf(kChunk);
    Status s = tier->Read(TestKey(1), buf.first(kChunk));
    EXPECT_TRUE(s.IsNotFound()) << s.ToString();
    EXPECT_EQ(tier->Stats().errors, 0u);
    EXPECT_EQ(tier->Stats().non_regular, 1u);
    EXPECT_TRUE(tier->Read(TestKey(2), buf.first(kChunk)).ok());
  }
  {  // reopened: the scan does not index it either
    auto tier = OpenTier(Options(dir.path()));
    EXPECT_FALSE(tier->Contains(TestKey(1)));
    EXPECT_TRUE(tier->Contains(TestKey(2)));
  }
  FsckOptions fo;
  fo.repair = true;
  auto report = FsckCacheDir(dir.path(), fo);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->good, 1u);
  EXPECT_EQ(report->foreign, 1u);
  ASSERT_EQ(report->findings.size(), 1u);
  EXPECT_EQ(report->findings[0].path, path);
  EXPECT_NE(report->findings[0].reason.find("directory"), std::string::npos)
      << report->findings[0].reason;
  EXPECT_FALSE(report->findings[0].removed);
  EXPECT_TRUE(fs::is_directory(path));
}

// fsck on a FIFO at a chunk path reports it without blocking on it.
TEST(FileTierHardeningTest, FsckDoesNotBlockOnAFifo) {
  testing::TempDir dir;
  std::string path;
  {
    auto tier = OpenTier(Options(dir.path()));
    WriteChunk(*tier, 3);
    path = tier->ChunkPath(TestKey(3));
  }
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  auto report = std::async(std::launch::async, [&] { return FsckCacheDir(dir.path(), {}); });
  ASSERT_EQ(report.wait_for(10s), std::future_status::ready) << "fsck blocked on a FIFO";
  auto r = report.get();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->foreign, 1u);
  EXPECT_EQ(r->corrupt, 0u);
}

// A chunk file with 4 KiB appended: the header records the payload's length, so both the read
// path and fsck call it corrupt; the read is a miss (never the data), and each removes it.
TEST(FileTierHardeningTest, ExtendedChunkFileIsCorruptForReadAndFsckAlike) {
  testing::TempDir dir;
  auto tier = OpenTier(Options(dir.path()));
  ASSERT_TRUE(tier);
  WriteChunk(*tier, 1);
  WriteChunk(*tier, 2);
  for (uint64_t i : {1, 2}) {
    std::ofstream(tier->ChunkPath(TestKey(i)), std::ios::app | std::ios::binary)
        << std::string(4096, '\0');
  }
  // fsck first, without repair: it names the file corrupt.
  auto report = FsckCacheDir(dir.path(), {});
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->corrupt, 2u);
  EXPECT_EQ(report->good, 0u);
  // The read path agrees: a miss, counted corrupt, the file removed.
  AlignedBuffer buf(kChunk);
  Status s = tier->Read(TestKey(1), buf.first(kChunk));
  EXPECT_TRUE(s.IsNotFound()) << s.ToString();
  EXPECT_EQ(tier->Stats().corrupt, 1u);
  EXPECT_FALSE(fs::exists(tier->ChunkPath(TestKey(1))));
  // fsck --repair removes the other.
  FsckOptions fo;
  fo.repair = true;
  report = FsckCacheDir(dir.path(), fo);
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->corrupt, 1u);
  EXPECT_EQ(report->removed, 1u);
  EXPECT_FALSE(fs::exists(tier->ChunkPath(TestKey(2))));
}

// --- storage that hangs ---

// An open that never returns (a hung NFS server) ties up no pool for good: the pool adds
// replacement threads, other reads go on, and the tier's destruction gives up on the stuck
// reads after the stall timeout instead of waiting forever. Their callbacks never run.
TEST(FileTierHardeningTest, StuckReadsAreReplacedAndAbandonedAtShutdown) {
  testing::TempDir dir;
  // Outlives the test: the abandoned threads return into it after the test body.
  static FaultInjectionEnv* env = new FaultInjectionEnv(Env::Default(), {});
  FileTierOptions o = Options(dir.path());
  o.env = env;
  o.read_threads = 2;
  o.stall_timeout = 100ms;
  o.max_replacement_threads = 4;
  auto tier = OpenTier(o);
  ASSERT_TRUE(tier);
  WriteChunk(*tier, 1);
  WriteChunk(*tier, 2);
  env->StallOpens(TestKey(1).ToHex());
  auto late_callbacks = std::make_shared<std::atomic<int>>(0);
  for (int i = 0; i < 3; ++i) {  // more stuck reads than read threads
    ASSERT_TRUE(tier->ReadAsync(TestKey(1),
                                [late_callbacks](Status, std::span<const uint8_t>) {
                                  late_callbacks->fetch_add(1);
                                })
                    .ok());
  }
  ASSERT_EQ(env->WaitForStalls(2, testing::kWaitDeadline), 2u);
  // A healthy read still completes, on a replacement thread.
  std::promise<bool> good;
  ASSERT_TRUE(tier->ReadAsync(TestKey(2),
                              [&](Status s, std::span<const uint8_t> data) {
                                good.set_value(s.ok() && VerifyChunk(TestKey(2), data));
                              })
                  .ok());
  auto f = good.get_future();
  ASSERT_EQ(f.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(f.get());
  FileTierStats st = tier->Stats();
  EXPECT_GE(st.replacement_threads, 1u);
  EXPECT_GE(st.stalled_reads, 2u);

  EXPECT_FALSE(tier->Drain());
  auto t0 = std::chrono::steady_clock::now();
  tier.reset();
  EXPECT_LT(Seconds(t0), 5.0) << "shutdown waited for reads stuck in the kernel";
  env->ReleaseStalls();
  // The abandoned threads finish now; wait for them, so that nothing of theirs outlives the test.
  EXPECT_TRUE(testing::WaitUntil([] { return TaskPool::DetachedRunning() == 0; }))
      << TaskPool::DetachedRunning() << " abandoned threads still running";
  EXPECT_EQ(late_callbacks->load(), 0);
}

// --- storage that refuses writes ---

// Each refused write is counted exactly once, under its reason.
TEST(FileTierHardeningTest, WriteFailuresAreCountedOnceByReason) {
  testing::TempDir dir;
  FaultInjectionEnv env(Env::Default(), {});
  env.SetEnabled(false);
  FileTierOptions o = Options(dir.path());
  o.env = &env;
  auto tier = OpenTier(o);
  ASSERT_TRUE(tier);
  AlignedBuffer buf(kChunk);
  struct Case {
    int err;
    uint64_t FileTierStats::*counter;
  };
  uint64_t key = 100;
  for (Case c : {Case{EROFS, &FileTierStats::write_read_only},
                 Case{EACCES, &FileTierStats::write_permission}, Case{EIO, nullptr}}) {
    FaultInjectionOptions f;
    f.write_error = 1;
    f.write_errno = c.err;
    env.SetOptions(f);
    env.SetEnabled(true);
    FileTierStats before = tier->Stats();
    FillChunk(TestKey(key), buf.first(kChunk));
    Status s = tier->Write(TestKey(key), buf.first(kChunk));
    env.SetEnabled(false);
    EXPECT_FALSE(s.ok());
    FileTierStats after = tier->Stats();
    EXPECT_EQ(after.errors, before.errors + 1) << s.ToString();
    EXPECT_EQ(after.rejections, before.rejections);
    if (c.counter) {
      EXPECT_EQ(after.*c.counter, before.*c.counter + 1) << s.ToString();
    }
    EXPECT_FALSE(tier->Contains(TestKey(key)));
    ++key;
  }
  // A full disk with nothing of ours to evict: one failure, counted as no space.
  FaultInjectionOptions f;
  f.no_space = 1;
  env.SetOptions(f);
  env.SetEnabled(true);
  Status s = tier->Write(TestKey(key), buf.first(kChunk));
  env.SetEnabled(false);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.ToString();
  FileTierStats st = tier->Stats();
  EXPECT_EQ(st.write_no_space, 1u);
  EXPECT_EQ(st.errors, 4u);
}

// A full write queue is a counted rejection, by queue.
TEST(FileTierHardeningTest, FullWriteQueueIsCounted) {
  testing::TempDir dir;
  static FaultInjectionEnv* env = new FaultInjectionEnv(Env::Default(), {});
  FileTierOptions o = Options(dir.path());
  o.env = env;
  o.write_threads = 1;
  o.max_queued_writes = 1;
  o.stall_timeout = 0ms;  // wait for everything at destruction
  auto tier = OpenTier(o);
  ASSERT_TRUE(tier);
  env->StallOpens(TestKey(1).ToHex());  // the first write holds the only thread
  std::vector<AlignedBuffer> bufs;
  for (int i = 0; i < 3; ++i) {
    bufs.emplace_back(kChunk);
    FillChunk(TestKey(i + 1), bufs.back().first(kChunk));
  }
  ASSERT_TRUE(tier->WriteAsync(TestKey(1), bufs[0].first(kChunk), nullptr).ok());
  ASSERT_EQ(env->WaitForStalls(1, testing::kWaitDeadline), 1u);
  ASSERT_TRUE(tier->WriteAsync(TestKey(2), bufs[1].first(kChunk), nullptr).ok());  // queued
  Status s = tier->WriteAsync(TestKey(3), bufs[2].first(kChunk), nullptr);
  EXPECT_TRUE(s.IsRejected());
  FileTierStats st = tier->Stats();
  EXPECT_EQ(st.write_queue_full, 1u);
  EXPECT_EQ(st.rejections, 1u);
  env->ReleaseStalls();
  tier->Drain();
  st = tier->Stats();
  EXPECT_EQ(st.errors, 1u);  // the stalled open ended in EIO
  EXPECT_TRUE(tier->Contains(TestKey(2)));
}

// A filesystem smaller than the configured capacity: once full, ENOSPC makes the tier evict its
// oldest chunks and retry, so writes keep succeeding and the newest chunks stay readable.
void ExpectEvictsWhenTheDiskIsFull(const std::string& root, Env* env, uint64_t fits) {
  FileTierOptions o = Options(root);
  o.env = env;
  o.capacity_bytes = 1000 * (4096 + 20480);  // far more than the filesystem holds
  o.use_o_direct = false;
  auto tier = OpenTier(o);
  ASSERT_TRUE(tier);
  const uint64_t n = 3 * fits;
  for (uint64_t i = 0; i < n; ++i) {
    AlignedBuffer buf(kChunk);
    FillChunk(TestKey(i), buf.first(kChunk));
    Status s = tier->Write(TestKey(i), buf.first(kChunk));
    ASSERT_TRUE(s.ok()) << "chunk " << i << ": " << s.ToString();
  }
  FileTierStats st = tier->Stats();
  EXPECT_GE(st.disk_full, 1u);
  EXPECT_GE(st.evictions, n - fits);
  EXPECT_LE(st.chunks, fits);
  EXPECT_LT(st.effective_capacity_bytes, o.capacity_bytes);
  EXPECT_EQ(st.errors, 0u);
  EXPECT_EQ(st.write_no_space, 0u);
  AlignedBuffer buf(kChunk);
  ASSERT_TRUE(tier->Read(TestKey(n - 1), buf.first(kChunk)).ok());
  EXPECT_TRUE(VerifyChunk(TestKey(n - 1), buf.first(kChunk)));
}

TEST(FileTierHardeningTest, FullDiskEvictsUnderTheFaultEnv) {
  testing::TempDir dir;
  FaultInjectionOptions f;
  f.space_bytes = 5 * (4096 + 20480) + 8192;  // five chunk files and the small metadata files
  FaultInjectionEnv env(Env::Default(), f);
  ExpectEvictsWhenTheDiskIsFull(dir.path(), &env, 5);
}

// The same on a real, small filesystem (a 1 MiB tmpfs), where the system allows mounting one.
TEST(FileTierHardeningTest, FullDiskEvictsOnASmallTmpfs) {
  testing::TempDir dir;
  const std::string mnt = dir.Sub("small");
  fs::create_directory(mnt);
  if (::mount("kvtier-test", mnt.c_str(), "tmpfs", 0, "size=1m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
  }
  // 1 MiB holds 42 files of 24 KiB (header, payload, padding); tmpfs directories take no pages.
  ExpectEvictsWhenTheDiskIsFull(mnt, Env::Default(), (1u << 20) / (4096 + 20480));
  // Read-only now: writes fail as such, counted once each.
  {
    ASSERT_EQ(::mount(nullptr, mnt.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr), 0)
        << std::strerror(errno);
    FileTierOptions o = Options(mnt);
    auto tier = OpenTier(o);
    ASSERT_TRUE(tier);
    AlignedBuffer buf(kChunk);
    FillChunk(TestKey(5000), buf.first(kChunk));
    EXPECT_FALSE(tier->Write(TestKey(5000), buf.first(kChunk)).ok());
    EXPECT_EQ(tier->Stats().write_read_only, 1u);
    EXPECT_EQ(tier->Stats().errors, 1u);
  }
  EXPECT_EQ(::umount2(mnt.c_str(), MNT_DETACH), 0);
}

}  // namespace
}  // namespace kvtier
