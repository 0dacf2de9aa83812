#include "kvtier/file_tier.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "common/task_pool.h"
#include "io/env_wrapper.h"
#include "io/fault_injection_env.h"
#include "testing/storage_dir.h"
#include "testing/temp_dir.h"
#include "testing/wait.h"
#include "tier/file/test_chunks.h"

namespace kvtier {
namespace {

using testing::FillChunk;
using testing::TestKey;
using testing::TestNamespace;
using testing::VerifyChunk;
namespace fs = std::filesystem;

FileTierOptions Options(const std::string& root, uint64_t chunk_bytes) {
  FileTierOptions o;
  o.root = root;
  o.ns = TestNamespace();
  o.chunk_bytes = chunk_bytes;
  return o;
}

std::unique_ptr<FileTier> OpenTier(const FileTierOptions& o) {
  auto tier = FileTier::Open(o);
  EXPECT_TRUE(tier.ok()) << tier.status().ToString();
  return tier.ok() ? std::move(tier).value() : nullptr;
}

// Flips one byte of a file in place, without the tier knowing.
void FlipByte(const std::string& path, uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  uint8_t b;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x01;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

// Chunk files (not temporaries) under the namespace folder, and their total size.
std::pair<size_t, uint64_t> ChunkFilesOnDisk(const std::string& ns_dir, size_t* temps = nullptr) {
  size_t n = 0, t = 0;
  uint64_t bytes = 0;
  for (auto& e : fs::recursive_directory_iterator(ns_dir)) {
    if (!e.is_regular_file()) continue;
    std::string name = e.path().filename().string();
    if (name.size() == 64) {
      ++n;
      bytes += e.file_size();
    } else if (name.find(".tmp.") != std::string::npos) {
      ++t;
    }
  }
  if (temps) *temps = t;
  return {n, bytes};
}

class FileTierEngineTest : public ::testing::TestWithParam<IoEngineKind> {};

TEST_P(FileTierEngineTest, WriteThenReadEveryBufferShape) {
  testing::StorageDir dir;
  // Over nfs:// the tier speaks NFS itself and the engine parameter means nothing: once is enough.
  if (dir.nfs() && GetParam() != IoEngineKind::kIoUring) {
    GTEST_SKIP() << "the I/O engine does not apply to nfs:// (the IoUring case ran it)";
  }
  // A size that is not a multiple of 4 KiB exercises the padded tail.
  for (uint64_t chunk : {uint64_t{256} << 10, uint64_t{100003}}) {
    SCOPED_TRACE(chunk);
    FileTierOptions o = Options(dir.Sub(std::to_string(chunk)), chunk);
    o.io_engine = GetParam();
    o.io_request_bytes = 64 << 10;  // several requests in flight per chunk
    o.io_write_request_bytes = 64 << 10;
    auto tier = OpenTier(o);
    ASSERT_NE(tier, nullptr);
    FileTierStats st = tier->Stats();
    EXPECT_TRUE(st.o_direct);  // over NFS: libnfs caches nothing on this side
    if (dir.nfs()) {
      EXPECT_TRUE(st.io_engine.starts_with("nfs")) << st.io_engine;
    } else {
      EXPECT_EQ(st.io_engine, GetParam() == IoEngineKind::kIoUring ? "io_uring" : "threads");
    }

    AlignedBuffer src(chunk + 8192), dst(chunk + 8192);
    std::vector<uint8_t> plain(chunk + 1);
    // Aligned source; aligned, exactly-sized destination.
    FillChunk(TestKey(1), src.first(chunk));
    ASSERT_TRUE(tier->Write(TestKey(1), src.first(chunk)).ok());
    ASSERT_TRUE(tier->Read(TestKey(1), dst.first(chunk)).ok());
    EXPECT_TRUE(VerifyChunk(TestKey(1), dst.first(chunk)));
    // Aligned destination with room for the padding.
    std::memset(dst.data(), 0xee, dst.size());
    ASSERT_TRUE(tier->Read(TestKey(1), dst.span()).ok());
    EXPECT_TRUE(VerifyChunk(TestKey(1), dst.first(chunk)));
    EXPECT_EQ(dst.data()[AlignUp(chunk)], 0xee) << "wrote past the padded chunk";
    // Unaligned source and destination: bounce buffers, same bytes.
    FillChunk(TestKey(2), std::span<uint8_t>(plain.data() + 1, chunk));
    ASSERT_TRUE(tier->Write(TestKey(2), std::span<const uint8_t>(plain.data() + 1, chunk)).ok());
    std::vector<uint8_t> out(chunk + 1);
    ASSERT_TRUE(tier->Read(TestKey(2), std::span<uint8_t>(out.data() + 1, chunk)).ok());
    EXPECT_TRUE(VerifyChunk(TestKey(2), std::span<const uint8_t>(out.data() + 1, chunk)));
    EXPECT_EQ(tier->Stats().bounce_copies, 2u);

    // The file is where docs/file-format.md says, with the size it says.
    std::string path = tier->ChunkPath(TestKey(1));
    std::string hex = TestKey(1).ToHex();
    EXPECT_EQ(path, o.root + "/" + o.ns.Id() + "/" + hex.substr(0, 2) + "/" + hex.substr(2, 2) +
                        "/" + hex);
    EXPECT_EQ(fs::file_size(dir.LocalOf(path)), 4096 + AlignUp(chunk));
    EXPECT_EQ(tier->file_bytes(), 4096 + AlignUp(chunk));
    EXPECT_TRUE(fs::exists(dir.LocalOf(o.root + "/kvtier-cache.json")));
    EXPECT_TRUE(fs::exists(dir.LocalOf(o.root + "/" + o.ns.Id() + "/namespace.json")));

    EXPECT_TRUE(tier->Read(TestKey(3), dst.span()).IsNotFound());
    st = tier->Stats();
    EXPECT_EQ(st.chunks, 2u);
    EXPECT_EQ(st.bytes, 2 * tier->file_bytes());
    EXPECT_EQ(st.hits, 3u);
    EXPECT_EQ(st.misses, 1u);
    EXPECT_EQ(st.bytes_written, 2 * chunk);
    EXPECT_EQ(st.bytes_read, 3 * chunk);
    EXPECT_EQ(st.errors, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, FileTierEngineTest,
                         ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kThreadPool),
                         [](const auto& info) {
                           return std::string(info.param == IoEngineKind::kIoUring ? "IoUring"
                                                                                   : "Threads");
                         });

TEST(FileTierTest, RejectsBadOptionsAndForeignDirectories) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.Sub("c"), 0);
  EXPECT_EQ(FileTier::Open(o).status().code(), StatusCode::kInvalidArgument);
  o.chunk_bytes = 4096;
  o.capacity_bytes = 4096;  // below one file (8 KiB)
  EXPECT_EQ(FileTier::Open(o).status().code(), StatusCode::kInvalidArgument);
  o.capacity_bytes = 0;
  o.ns.model_id = "";
  EXPECT_EQ(FileTier::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(dir.Sub("c"), 4096);
  o.read_threads = 0;
  EXPECT_EQ(FileTier::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(dir.Sub("c"), 4096);
  o.read_limit_bytes_per_s = -1;
  EXPECT_EQ(FileTier::Open(o).status().code(), StatusCode::kInvalidArgument);
  // A non-empty directory that is not a cache is refused, so a typo cannot litter /home.
  fs::create_directories(dir.LocalOf(dir.Sub("home")));
  std::ofstream(dir.LocalOf(dir.Sub("home/notes.txt"))) << "mine";
  o = Options(dir.Sub("home"), 4096);
  auto refused = FileTier::Open(o);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("not a kvtier cache"), std::string::npos);
  // A file where the directory should be.
  std::ofstream(dir.LocalOf(dir.Sub("file"))) << "x";
  o = Options(dir.Sub("file"), 4096);
  EXPECT_FALSE(FileTier::Open(o).ok());
}

// A capped tier's readers together move no more than the cap: 16 reads of 64 KiB at 4 MiB/s
// take at least 0.25 s from four threads at once (a lower bound: a slow machine only adds), and
// every byte is as written. Writes are not capped.
TEST(FileTierTest, ReadLimitCapsAllReadersTogether) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 64 * 1024);
  o.read_limit_bytes_per_s = 4.0 * (1 << 20);
  auto tier = OpenTier(o);
  AlignedBuffer buf(64 * 1024);
  for (uint64_t i = 0; i < 16; ++i) {
    FillChunk(TestKey(i), buf.span());
    ASSERT_TRUE(tier->Write(TestKey(i), buf.span()).ok());
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> readers;
  std::atomic<int> good{0};
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&, t] {
      AlignedBuffer mine(64 * 1024), want(64 * 1024);
      for (uint64_t i = t; i < 16; i += 4) {
        FillChunk(TestKey(i), want.span());
        if (tier->Read(TestKey(i), mine.span()).ok() &&
            std::memcmp(mine.data(), want.data(), want.size()) == 0) {
          good.fetch_add(1);
        }
      }
    });
  }
  for (auto& r : readers) r.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(good.load(), 16);
  EXPECT_GE(seconds, 0.24);  // 1 MiB at 4 MiB/s: 0.25 s
}

TEST(FileTierTest, WritesAreIdempotentAndSizesChecked) {
  testing::StorageDir dir;
  auto tier = OpenTier(Options(dir.path(), 8192));
  AlignedBuffer buf(8192);
  FillChunk(TestKey(1), buf.span());
  ASSERT_TRUE(tier->Write(TestKey(1), buf.span()).ok());
  ASSERT_TRUE(tier->Write(TestKey(1), buf.span()).ok());
  EXPECT_EQ(tier->Stats().bytes_written, 8192u);  // the second was a no-op
  EXPECT_EQ(tier->Write(TestKey(2), buf.first(100)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier->Read(TestKey(1), buf.first(100)).code(), StatusCode::kInvalidArgument);
  size_t temps = 0;
  EXPECT_EQ(ChunkFilesOnDisk(dir.LocalOf(tier->namespace_dir()), &temps).first, 1u);
  EXPECT_EQ(temps, 0u);
}

TEST(FileTierTest, IndexIsRebuiltAtOpenAndPrefixesCounted) {
  testing::StorageDir dir;
  AlignedBuffer buf(16384);
  std::vector<ChunkKey> keys;
  for (int i = 0; i < 6; ++i) keys.push_back(TestKey(i));
  {
    auto tier = OpenTier(Options(dir.path(), 16384));
    for (int i = 0; i < 4; ++i) {
      FillChunk(keys[i], buf.span());
      ASSERT_TRUE(tier->Write(keys[i], buf.span()).ok());
    }
    EXPECT_EQ(tier->LookupPrefix(keys), 4u);
  }
  auto tier = OpenTier(Options(dir.path(), 16384));
  FileTierStats st = tier->Stats();
  EXPECT_EQ(st.chunks, 4u);
  EXPECT_EQ(tier->LookupPrefix(keys), 4u);
  EXPECT_EQ(tier->LookupPrefix(std::span<const ChunkKey>(keys).subspan(4)), 0u);
  EXPECT_TRUE(tier->Contains(keys[3]));
  EXPECT_FALSE(tier->Contains(keys[5]));
  ASSERT_TRUE(tier->Read(keys[2], buf.span()).ok());
  EXPECT_TRUE(VerifyChunk(keys[2], buf.span()));
}

TEST(FileTierTest, CapacityEvictsLeastRecentlyUsed) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 8192);
  o.capacity_bytes = 3 * (4096 + 8192);  // three files
  auto tier = OpenTier(o);
  AlignedBuffer buf(8192);
  for (int i = 0; i < 3; ++i) {
    FillChunk(TestKey(i), buf.span());
    ASSERT_TRUE(tier->Write(TestKey(i), buf.span()).ok());
  }
  ASSERT_TRUE(tier->Read(TestKey(0), buf.span()).ok());  // 0 is now the most recent
  for (int i = 3; i < 5; ++i) {
    FillChunk(TestKey(i), buf.span());
    ASSERT_TRUE(tier->Write(TestKey(i), buf.span()).ok());
  }
  EXPECT_TRUE(tier->Contains(TestKey(0)));
  EXPECT_FALSE(tier->Contains(TestKey(1)));
  EXPECT_FALSE(tier->Contains(TestKey(2)));
  EXPECT_TRUE(tier->Contains(TestKey(4)));
  FileTierStats st = tier->Stats();
  EXPECT_EQ(st.evictions, 2u);
  EXPECT_EQ(st.chunks, 3u);
  auto [files, bytes] = ChunkFilesOnDisk(dir.LocalOf(tier->namespace_dir()));
  EXPECT_EQ(files, 3u);
  EXPECT_LE(bytes, o.capacity_bytes);
  tier.reset();
  // Reopened with a smaller capacity: trimmed at Open, oldest publish first.
  o.capacity_bytes = 2 * (4096 + 8192);
  tier = OpenTier(o);
  EXPECT_EQ(tier->Stats().chunks, 2u);
  EXPECT_LE(ChunkFilesOnDisk(dir.LocalOf(tier->namespace_dir())).second, o.capacity_bytes);
  EXPECT_TRUE(tier->Contains(TestKey(4)));
}

// --- The index: lookups never touch the storage; probes and rescans keep it current. ---

// Blocks Stat calls, or listings once taken, until released: storage that hangs (a stuck NFS
// server) at the moments the index upkeep asks it something. Counts the calls held now.
class GateEnv final : public Env {
 public:
  explicit GateEnv(Env* base) : base_(base) {}
  void HoldStats() { Set(&hold_stats_); }
  void HoldListings() { Set(&hold_listings_); }
  void Release() {
    {
      std::lock_guard lock(mu_);
      hold_stats_ = hold_listings_ = false;
    }
    cv_.notify_all();
  }
  int held() const {
    std::lock_guard lock(mu_);
    return held_;
  }
  bool WaitHeld(int n) const {
    return testing::WaitUntil([&] { return held() >= n; });
  }

  std::string io_engine_name() const override { return base_->io_engine_name(); }
  uint64_t direct_fallbacks() const override { return base_->direct_fallbacks(); }
  Result<std::unique_ptr<File>> Open(const std::string& p, const OpenOptions& o) override {
    return base_->Open(p, o);
  }
  Status Rename(const std::string& a, const std::string& b) override { return base_->Rename(a, b); }
  Status Unlink(const std::string& p) override { return base_->Unlink(p); }
  Status CreateDirs(const std::string& p) override { return base_->CreateDirs(p); }
  Status RemoveDir(const std::string& p) override { return base_->RemoveDir(p); }
  Result<std::vector<DirEntry>> List(const std::string& d) override { return base_->List(d); }
  Result<FileInfo> Stat(const std::string& p) override {
    Wait(&hold_stats_);
    return base_->Stat(p);
  }
  Status SyncDir(const std::string& d) override { return base_->SyncDir(d); }
  Result<std::vector<TreeEntry>> ListTree(const std::string& d) override {
    auto listed = base_->ListTree(d);
    Wait(&hold_listings_);
    return listed;
  }

 private:
  void Set(bool* flag) {
    std::lock_guard lock(mu_);
    *flag = true;
  }
  void Wait(bool* flag) {
    std::unique_lock lock(mu_);
    if (!*flag) return;
    ++held_;
    cv_.wait(lock, [&] { return !*flag; });
    --held_;
  }
  Env* const base_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool hold_stats_ = false, hold_listings_ = false;
  int held_ = 0;
};

std::vector<ChunkKey> Keys(uint64_t first, uint64_t count) {
  std::vector<ChunkKey> keys;
  for (uint64_t i = first; i < first + count; ++i) keys.push_back(TestKey(i));
  return keys;
}

void WriteChunks(FileTier& tier, uint64_t first, uint64_t count) {
  const uint64_t n = tier.options().chunk_bytes;
  AlignedBuffer buf(n);
  for (uint64_t i = first; i < first + count; ++i) {
    FillChunk(TestKey(i), buf.first(n));
    ASSERT_TRUE(tier.Write(TestKey(i), buf.first(n)).ok()) << i;
  }
}

template <typename F>
bool Eventually(F done) {
  return testing::WaitUntil(done, testing::kWaitDeadline, std::chrono::milliseconds(1));
}

// 1,000 chunks on disk, none in any memory tier: the lookup answers from the index and makes no
// Env call at all (a FaultInjectionEnv without faults counts every call), hit or miss.
// Two tiers (two hosts) on one directory with one capacity, writing in turn. Each counts what it
// knows of: without shared_capacity the other's chunks stay uncounted until a rescan or a probe
// finds them (both off here), so the directory ends up holding both tiers' capacity. With it,
// each write first counts the other's recent publishes (their markers) and evicts for them too.
TEST(FileTierTest, SharedCapacityCountsWhatTheOtherHostsPublished) {
  for (bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "shared_capacity" : "without shared_capacity");
    testing::StorageDir dir;
    FileTierOptions o = Options(dir.path(), 8192);
    o.capacity_bytes = 4 * (4096 + 8192);  // four files
    o.rescan_interval = std::chrono::milliseconds(0);
    o.max_queued_probes = 0;
    o.shared_capacity = shared;
    auto a = OpenTier(o);
    auto b = OpenTier(o);
    ASSERT_TRUE(a && b);
    const std::string ns_dir = dir.LocalOf(a->namespace_dir());
    size_t peak = 0;
    for (uint64_t i = 0; i < 12; ++i) {
      WriteChunks(*a, i, 1);
      peak = std::max(peak, ChunkFilesOnDisk(ns_dir).first);
      WriteChunks(*b, 100 + i, 1);
      peak = std::max(peak, ChunkFilesOnDisk(ns_dir).first);
    }
    if (!shared) {
      EXPECT_EQ(peak, 8u);  // the cause: each tier kept four of its own
      continue;
    }
    EXPECT_LE(peak, 4u);
    EXPECT_EQ(ChunkFilesOnDisk(ns_dir).first, 4u);
    // The newest chunks of both are the ones kept, and read back whole.
    AlignedBuffer buf(8192);
    for (uint64_t k : {10, 11, 110, 111}) {
      ASSERT_TRUE(a->Read(TestKey(k), buf.span()).ok()) << k;
      EXPECT_TRUE(VerifyChunk(TestKey(k), buf.span())) << k;
    }
    // Markers older than the window are removed by the next write that lists them.
    o.shared_capacity_window = std::chrono::milliseconds(0);
    auto c = OpenTier(o);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    WriteChunks(*c, 200, 1);
    size_t markers = 0;
    for (auto& e : fs::directory_iterator(fs::path(ns_dir) / "recent"))
      markers += e.is_regular_file();
    EXPECT_LE(markers, 1u);  // c's own, at most
  }
}

TEST(FileTierIndexTest, LookupOfAThousandChunksOnDiskMakesNoEnvCall) {
  testing::StorageDir dir;
  constexpr uint64_t kKeys = 1000;
  const std::vector<ChunkKey> keys = Keys(0, kKeys);
  {
    FileTierOptions w = Options(dir.path(), 4096);
    w.sync_data = false;  // quick: this test is about lookups
    w.use_o_direct = false;
    w.io_engine = IoEngineKind::kThreadPool;
    auto writer = OpenTier(w);
    WriteChunks(*writer, 0, kKeys);
  }
  auto base = OpenEnvForPath(dir.path());  // the default env, or NFS for an nfs:// directory
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  FaultInjectionEnv counting(base->env, {});
  FileTierOptions o = Options(dir.path(), 4096);
  o.env = &counting;
  o.rescan_interval = std::chrono::milliseconds(0);  // nothing else uses the env meanwhile
  auto tier = OpenTier(o);
  ASSERT_EQ(tier->Stats().chunks, kKeys);  // indexed by the scan at Open
  const uint64_t before = counting.calls();
  EXPECT_GT(before, kKeys);  // the scan went through it
  for (int i = 0; i < 100; ++i) ASSERT_EQ(tier->LookupPrefix(keys), kKeys);
  EXPECT_TRUE(tier->Contains(keys[kKeys / 2]));
  EXPECT_EQ(counting.calls(), before) << "a lookup called the Env";

  // Misses make no Env call on the caller's thread either: with probes off (here), none at all;
  // with probes on, only the background thread asks the storage (next tests).
  o.max_queued_probes = 0;
  auto no_probes = OpenTier(o);
  const uint64_t before_misses = counting.calls();
  std::vector<ChunkKey> longer = Keys(0, kKeys + 1);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(no_probes->LookupPrefix(longer), kKeys);
  EXPECT_FALSE(no_probes->Contains(TestKey(kKeys + 5)));
  EXPECT_EQ(counting.calls(), before_misses);
  EXPECT_EQ(no_probes->Stats().probes, 0u);
}

// Forwards to the default Env; an Open of a path ending in `target` that finds nothing runs
// `before_answer` first (once): the tier's own write can then publish the chunk while a read
// that found it missing is on its way back.
class RacingEnv final : public EnvWrapper {
 public:
  RacingEnv() : EnvWrapper(Env::Default()) {}
  std::string target;
  std::function<void()> before_answer;

  Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& options) override {
    auto f = base()->Open(path, options);
    if (!f.ok() && f.status().IsNotFound() && !target.empty() && path.ends_with(target) &&
        before_answer) {
      auto run = std::move(before_answer);
      before_answer = nullptr;
      run();
    }
    return f;
  }
};

// A read that found a chunk missing must not forget it if the tier published it meanwhile (its
// news is older): the published file would be left out of the index, and of the capacity, and
// the tier would then hold more than its capacity on disk. Likewise a read that found an older
// file corrupt leaves the newer one alone.
TEST(FileTierIndexTest, AReadThatFoundAChunkMissingDoesNotForgetItsNewerWrite) {
  testing::TempDir dir;
  RacingEnv env;
  FileTierOptions o = Options(dir.path(), 8192);
  o.env = &env;
  o.capacity_bytes = 2 * (4096 + 8192);  // two files
  o.negative_cache_ttl = std::chrono::milliseconds(0);
  auto tier = OpenTier(o);
  ASSERT_TRUE(tier);
  AlignedBuffer buf(8192), out(8192);
  const ChunkKey k = TestKey(7);
  env.target = k.ToHex();
  env.before_answer = [&] {
    FillChunk(k, buf.span());
    ASSERT_TRUE(tier->Write(k, buf.span()).ok());
  };
  EXPECT_TRUE(tier->Read(k, out.span()).IsNotFound());  // what it saw: nothing
  EXPECT_TRUE(tier->Contains(k)) << "the read forgot the chunk written while it looked";
  EXPECT_EQ(tier->Stats().chunks, 1u);
  ASSERT_TRUE(tier->Read(k, out.span()).ok());
  EXPECT_TRUE(VerifyChunk(k, out.span()));
  // The capacity holds on disk: two more chunks evict the oldest, and never leave three files.
  for (int i = 8; i < 10; ++i) {
    FillChunk(TestKey(i), buf.span());
    ASSERT_TRUE(tier->Write(TestKey(i), buf.span()).ok());
  }
  EXPECT_LE(ChunkFilesOnDisk(tier->namespace_dir()).second, o.capacity_bytes);
}

// A chunk another tier wrote: the first lookup misses (the index does not have it) and queues a
// probe; once the probe has found the file, lookups hit.
TEST(FileTierIndexTest, AChunkOfAnotherTierIsFoundAfterTheProbe) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 8192);
  o.rescan_interval = std::chrono::milliseconds(0);  // probes only
  auto a = OpenTier(o);
  auto b = OpenTier(o);
  WriteChunks(*b, 0, 10);
  const std::vector<ChunkKey> keys = Keys(0, 10);
  EXPECT_EQ(a->LookupPrefix(keys), 0u);  // the index only: not seen yet
  EXPECT_TRUE(Eventually([&] { return a->LookupPrefix(keys) == 10; }));
  FileTierStats st = a->Stats();
  EXPECT_EQ(st.probes, 10u);  // one run of probes found all ten
  EXPECT_EQ(st.probe_hits, 10u);
  EXPECT_EQ(st.found_on_disk, 10u);
  EXPECT_EQ(st.queued_probes, 0u);
  AlignedBuffer buf(8192);
  for (const ChunkKey& k : keys) {
    ASSERT_TRUE(a->Read(k, buf.span()).ok());
    EXPECT_TRUE(VerifyChunk(k, buf.span()));
  }
  EXPECT_EQ(a->Stats().disk_rechecks, 0u);  // every read was of an indexed chunk
}

// A key a probe found absent is not probed again until the negative cache forgets it; a read of
// it is a miss without I/O meanwhile. The cache is bounded in entries.
TEST(FileTierIndexTest, AbsentKeysAreNotProbedAgainUntilTheNegativeCacheExpires) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 8192);
  o.rescan_interval = std::chrono::milliseconds(0);
  o.negative_cache_ttl = std::chrono::seconds(60);
  auto b = OpenTier(o);
  auto base = OpenEnvForPath(dir.path());
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  FaultInjectionEnv clock(base->env, {});  // no faults: only a clock the test moves
  o.env = &clock;
  auto a = OpenTier(o);
  EXPECT_FALSE(a->Contains(TestKey(7)));
  ASSERT_TRUE(Eventually([&] { return a->Stats().negative_cache_entries == 1; }));
  EXPECT_EQ(a->Stats().probes, 1u);
  WriteChunks(*b, 7, 1);
  for (int i = 0; i < 50; ++i) EXPECT_FALSE(a->Contains(TestKey(7)));
  AlignedBuffer buf(8192);
  EXPECT_TRUE(a->Read(TestKey(7), buf.span()).IsNotFound());  // known absent
  EXPECT_EQ(a->Stats().disk_rechecks, 0u);
  EXPECT_EQ(a->Stats().probes, 1u) << "a key known absent was probed again";
  clock.AdvanceClock(std::chrono::seconds(61));  // past the negative cache, no sleep
  // The entry leaves when the background thread next wakes: a probe queued for another key
  // wakes it now.
  EXPECT_FALSE(a->Contains(TestKey(8)));
  EXPECT_TRUE(Eventually([&] { return a->Contains(TestKey(7)); }));
  EXPECT_EQ(a->Stats().found_on_disk, 1u);
  std::memset(buf.data(), 0, buf.size());
  ASSERT_TRUE(a->Read(TestKey(7), buf.span()).ok());
  EXPECT_TRUE(VerifyChunk(TestKey(7), buf.span()));
  // B evicts (here: removes) the file behind A's back: A's read is a miss, not an error, and
  // takes the chunk out of A's index.
  ASSERT_TRUE(fs::remove(dir.LocalOf(b->ChunkPath(TestKey(7)))));
  EXPECT_TRUE(a->Read(TestKey(7), buf.span()).IsNotFound());
  EXPECT_FALSE(a->Contains(TestKey(7)));
  EXPECT_EQ(a->Stats().errors, 0u);

  o.env = nullptr;
  o.negative_cache_entries = 4;
  auto small = OpenTier(o);
  for (uint64_t k = 100; k < 110; ++k) EXPECT_FALSE(small->Contains(TestKey(k)));
  ASSERT_TRUE(Eventually([&] { return small->Stats().probes == 10; }));
  ASSERT_TRUE(Eventually([&] { return small->Stats().queued_probes == 0; }));
  EXPECT_EQ(small->Stats().negative_cache_entries, 4u);
}

// Rescan() lists the namespace: it adds what others published and drops what vanished.
TEST(FileTierIndexTest, RescanAddsWhatOthersPublishedAndDropsWhatVanished) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 8192);
  o.rescan_interval = std::chrono::milliseconds(0);
  o.max_queued_probes = 0;  // rescans only
  auto a = OpenTier(o);
  auto b = OpenTier(o);
  WriteChunks(*a, 100, 1);
  WriteChunks(*b, 0, 5);
  EXPECT_EQ(a->LookupPrefix(Keys(0, 5)), 0u);
  ASSERT_TRUE(a->Rescan().ok());
  EXPECT_EQ(a->LookupPrefix(Keys(0, 5)), 5u);
  EXPECT_TRUE(a->Contains(TestKey(100)));
  FileTierStats st = a->Stats();
  EXPECT_EQ(st.rescans, 1u);
  EXPECT_EQ(st.rescan_added, 5u);
  EXPECT_EQ(st.rescan_dropped, 0u);
  EXPECT_EQ(st.found_on_disk, 5u);
  EXPECT_EQ(st.chunks, 6u);
  ASSERT_TRUE(fs::remove(dir.LocalOf(b->ChunkPath(TestKey(2)))));
  ASSERT_TRUE(a->Rescan().ok());
  EXPECT_EQ(a->LookupPrefix(Keys(0, 5)), 2u);
  st = a->Stats();
  EXPECT_EQ(st.rescan_dropped, 1u);
  EXPECT_EQ(st.chunks, 5u);
  EXPECT_GT(st.last_rescan_us, 0u);
}

// The background rescan does the same every rescan_interval.
TEST(FileTierIndexTest, BackgroundRescanFindsOtherTiersChunks) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 8192);
  o.rescan_interval = std::chrono::milliseconds(20);
  o.max_queued_probes = 0;  // rescans only
  auto a = OpenTier(o);
  auto b = OpenTier(o);
  WriteChunks(*b, 0, 3);
  EXPECT_TRUE(Eventually([&] { return a->LookupPrefix(Keys(0, 3)) == 3; }));
  // A rescan counts itself once done, a moment after what it added is visible (a slow build,
  // ThreadSanitizer's, read the counters in between).
  EXPECT_TRUE(Eventually([&] { return a->Stats().rescans >= 1; }));
  EXPECT_EQ(a->Stats().rescan_added, 3u);
}

// What this tier writes or evicts while a rescan lists is not undone by the rescan's older
// listing: a chunk written meanwhile is kept, one evicted meanwhile is not put back.
TEST(FileTierIndexTest, RescanKeepsWhatChangedWhileItListed) {
  testing::TempDir dir;
  static GateEnv* gate = new GateEnv(Env::Default());  // outlives anything left running
  FileTierOptions o = Options(dir.path(), 8192);
  o.env = gate;
  o.rescan_interval = std::chrono::milliseconds(0);
  o.max_queued_probes = 0;
  o.capacity_bytes = 2 * (4096 + 8192);  // two files
  auto tier = OpenTier(o);
  WriteChunks(*tier, 0, 2);
  gate->HoldListings();
  Status rescanned;
  std::thread t([&] { rescanned = tier->Rescan(); });
  ASSERT_TRUE(gate->WaitHeld(1));  // listed: keys 0 and 1
  WriteChunks(*tier, 2, 1);        // evicts key 0, the least recently used
  gate->Release();
  t.join();
  ASSERT_TRUE(rescanned.ok()) << rescanned.ToString();
  EXPECT_FALSE(tier->Contains(TestKey(0)));
  EXPECT_TRUE(tier->Contains(TestKey(1)));
  EXPECT_TRUE(tier->Contains(TestKey(2)));
  FileTierStats st = tier->Stats();
  EXPECT_EQ(st.chunks, 2u);
  EXPECT_EQ(st.rescan_added, 0u);
  EXPECT_EQ(st.rescan_dropped, 0u);
}

// Storage that hangs: lookups still answer at once (the probe waits, not the caller), the
// chunk is found once the storage answers, and a tier whose probe and rescan are stuck shuts
// down within about a stall timeout.
TEST(FileTierIndexTest, HungStorageNeverHoldsUpALookupNorShutdown) {
  testing::TempDir dir;
  static GateEnv* gate = new GateEnv(Env::Default());  // outlives abandoned tasks
  FileTierOptions o = Options(dir.path(), 8192);
  auto writer = OpenTier(o);
  o.env = gate;
  o.rescan_interval = std::chrono::milliseconds(0);
  o.stall_timeout = std::chrono::milliseconds(200);
  auto tier = OpenTier(o);
  gate->HoldStats();
  WriteChunks(*writer, 5, 1);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 1000; ++i) ASSERT_FALSE(tier->Contains(TestKey(5)));
  ASSERT_TRUE(gate->WaitHeld(1));  // the probe is stuck in a stat
  for (int i = 0; i < 1000; ++i) ASSERT_FALSE(tier->Contains(TestKey(5)));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  gate->Release();
  EXPECT_TRUE(Eventually([&] { return tier->Contains(TestKey(5)); }));

  // Both background tasks stuck at once: a probe in a stat, a rescan in its listing.
  tier.reset();
  o.rescan_interval = std::chrono::milliseconds(10);
  tier = OpenTier(o);
  gate->HoldStats();
  gate->HoldListings();
  EXPECT_FALSE(tier->Contains(TestKey(6)));
  ASSERT_TRUE(gate->WaitHeld(2));
  const auto t1 = std::chrono::steady_clock::now();
  tier.reset();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 3.0);
  gate->Release();
  // The abandoned tasks return now; wait for them, so that nothing of theirs outlives the test.
  EXPECT_TRUE(Eventually([] { return TaskPool::DetachedRunning() == 0; }));
}

TEST(FileTierTest, CorruptFilesAreMissesAndRemoved) {
  testing::StorageDir dir;
  auto tier = OpenTier(Options(dir.path(), 65536));
  AlignedBuffer buf(65536);
  // One payload byte, one header byte, a truncation.
  for (int i = 0; i < 3; ++i) {
    FillChunk(TestKey(i), buf.span());
    ASSERT_TRUE(tier->Write(TestKey(i), buf.span()).ok());
  }
  FlipByte(dir.LocalOf(tier->ChunkPath(TestKey(0))), 4096 + 30000);
  FlipByte(dir.LocalOf(tier->ChunkPath(TestKey(1))), 50);
  fs::resize_file(dir.LocalOf(tier->ChunkPath(TestKey(2))), 4096 + 32768);
  for (int i = 0; i < 3; ++i) {
    std::memset(buf.data(), 0, buf.size());
    Status s = tier->Read(TestKey(i), buf.span());
    EXPECT_TRUE(s.IsNotFound()) << i << ": " << s.ToString();
    EXPECT_FALSE(fs::exists(dir.LocalOf(tier->ChunkPath(TestKey(i))))) << i;
    EXPECT_FALSE(tier->Contains(TestKey(i)));
  }
  FileTierStats st = tier->Stats();
  EXPECT_EQ(st.corrupt, 3u);
  EXPECT_EQ(st.hits, 0u);
  EXPECT_EQ(st.chunks, 0u);
  // Rewriting works.
  FillChunk(TestKey(0), buf.span());
  ASSERT_TRUE(tier->Write(TestKey(0), buf.span()).ok());
  ASSERT_TRUE(tier->Read(TestKey(0), buf.span()).ok());
  EXPECT_TRUE(VerifyChunk(TestKey(0), buf.span()));
}

// The listener (KV-cache events) hears of chunks entering the index (a write, a file found at
// open) and leaving it (eviction by capacity, a corrupt file removed), in order per key.
TEST(FileTierTest, TheListenerHearsPublishesEvictionsAndCorruptFiles) {
  struct Recorder : TierListener {
    std::mutex mu;
    std::vector<std::pair<ChunkKey, bool>> calls;
    void OnTierChange(TierId tier, const ChunkKey& key, bool stored) noexcept override {
      EXPECT_EQ(tier, TierId::kFile);
      std::lock_guard lock(mu);
      calls.emplace_back(key, stored);
    }
  };
  testing::StorageDir dir;
  auto recorder = std::make_shared<Recorder>();
  FileTierOptions o = Options(dir.path(), 8192);
  o.capacity_bytes = 2 * (4096 + 8192);  // two files
  o.listener = recorder;
  AlignedBuffer buf(8192);
  {
    auto tier = OpenTier(o);
    for (int i = 0; i < 3; ++i) {  // the third evicts the first
      FillChunk(TestKey(i), buf.span());
      ASSERT_TRUE(tier->Write(TestKey(i), buf.span()).ok());
    }
    FlipByte(dir.LocalOf(tier->ChunkPath(TestKey(1))), 50);
    EXPECT_TRUE(tier->Read(TestKey(1), buf.span()).IsNotFound());
  }
  using Calls = std::vector<std::pair<ChunkKey, bool>>;
  EXPECT_EQ(recorder->calls, (Calls{{TestKey(0), true},
                                    {TestKey(1), true},
                                    {TestKey(0), false},
                                    {TestKey(2), true},
                                    {TestKey(1), false}}));
  recorder->calls.clear();
  auto reopened = OpenTier(o);  // the start-up scan finds the file that is left
  EXPECT_EQ(recorder->calls, (Calls{{TestKey(2), true}}));
}

// The listener's descriptor goes into the header of the file written (docs/file-format.md, "The
// descriptor"), and ReadDescriptor reads it back from the header alone; a chunk written with
// none has none. A descriptor area the reader cannot take fails ReadDescriptor, not the chunk.
TEST(FileTierTest, TheListenersDescriptorIsInTheHeader) {
  struct Describer : TierListener {
    void OnTierChange(TierId, const ChunkKey&, bool) noexcept override {}
    std::string ChunkDescriptor(const ChunkKey& key) noexcept override {
      if (key == TestKey(0)) return std::string(1500, 'a');
      if (key == TestKey(1)) return "";
      return std::string(kMaxChunkDescriptorBytes + 1, 'b');  // too long: left out
    }
  };
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 8192);
  o.listener = std::make_shared<Describer>();
  auto tier = OpenTier(o);
  AlignedBuffer buf(8192);
  for (int i = 0; i < 3; ++i) {
    FillChunk(TestKey(i), buf.span());
    ASSERT_TRUE(tier->Write(TestKey(i), buf.span()).ok());
  }
  auto d = tier->ReadDescriptor(TestKey(0));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(*d, std::string(1500, 'a'));
  for (int i : {1, 2}) {
    d = tier->ReadDescriptor(TestKey(i));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(*d, "") << i;
  }
  EXPECT_TRUE(tier->ReadDescriptor(TestKey(3)).status().IsNotFound());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(tier->Read(TestKey(i), buf.span()).ok()) << i;
    EXPECT_TRUE(VerifyChunk(TestKey(i), buf.span()));
  }
  // An oversized descriptor length under a valid header checksum.
  const std::string path = dir.LocalOf(tier->ChunkPath(TestKey(0)));
  std::vector<uint8_t> header(4096);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.read(reinterpret_cast<char*>(header.data()), 4096);
    const uint32_t length = 100000;
    std::memcpy(header.data() + 1160, &length, 4);
    const uint64_t sum = XXH3_64bits(header.data(), 4088);
    std::memcpy(header.data() + 4088, &sum, 8);
    f.seekp(0);
    f.write(reinterpret_cast<const char*>(header.data()), 4096);
  }
  EXPECT_EQ(tier->ReadDescriptor(TestKey(0)).status().code(), StatusCode::kCorruption);
  std::memset(buf.data(), 0, buf.size());
  ASSERT_TRUE(tier->Read(TestKey(0), buf.span()).ok());
  EXPECT_TRUE(VerifyChunk(TestKey(0), buf.span()));
  EXPECT_EQ(tier->Stats().corrupt, 0u);
}

TEST(FileTierTest, ForeignFilesAreNeverServedNorRemoved) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 8192);
  o.negative_cache_ttl = std::chrono::milliseconds(0);
  FileTierOptions other = o;
  other.ns.model_id = "someone/else";
  auto mine = OpenTier(o);
  auto theirs = OpenTier(other);
  AlignedBuffer buf(8192);
  FillChunk(TestKey(1), buf.span());
  ASSERT_TRUE(theirs->Write(TestKey(1), buf.span()).ok());
  EXPECT_NE(mine->namespace_dir(), theirs->namespace_dir());
  EXPECT_FALSE(mine->Contains(TestKey(1)));  // another folder entirely
  // Even a file of another namespace copied under our name is refused by its header.
  const std::string copied = dir.LocalOf(mine->ChunkPath(TestKey(1)));
  fs::create_directories(fs::path(copied).parent_path());
  fs::copy_file(dir.LocalOf(theirs->ChunkPath(TestKey(1))), copied);
  EXPECT_TRUE(mine->Read(TestKey(1), buf.span()).IsNotFound());
  EXPECT_EQ(mine->Stats().foreign, 1u);
  EXPECT_TRUE(fs::exists(copied));
  // Same namespace, another chunk size: ignored at Open, refused on read.
  FileTierOptions bigger = o;
  bigger.chunk_bytes = 16384;
  auto big = OpenTier(bigger);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(big->Stats().chunks, 0u);
  EXPECT_EQ(big->Stats().foreign, 1u);
  AlignedBuffer bigbuf(16384);
  EXPECT_TRUE(big->Read(TestKey(1), bigbuf.span()).IsNotFound());
  EXPECT_EQ(big->Stats().corrupt, 0u);
  EXPECT_TRUE(fs::exists(copied));
}

TEST(FileTierTest, StaleTemporaryFilesAreRemovedAtOpen) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 8192);
  std::string leaf;
  {
    auto tier = OpenTier(o);
    leaf = fs::path(dir.LocalOf(tier->ChunkPath(TestKey(1)))).parent_path();
  }
  fs::create_directories(leaf);
  std::string hex = TestKey(1).ToHex();
  std::ofstream(leaf + "/" + hex + ".tmp.otherhost.1.0000000000000001") << "partial";
  std::ofstream(leaf + "/" + hex + ".tmp.otherhost.2.0000000000000002") << "partial";
  // Make one old.
  std::string old = leaf + "/" + hex + ".tmp.otherhost.1.0000000000000001";
  fs::last_write_time(old, fs::file_time_type::clock::now() - std::chrono::hours(1));
  auto tier = OpenTier(o);
  EXPECT_EQ(tier->Stats().stale_temps_removed, 1u);
  EXPECT_FALSE(fs::exists(old));
  EXPECT_TRUE(fs::exists(leaf + "/" + hex + ".tmp.otherhost.2.0000000000000002"));
  EXPECT_FALSE(tier->Contains(TestKey(1)));
}

TEST(FileTierTest, AsyncCallsRunOnPoolsAndFullQueuesReject) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 8192);
  o.write_threads = 1;
  o.max_queued_writes = 1;
  auto tier = OpenTier(o);
  AlignedBuffer a(8192), b(8192), c(8192);
  FillChunk(TestKey(1), a.span());
  FillChunk(TestKey(2), b.span());
  FillChunk(TestKey(3), c.span());
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::promise<Status> first;
  // The first write's callback holds the only write thread; the second waits in the queue.
  ASSERT_TRUE(tier->WriteAsync(TestKey(1), a.span(),
                               [&first, gate](Status s) {
                                 first.set_value(s);
                                 gate.wait();
                               })
                  .ok());
  ASSERT_TRUE(first.get_future().get().ok());
  std::promise<Status> second;
  ASSERT_TRUE(
      tier->WriteAsync(TestKey(2), b.span(), [&second](Status s) { second.set_value(s); }).ok());
  bool called = false;
  Status third = tier->WriteAsync(TestKey(3), c.span(), [&called](Status) { called = true; });
  EXPECT_TRUE(third.IsRejected()) << third.ToString();
  release.set_value();
  EXPECT_TRUE(second.get_future().get().ok());
  tier->Drain();
  EXPECT_FALSE(called);
  EXPECT_EQ(tier->Stats().rejections, 1u);
  std::promise<Status> read_done;
  AlignedBuffer out(8192);
  ASSERT_TRUE(
      tier->ReadAsync(TestKey(2), out.span(), [&read_done](Status s) { read_done.set_value(s); })
          .ok());
  EXPECT_TRUE(read_done.get_future().get().ok());
  EXPECT_TRUE(VerifyChunk(TestKey(2), out.span()));
}

TEST(FileTierTest, ConcurrentReadersWritersAndEvictionStayConsistent) {
  testing::StorageDir dir;
  FileTierOptions o = Options(dir.path(), 32768);
  o.capacity_bytes = 8 * (4096 + 32768);
  auto tier = OpenTier(o);
  std::atomic<int> wrong{0}, errors{0};
  auto work = [&](int seed) {
    std::mt19937 rng(seed);
    AlignedBuffer buf(32768);
    for (int i = 0; i < 150; ++i) {
      ChunkKey key = TestKey(rng() % 24);
      if (rng() % 2) {
        FillChunk(key, buf.span());
        Status s = tier->Write(key, buf.span());
        if (!s.ok() && s.code() != StatusCode::kNoSpace) errors.fetch_add(1);
      } else {
        Status s = tier->Read(key, buf.span());
        if (s.ok() && !VerifyChunk(key, buf.span())) wrong.fetch_add(1);
        if (!s.ok() && !s.IsNotFound()) errors.fetch_add(1);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(work, t);
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(errors.load(), 0);
  FileTierStats st = tier->Stats();
  size_t temps = 0;
  auto [files, bytes] = ChunkFilesOnDisk(dir.LocalOf(tier->namespace_dir()), &temps);
  EXPECT_EQ(files, st.chunks);
  EXPECT_EQ(bytes, st.bytes);
  EXPECT_LE(bytes, o.capacity_bytes);
  EXPECT_EQ(temps, 0u);
  EXPECT_GT(st.evictions, 0u);
}

}  // namespace
}  // namespace kvtier
