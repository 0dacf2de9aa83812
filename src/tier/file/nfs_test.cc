// The file tier on a real NFS server (scripts/nfs-server.sh; skipped without one): a tier on the
// export's local directory and one on its nfs:// URL share chunks; fsck, stats and purge see the
// same directory through both names; two engines, one on each name, share chunks; and the
// server killed and restarted under load costs misses and errors, never wrong bytes or a hang,
// and the tier works again afterwards (that test needs root and a server this repository's
// script runs; it kills and starts it with the script).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "kvtier/cache_dir.h"
#include "kvtier/file_tier.h"
#ifdef KVTIER_NFS_TEST_ENGINE
#include "kvtier/engine.h"
#endif
#include "testing/nfs_target.h"
#include "tier/file/test_chunks.h"
#include "tier/file/tier_keys.h"

namespace kvtier {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using testing::FillChunk;
using testing::TestKey;
using testing::VerifyChunk;

constexpr uint64_t kChunk = 100000;  // not a multiple of 4 KiB, on purpose

FileTierOptions Options(const std::string& root) {
  FileTierOptions o;
  o.root = root;
  o.ns = testing::TestNamespace();
  o.chunk_bytes = kChunk;
  o.negative_cache_ttl = std::chrono::milliseconds(0);  // every miss looks at the directory
  o.connections = 2;
  return o;
}

std::unique_ptr<FileTier> OpenTier(const FileTierOptions& o) {
  auto tier = FileTier::Open(o);
  EXPECT_TRUE(tier.ok()) << o.root << ": " << tier.status().ToString();
  return tier.ok() ? std::move(tier).value() : nullptr;
}

// `p`, a path under `from`, renamed to lie under `to`.
std::string Rebase(const std::string& p, const std::string& from, const std::string& to) {
  EXPECT_TRUE(p.starts_with(from + "/")) << p << " is not under " << from;
  return to + p.substr(from.size());
}

void FlipByte(const std::string& path, uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  uint8_t b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

void WriteKeys(FileTier& tier, uint64_t first, uint64_t count) {
  testing::WriteKeys(tier, first, count, kChunk);
}
void ExpectKeys(FileTier& tier, uint64_t first, uint64_t count) {
  testing::ExpectKeys(tier, first, count, kChunk);
}

TEST(NfsFileTierTest, TiersOnTheExportPathAndOnNfsShareChunks) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-tier");
  auto local = OpenTier(Options(dir->local()));
  auto remote = OpenTier(Options(dir->url()));
  ASSERT_NE(local, nullptr);
  ASSERT_NE(remote, nullptr);
  EXPECT_TRUE(remote->Stats().io_engine.starts_with("nfs")) << remote->Stats().io_engine;
  // One layout, two names for it.
  EXPECT_EQ(remote->ChunkPath(TestKey(1)),
            Rebase(local->ChunkPath(TestKey(1)), dir->local(), dir->url()));

  // Written through the local path, found and read over NFS, and the other way round.
  WriteKeys(*local, 0, 8);
  std::vector<ChunkKey> keys;
  for (uint64_t i = 0; i < 8; ++i) keys.push_back(TestKey(i));
  // A lookup answers from the index; the probe its miss queues finds the chunks over NFS.
  EXPECT_EQ(testing::LookupEventually(*remote, keys), 8u);
  ExpectKeys(*remote, 0, 8);
  WriteKeys(*remote, 100, 8);
  ExpectKeys(*local, 100, 8);
  EXPECT_EQ(remote->Stats().found_on_disk, 8u);
  EXPECT_EQ(local->Stats().found_on_disk, 8u);
  EXPECT_EQ(remote->Stats().errors + local->Stats().errors, 0u);

  // A chunk removed behind the NFS tier's back (another host evicted it) is a miss, not an error.
  ASSERT_TRUE(fs::remove(local->ChunkPath(TestKey(100))));
  AlignedBuffer buf(kChunk);
  EXPECT_TRUE(remote->Read(TestKey(100), buf.first(kChunk)).IsNotFound());
  // A chunk damaged on the server's disk is a miss over NFS, and removed there.
  FlipByte(local->ChunkPath(TestKey(3)), 4096 + 777);
  EXPECT_TRUE(remote->Read(TestKey(3), buf.first(kChunk)).IsNotFound());
  EXPECT_EQ(remote->Stats().corrupt, 1u);
  EXPECT_FALSE(fs::exists(local->ChunkPath(TestKey(3))));
  EXPECT_TRUE(local->Read(TestKey(3), buf.first(kChunk)).IsNotFound());
  EXPECT_EQ(remote->Stats().errors + local->Stats().errors, 0u);

  // Both write and read the same keys at once: racing publishers of one key both succeed, and
  // every read is the key's bytes or a miss.
  std::atomic<int> wrong{0}, failures{0};
  auto work = [&](FileTier* tier, uint64_t seed) {
    std::mt19937_64 rng(seed);
    AlignedBuffer b(kChunk);
    for (int i = 0; i < 120; ++i) {
      ChunkKey key = TestKey(200 + rng() % 16);
      if (rng() % 2) {
        FillChunk(key, b.first(kChunk));
        failures += !tier->Write(key, b.first(kChunk)).ok();
      } else {
        Status s = tier->Read(key, b.first(kChunk));
        if (s.ok()) wrong += !VerifyChunk(key, b.first(kChunk));
        failures += !s.ok() && !s.IsNotFound();
      }
    }
  };
  std::thread a(work, local.get(), 1), b(work, remote.get(), 2);
  work(remote.get(), 3);
  a.join();
  b.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(failures.load(), 0);

  // A tier opened over NFS rebuilds its index from what the directory holds now.
  remote.reset();
  remote = OpenTier(Options(dir->url()));
  ASSERT_NE(remote, nullptr);
  size_t files = 0;
  for (auto& e : fs::recursive_directory_iterator(local->namespace_dir())) {
    files += e.is_regular_file() && e.path().filename().string().size() == 64;
  }
  EXPECT_EQ(remote->Stats().chunks, files);
  EXPECT_GE(files, 14u);  // 0..7 without 3, 101..107, and some of 200..215
  ExpectKeys(*remote, 101, 7);
}

TEST(NfsFileTierTest, FsckStatsAndPurgeSeeTheSameDirectoryOverNfs) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-tier");
  FileTierOptions mine = Options(dir->local());
  FileTierOptions theirs = mine;
  theirs.ns.model_id = "someone/else";
  std::string their_ns;
  std::string damaged;
  {
    auto a = OpenTier(mine);
    auto b = OpenTier(theirs);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    WriteKeys(*a, 0, 6);
    WriteKeys(*b, 0, 3);
    their_ns = fs::path(b->namespace_dir()).filename();
    damaged = a->ChunkPath(TestKey(4));
    // A temporary file left by a dead writer, an hour old.
    std::string temp = a->ChunkPath(TestKey(9)) + ".tmp.otherhost.1.0000000000000001";
    fs::create_directories(fs::path(temp).parent_path());
    std::ofstream(temp) << "partial";
    fs::last_write_time(temp, fs::file_time_type::clock::now() - std::chrono::hours(1));
  }

  auto local_summary = SummarizeCacheDir(dir->local());
  auto nfs_summary = SummarizeCacheDir(dir->url());
  ASSERT_TRUE(local_summary.ok()) << local_summary.status().ToString();
  ASSERT_TRUE(nfs_summary.ok()) << nfs_summary.status().ToString();
  EXPECT_EQ(nfs_summary->chunks, 9u);
  EXPECT_EQ(nfs_summary->chunks, local_summary->chunks);
  EXPECT_EQ(nfs_summary->bytes, local_summary->bytes);
  EXPECT_EQ(nfs_summary->temps, 1u);
  EXPECT_EQ(nfs_summary->temp_bytes, local_summary->temp_bytes);
  EXPECT_EQ(nfs_summary->oldest_mtime_ns, local_summary->oldest_mtime_ns);
  EXPECT_EQ(nfs_summary->newest_mtime_ns, local_summary->newest_mtime_ns);
  ASSERT_EQ(nfs_summary->namespaces.size(), 2u);
  ASSERT_EQ(local_summary->namespaces.size(), 2u);
  auto by_id = [](const NamespaceSummary& x, const NamespaceSummary& y) { return x.id < y.id; };
  std::sort(nfs_summary->namespaces.begin(), nfs_summary->namespaces.end(), by_id);
  std::sort(local_summary->namespaces.begin(), local_summary->namespaces.end(), by_id);
  for (size_t i = 0; i < 2; ++i) {
    const NamespaceSummary &n = nfs_summary->namespaces[i], &l = local_summary->namespaces[i];
    EXPECT_EQ(n.id, l.id);
    EXPECT_EQ(n.model_id, l.model_id);
    EXPECT_EQ(n.chunk_bytes, kChunk);
    EXPECT_EQ(n.chunks, l.chunks);
    EXPECT_EQ(n.bytes, l.bytes);
  }

  // Both names check clean and count the same; then a chunk damaged on the server's disk is
  // corrupt to fsck over NFS, under its nfs:// name.
  auto local_fsck = FsckCacheDir(dir->local(), FsckOptions{});
  auto nfs_fsck = FsckCacheDir(dir->url(), FsckOptions{});
  ASSERT_TRUE(local_fsck.ok()) << local_fsck.status().ToString();
  ASSERT_TRUE(nfs_fsck.ok()) << nfs_fsck.status().ToString();
  EXPECT_EQ(nfs_fsck->good, 9u);
  EXPECT_EQ(nfs_fsck->good, local_fsck->good);
  EXPECT_EQ(nfs_fsck->good_bytes, local_fsck->good_bytes);
  EXPECT_EQ(nfs_fsck->files, local_fsck->files);
  EXPECT_EQ(nfs_fsck->namespaces, 2u);
  EXPECT_EQ(nfs_fsck->stale_temps, 1u);
  EXPECT_EQ(nfs_fsck->corrupt, 0u);

  FlipByte(damaged, 4096 + 50000);
  auto found = FsckCacheDir(dir->url(), FsckOptions{});
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  EXPECT_EQ(found->corrupt, 1u);
  EXPECT_EQ(found->good, 8u);
  bool named = false;
  for (const FsckFinding& f : found->findings) {
    if (f.kind != FsckFinding::Kind::kCorrupt) continue;
    EXPECT_EQ(f.path, Rebase(damaged, dir->local(), dir->url())) << f.reason;
    EXPECT_FALSE(f.removed);
    named = true;
  }
  EXPECT_TRUE(named);
  EXPECT_TRUE(fs::exists(damaged)) << "fsck without --repair removes nothing";
  FsckOptions repair;
  repair.repair = true;
  auto repaired = FsckCacheDir(dir->url(), repair);
  ASSERT_TRUE(repaired.ok()) << repaired.status().ToString();
  EXPECT_EQ(repaired->removed, 2u);  // the damaged chunk and the stale temporary file
  EXPECT_TRUE(repaired->clean());
  EXPECT_FALSE(fs::exists(damaged));
  auto after = FsckCacheDir(dir->local(), FsckOptions{});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->corrupt + after->stale_temps, 0u);
  EXPECT_EQ(after->good, 8u);

  // Purge one namespace over NFS, then everything; the marker stays.
  auto purged = PurgeCacheDir(dir->url(), their_ns);
  ASSERT_TRUE(purged.ok()) << purged.status().ToString();
  EXPECT_EQ(purged->files, 3u + 1u);  // three chunks and namespace.json
  EXPECT_FALSE(fs::exists(dir->local() + "/" + their_ns));
  auto left = SummarizeCacheDir(dir->local());
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->chunks, 5u);
  auto all = PurgeCacheDir(dir->url());
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  left = SummarizeCacheDir(dir->local());
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->chunks, 0u);
  EXPECT_TRUE(left->namespaces.empty());
  EXPECT_TRUE(fs::exists(dir->local() + "/kvtier-cache.json"));
  EXPECT_TRUE(CheckCacheDir(dir->url()).ok());
}

#ifdef KVTIER_NFS_TEST_ENGINE
// An engine with four L1 slots (so most chunks live only in L2) and its file tier at `root`.
EngineOptions EngineOn(const std::string& root, WritePolicy policy) {
  EngineOptions o;
  o.ns = testing::TestNamespace();
  o.chunk_bytes = kChunk;
  o.memory.capacity_bytes = 4 * AlignUp(kChunk);
  o.memory.prefault = false;
  o.write_policy = policy;
  o.worker_threads = 1;
  o.file = Options(root);
  return o;
}

// `n` test chunks: keys, their contents, buffers to load them into, and spans over both.
struct EngineChunks {
  explicit EngineChunks(size_t n)
      : in(n, std::vector<uint8_t>(kChunk)), out(n, std::vector<uint8_t>(kChunk)) {
    for (size_t i = 0; i < n; ++i) {
      keys.push_back(TestKey(i));
      FillChunk(keys[i], in[i]);
    }
    src.assign(in.begin(), in.end());
    dst.assign(out.begin(), out.end());
  }
  std::vector<ChunkKey> keys;
  std::vector<std::vector<uint8_t>> in, out;
  std::vector<std::span<const uint8_t>> src;
  std::vector<std::span<uint8_t>> dst;
};

// Two engines, one with its L2 on the nfs:// URL, one on the export's local path: what the first
// writes through to L2, the second loads, with the right bytes.
TEST(NfsFileTierTest, EnginesOnNfsAndOnTheExportPathShareChunks) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-engine");
  auto options = [](const std::string& root, WritePolicy policy) { return EngineOn(root, policy); };
  constexpr size_t kChunks = 8;
  EngineChunks c(kChunks);
  auto& [keys, in, out, src, dst] = c;

  auto writer = Engine::Open(options(dir->url(), WritePolicy::kWriteThrough));
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  // Two at a time, each written through to NFS before the next: a slot being written is not
  // evicted, and L1 has four.
  for (size_t i = 0; i < kChunks; i += 2) {
    auto stored = (*writer)->Store(std::span(keys).subspan(i, 2), std::span(src).subspan(i, 2));
    ASSERT_TRUE(stored.ok()) << stored.status().ToString();
    OpResult done = stored->Wait();
    ASSERT_TRUE(done.status.ok()) << done.status.ToString();
    ASSERT_TRUE((*writer)->Drain());
  }
  EXPECT_EQ((*writer)->Stats().file_detail.chunks, kChunks);
  EXPECT_EQ((*writer)->Stats().file.errors, 0u);

  auto reader = Engine::Open(options(dir->local(), WritePolicy::kNone));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ((*reader)->Lookup(keys).total, kChunks);
  // Four at a time: what L1 holds.
  for (size_t i = 0; i < kChunks; i += 4) {
    auto loaded = (*reader)->Load(std::span(keys).subspan(i, 4), std::span(dst).subspan(i, 4));
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    OpResult r = loaded->Wait();
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.chunks, 4u);
  }
  for (size_t i = 0; i < kChunks; ++i) EXPECT_TRUE(VerifyChunk(keys[i], out[i])) << i;
  EXPECT_EQ((*reader)->Stats().file_detail.hits, kChunks);

  // And back: the first engine, its L1 holding only the last chunks, loads the first ones from
  // NFS.
  std::vector<std::vector<uint8_t>> again(2, std::vector<uint8_t>(kChunk));
  std::vector<std::span<uint8_t>> dst2(again.begin(), again.end());
  auto loaded = (*writer)->Load(std::span(keys).first(2), dst2);
  ASSERT_TRUE(loaded.ok());
  OpResult r = loaded->Wait();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.chunks, 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(VerifyChunk(keys[i], again[i])) << i;
  EXPECT_EQ((*writer)->Stats().file_detail.hits, 2u);
}
#endif  // KVTIER_NFS_TEST_ENGINE

// --- The server killed and restarted under load ----------------------------------------------

// Runs scripts/nfs-server.sh on the server state directory whose export the tests use (the
// export's parent), and starts the server again at destruction if it was killed, whatever the
// test's outcome.
class NfsServerControl {
 public:
  explicit NfsServerControl(std::string state_dir)
      : script_(std::string(KVTIER_SOURCE_DIR) + "/scripts/nfs-server.sh"),
        state_(std::move(state_dir)) {}
  ~NfsServerControl() {
    if (paused_) Resume();
    if (killed_) Start();
  }
  NfsServerControl(const NfsServerControl&) = delete;
  NfsServerControl& operator=(const NfsServerControl&) = delete;

  // Why this test cannot restart the server, or "" if it can.
  std::string WhyNot() const {
    if (::geteuid() != 0) return "restarting the NFS server needs root";
    if (!fs::exists(script_)) return script_ + " not found";
    if (Run("status") != 0) {
      return "the NFS test server is not one scripts/nfs-server.sh runs from " + state_;
    }
    return "";
  }
  bool Kill() {
    killed_ = true;
    return Run("kill") == 0;
  }
  bool Start() {
    bool ok = Run("start") == 0;
    if (ok) killed_ = false;
    return ok;
  }
  // SIGSTOP / SIGCONT: a server that hangs with its connections open.
  bool Pause() {
    paused_ = true;
    return Run("pause") == 0;
  }
  bool Resume() {
    bool ok = Run("resume") == 0;
    if (ok) paused_ = false;
    return ok;
  }

 private:
  int Run(const std::string& command) const {
    std::string line = "'" + script_ + "' " + command + " '" + state_ + "'";
    std::fflush(stdout);
    int rc = std::system(line.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }

  const std::string script_, state_;
  bool killed_ = false, paused_ = false;
};

// Calls `fire` if not disarmed within `limit`: a hung operation becomes a test failure with a
// message instead of a test that never ends.
class Watchdog {
 public:
  Watchdog(std::chrono::seconds limit, std::function<void()> fire)
      : thread_([this, limit, fire = std::move(fire)] {
          std::unique_lock lock(mu_);
          if (!cv_.wait_for(lock, limit, [this] { return disarmed_; })) fire();
        }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      disarmed_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool disarmed_ = false;
  std::thread thread_;
};

// What the load saw, by phase: 0 before the kill, 1 while the server is down, 2 after it was
// started again.
struct PhaseCounts {
  std::atomic<uint64_t> writes_ok{0}, writes_failed{0};
  std::atomic<uint64_t> reads_ok{0}, reads_missed{0}, reads_failed{0};
  uint64_t failed() const { return writes_failed + reads_failed; }
};

struct Load {
  std::atomic<int> phase{0};
  std::atomic<bool> stop{false};
  PhaseCounts counts[3];
  std::atomic<uint64_t> wrong{0};
  enum Kind { kWrite, kRead, kAsyncRead };
  std::atomic<int64_t> longest_ns[3] = {0, 0, 0};  // by Kind
  std::mutex mu;
  std::condition_variable cv;         // notified on every op that changes a count
  std::vector<uint64_t> written;      // keys written successfully; guarded by mu
  std::map<std::string, int> errors;  // status codes of failed ops; guarded by mu

  void Took(Kind kind, Clock::duration d) {
    int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
    int64_t seen = longest_ns[kind].load();
    while (ns > seen && !longest_ns[kind].compare_exchange_weak(seen, ns)) {
    }
  }
  int64_t longest_ms(Kind kind) const { return longest_ns[kind].load() / 1000000; }
  void Failed(const Status& s) {
    std::lock_guard lock(mu);
    ++errors[std::string(StatusCodeName(s.code()))];
  }
  // Waits until `done()` (checked whenever an op finishes) or `limit` passes.
  bool WaitFor(std::chrono::seconds limit, const std::function<bool()>& done) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, limit, done);
  }
  void Notify() {
    { std::lock_guard lock(mu); }
    cv.notify_all();
  }
};

#ifdef KVTIER_NFS_TEST_ENGINE
// A server that stops answering (SIGSTOP: its connections stay open, nothing comes back): an
// engine's load from nfs:// ends at the load deadline, as a miss; once the server answers again,
// loads hit again; nothing blocks past a bound.
TEST(NfsFileTierTest, AHungServerCostsTheLoadDeadlineNotAHang) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-hung");
  fs::path exported = std::getenv("KVTIER_TEST_NFS_EXPORT_DIR");
  if (!exported.has_filename()) exported = exported.parent_path();
  NfsServerControl server(exported.parent_path());
  if (std::string why = server.WhyNot(); !why.empty()) {
    if (testing::NfsRequired()) FAIL() << why;
    GTEST_SKIP() << why;
  }
  Watchdog watchdog(std::chrono::seconds(120), [&] {
    server.Resume();
    ADD_FAILURE() << "the hung-server test ran past 120 s";
    std::abort();
  });
  constexpr auto kDeadline = std::chrono::milliseconds(1000);
  auto options = [&](WritePolicy policy) {
    EngineOptions o = EngineOn(dir->url(), policy);
    o.load_deadline = kDeadline;
    // The writer (setup) waits for its writes however loaded the machine (a sanitizer build
    // beside other work took over 500 ms); only the reader meets the hang.
    o.file->stall_timeout = std::chrono::milliseconds(policy == WritePolicy::kNone ? 500 : 0);
    return o;
  };
  constexpr size_t kChunks = 2;
  EngineChunks c(kChunks);
  auto& [keys, in, out, src, dst] = c;
  {
    auto writer = Engine::Open(options(WritePolicy::kWriteThrough));
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    auto stored = (*writer)->Store(keys, src);
    ASSERT_TRUE(stored.ok());
    ASSERT_TRUE(stored->Wait().status.ok());
    ASSERT_TRUE((*writer)->Drain());
  }
  // A second engine, its L1 empty: its loads come from NFS. Opened (and mounted) before the hang.
  auto reader = Engine::Open(options(WritePolicy::kNone));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();

  ASSERT_TRUE(server.Pause());
  auto t0 = Clock::now();
  auto loaded = (*reader)->Load(keys, dst);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  OpResult r = loaded->Wait();
  auto took = Clock::now() - t0;
  EXPECT_LT(r.chunks, kChunks) << "a load from a hung server cannot have found everything";
  EXPECT_LT(took, kDeadline + std::chrono::seconds(2))
      << "the load took " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
      << " ms against a " << kDeadline.count() << " ms deadline";
  EXPECT_GT((*reader)->Stats().deadline_misses, 0u);
  std::printf(
      "hung server: the load ended after %lld ms with %zu of %zu chunks\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
      r.chunks, kChunks);
  ASSERT_TRUE(server.Resume());

  // Answering again: the same load hits (the requests held by the stopped server are answered,
  // or time out and are retried by a later load).
  bool hit = false;
  for (auto until = Clock::now() + std::chrono::seconds(60); !hit && Clock::now() < until;) {
    for (auto& o : out) std::fill(o.begin(), o.end(), 0);
    auto again = (*reader)->Load(keys, dst);
    ASSERT_TRUE(again.ok());
    OpResult a = again->Wait();
    hit = a.status.ok() && a.chunks == kChunks;
    if (!hit) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_TRUE(hit) << "no full hit within 60 s of the server answering again";
  for (size_t i = 0; i < kChunks; ++i) EXPECT_TRUE(VerifyChunk(keys[i], out[i])) << i;
  auto t1 = Clock::now();
  reader->reset();  // shutting down does not hang either
  EXPECT_LT(Clock::now() - t1, std::chrono::seconds(30));
}
#endif  // KVTIER_NFS_TEST_ENGINE

TEST(NfsFileTierTest, ServerKilledAndRestartedMidRunCostsMissesNeverWrongBytesOrAHang) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-restart");
  fs::path exported = std::getenv("KVTIER_TEST_NFS_EXPORT_DIR");  // STATE_DIR/export
  if (!exported.has_filename()) exported = exported.parent_path();
  NfsServerControl server(exported.parent_path());
  if (std::string why = server.WhyNot(); !why.empty()) {
    if (testing::NfsRequired()) FAIL() << why;
    GTEST_SKIP() << why;
  }
  constexpr auto kBound = std::chrono::seconds(30);  // no call may block longer than this
  FileTierOptions o = Options(dir->url());
  o.stall_timeout = std::chrono::milliseconds(2000);
  auto opened = FileTier::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  std::unique_ptr<FileTier> tier = std::move(opened).value();

  // Should anything hang past every bound, fail loudly, with the server started again.
  Watchdog watchdog(std::chrono::seconds(300), [&server] {
    std::fprintf(stderr, "FATAL: the restart test hung; starting the NFS server and aborting\n");
    server.Start();
    std::abort();
  });

  Load load;
  auto timed = [&load](Load::Kind kind, const std::function<Status()>& op) {
    auto t0 = Clock::now();
    Status s = op();
    load.Took(kind, Clock::now() - t0);
    return s;
  };
  // Writers: fresh keys, each thread its own range.
  auto writer = [&](uint64_t first) {
    AlignedBuffer buf(kChunk);
    for (uint64_t i = first; !load.stop; ++i) {
      ChunkKey key = TestKey(i);
      FillChunk(key, buf.first(kChunk));
      int phase = load.phase;
      Status s = timed(Load::kWrite, [&] { return tier->Write(key, buf.first(kChunk)); });
      PhaseCounts& c = load.counts[phase];
      if (s.ok()) {
        ++c.writes_ok;
        std::lock_guard lock(load.mu);
        load.written.push_back(i);
      } else {
        ++c.writes_failed;
        load.Failed(s);
      }
      load.Notify();
    }
  };
  // Readers: keys written so far (and now and then one never written), synchronously or through
  // the asynchronous pool, whose reads are bounded by the stall timeout.
  auto reader = [&](uint64_t seed, bool async) {
    std::mt19937_64 rng(seed);
    AlignedBuffer buf(kChunk);
    while (!load.stop) {
      uint64_t k = 0;
      {
        std::lock_guard lock(load.mu);
        k = load.written.empty() || rng() % 8 == 0 ? 1'000'000'000 + rng() % 1000
                                                   : load.written[rng() % load.written.size()];
      }
      ChunkKey key = TestKey(k);
      int phase = load.phase;
      Status s;
      if (async) {
        auto result = std::make_shared<std::promise<std::pair<Status, bool>>>();
        auto future = result->get_future();
        auto t0 = Clock::now();
        Status queued = tier->ReadAsync(key, [result, key](Status st, std::span<const uint8_t> d) {
          result->set_value({st, st.ok() && VerifyChunk(key, d.first(kChunk))});
        });
        if (!queued.ok()) {
          s = queued;
        } else if (future.wait_for(kBound) != std::future_status::ready) {
          s = Status::Unavailable("an asynchronous read ran past the bound");
        } else {
          auto [st, right] = future.get();
          s = st;
          if (s.ok() && !right) ++load.wrong;
        }
        load.Took(Load::kAsyncRead, Clock::now() - t0);
      } else {
        std::memset(buf.data(), 0, buf.size());
        s = timed(Load::kRead, [&] { return tier->Read(key, buf.first(kChunk)); });
        if (s.ok() && !VerifyChunk(key, buf.first(kChunk))) ++load.wrong;
      }
      PhaseCounts& c = load.counts[phase];
      if (s.ok()) {
        ++c.reads_ok;
      } else if (s.IsNotFound()) {
        ++c.reads_missed;
      } else {
        ++c.reads_failed;
        load.Failed(s);
      }
      load.Notify();
    }
  };
  // Stopped and joined however the test ends (a failed ASSERT included).
  struct Threads {
    Load& load;
    std::vector<std::thread> threads;
    void Join() {
      load.stop = true;
      for (auto& t : threads) {
        if (t.joinable()) t.join();
      }
    }
    ~Threads() { Join(); }
  } threads{load, {}};
  threads.threads.emplace_back(writer, 0);
  threads.threads.emplace_back(writer, 500'000'000);
  threads.threads.emplace_back(reader, 1, false);
  threads.threads.emplace_back(reader, 2, false);
  threads.threads.emplace_back(reader, 3, true);

  auto& before = load.counts[0];
  auto& during = load.counts[1];
  auto& after = load.counts[2];
  bool warmed = load.WaitFor(std::chrono::seconds(60),
                             [&] { return before.writes_ok >= 30 && before.reads_ok >= 30; });
  EXPECT_TRUE(warmed) << "the load did not get going before the kill";

  auto killed_at = Clock::now();
  load.phase = 1;
  ASSERT_TRUE(server.Kill());
  auto dead_at = Clock::now();  // the script saw ganesha gone
  // Down long enough for the load to notice (or for a while, should every op hang).
  bool noticed = load.WaitFor(std::chrono::seconds(10), [&] { return during.failed() >= 10; });
  auto starting_at = Clock::now();
  ASSERT_TRUE(server.Start());
  load.phase = 2;
  auto restarted_at = Clock::now();
  // The env reconnects: new writes and reads succeed again.
  bool recovered = load.WaitFor(std::chrono::seconds(60),
                                [&] { return after.writes_ok >= 20 && after.reads_ok >= 20; });
  auto recovered_at = Clock::now();
  threads.Join();

  auto ms = [](Clock::duration d) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
  };
  std::string errors;
  for (const auto& [code, n] : load.errors) errors += " " + code + "=" + std::to_string(n);
  for (int p = 0; p < 3; ++p) {
    const PhaseCounts& c = load.counts[p];
    std::printf("%-7s writes %llu ok %llu failed; reads %llu ok %llu missed %llu failed\n",
                p == 0   ? "before"
                : p == 1 ? "outage"
                         : "after",
                static_cast<unsigned long long>(c.writes_ok.load()),
                static_cast<unsigned long long>(c.writes_failed.load()),
                static_cast<unsigned long long>(c.reads_ok.load()),
                static_cast<unsigned long long>(c.reads_missed.load()),
                static_cast<unsigned long long>(c.reads_failed.load()));
  }
  std::printf(
      "kill took %lld ms, start %lld ms: server down %lld ms in all; load back %lld ms "
      "after the restart\nlongest call: write %lld ms, read %lld ms, asynchronous read "
      "%lld ms; failures by code:%s\n",
      static_cast<long long>(ms(dead_at - killed_at)),
      static_cast<long long>(ms(restarted_at - starting_at)),
      static_cast<long long>(ms(restarted_at - killed_at)),
      static_cast<long long>(ms(recovered_at - restarted_at)),
      static_cast<long long>(load.longest_ms(Load::kWrite)),
      static_cast<long long>(load.longest_ms(Load::kRead)),
      static_cast<long long>(load.longest_ms(Load::kAsyncRead)), errors.c_str());

  EXPECT_EQ(load.wrong.load(), 0u) << "a read returned wrong bytes";
  EXPECT_TRUE(noticed) << "the outage never showed as failed operations";
  EXPECT_TRUE(recovered) << "writes and reads did not succeed again after the restart";
  for (auto kind : {Load::kWrite, Load::kRead, Load::kAsyncRead}) {
    EXPECT_LT(load.longest_ns[kind].load(), std::chrono::nanoseconds(kBound).count()) << kind;
  }

  // Every chunk whose write succeeded, before, during or after the outage, is there with its
  // bytes: through the same tier, and through a fresh one.
  std::vector<uint64_t> written;
  {
    std::lock_guard lock(load.mu);
    written = load.written;
  }
  auto fresh = OpenTier(Options(dir->url()));
  ASSERT_NE(fresh, nullptr);
  AlignedBuffer buf(kChunk);
  uint64_t lost = 0, wrong = 0;
  for (uint64_t k : written) {
    for (FileTier* t : {tier.get(), fresh.get()}) {
      Status s = t->Read(TestKey(k), buf.first(kChunk));
      if (!s.ok()) {
        ++lost;
        ADD_FAILURE() << "key " << k << ": " << s.ToString();
      } else {
        wrong += !VerifyChunk(TestKey(k), buf.first(kChunk));
      }
    }
  }
  EXPECT_EQ(lost, 0u);
  EXPECT_EQ(wrong, 0u);
  EXPECT_GE(fresh->Stats().chunks, written.size());
  // No write that failed published a bad chunk.
  auto report = FsckCacheDir(dir->url(), FsckOptions{});
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->corrupt + report->foreign, 0u);
  std::printf(
      "%zu chunks written, all read back right; fsck: %llu good, %llu temporary files "
      "left by failed writes\n",
      written.size(), static_cast<unsigned long long>(report->good),
      static_cast<unsigned long long>(report->fresh_temps));
  tier.reset();
}

}  // namespace
}  // namespace kvtier
