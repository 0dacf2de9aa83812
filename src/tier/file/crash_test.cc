// A writer process under load is killed with SIGKILL at random moments, again and again. After
// every kill: the chunks on disk respect the capacity, a restarted tier never returns a wrong
// chunk, a corrupted file is a miss, and `fsck --repair` leaves a clean directory.
// With KVTIER_TEST_STORAGE=nfs the cache directory is on the NFS test server, spoken to over
// nfs:// by the writers, the tier and fsck alike.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "kvtier/cache_dir.h"
#include "kvtier/file_tier.h"
#include "testing/storage_dir.h"
#include "tier/file/test_chunks.h"
#include "tier/file/worker_process.h"

namespace kvtier {
namespace {

namespace fs = std::filesystem;
using testing::TestKey;
using testing::VerifyChunk;

struct DiskState {
  uint64_t chunk_files = 0, chunk_bytes = 0, temps = 0;
};
DiskState Scan(const std::string& root) {
  DiskState d;
  for (auto& e : fs::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    std::string name = e.path().filename().string();
    if (name.size() == 64) {
      ++d.chunk_files;
      d.chunk_bytes += e.file_size();
    } else if (name.find(".tmp.") != std::string::npos) {
      ++d.temps;
    }
  }
  return d;
}

TEST(FileTierCrashTest, KilledWritersNeverLeaveCorruptChunksOrExceedCapacity) {
  int rounds = 50;
  if (const char* r = std::getenv("KVTIER_CRASH_ROUNDS")) rounds = std::max(1, std::atoi(r));
  constexpr uint64_t kChunk = 192 << 10;
  constexpr uint64_t kKeys = 40;
  const uint64_t file_bytes = 4096 + kChunk;
  const uint64_t capacity = 12 * file_bytes;
  testing::StorageDir dir;  // the writer and the checks get path(); the scans and damage local()
  std::mt19937_64 rng(20261129);
  int killed_running = 0, temps_seen = 0, corrupted = 0;
  uint64_t max_chunks_seen = 0;

  for (int round = 0; round < rounds; ++round) {
    SCOPED_TRACE(round);
    testing::WorkerProcess writer;
    ASSERT_TRUE(writer.Start({"writer", dir.path(), std::to_string(kChunk),
                              std::to_string(capacity), std::to_string(kKeys),
                              std::to_string(round + 1)}));
    if (round % 5 == 4) {
      // Sometimes during start-up (directory scan, temp cleanup, eviction at Open).
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 20));
    } else {
      ASSERT_EQ(writer.ReadLine(), "ready");
      std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 150));
      ++killed_running;
    }
    int status = writer.Kill(SIGKILL);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the writer died on its own (status " << status << "): it saw a failure or wrong data";

    // What the dead writer left: published chunks within the capacity, maybe temporary files.
    DiskState d = Scan(dir.local());
    EXPECT_LE(d.chunk_bytes, capacity);
    temps_seen += d.temps > 0;
    max_chunks_seen = std::max(max_chunks_seen, d.chunk_files);

    {
      FileTierOptions o;
      o.root = dir.path();
      o.ns = testing::TestNamespace();
      o.chunk_bytes = kChunk;
      o.capacity_bytes = capacity;
      auto tier = FileTier::Open(o);
      ASSERT_TRUE(tier.ok()) << tier.status().ToString();
      // Damage one chunk on the medium, as a failing disk would: it must be a miss.
      std::vector<uint64_t> present;
      for (uint64_t k = 0; k < kKeys; ++k) {
        if (fs::exists(dir.LocalOf((*tier)->ChunkPath(TestKey(k))))) present.push_back(k);
      }
      int64_t damaged = -1;
      if (!present.empty()) {
        damaged = static_cast<int64_t>(present[rng() % present.size()]);
        std::string path = dir.LocalOf((*tier)->ChunkPath(TestKey(damaged)));
        int fd = ::open(path.c_str(), O_RDWR);
        ASSERT_GE(fd, 0);
        uint8_t b = 0;
        off_t at = static_cast<off_t>(rng() % (4096 + kChunk));
        ASSERT_EQ(::pread(fd, &b, 1, at), 1);
        b ^= static_cast<uint8_t>(1u << (rng() % 8));
        ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
        ::close(fd);
        ++corrupted;
      }
      AlignedBuffer buf(kChunk);
      for (uint64_t k = 0; k < kKeys; ++k) {
        std::memset(buf.data(), 0, buf.size());
        Status s = (*tier)->Read(TestKey(k), buf.span());
        ASSERT_TRUE(s.ok() || s.IsNotFound()) << s.ToString();
        if (s.ok()) {
          ASSERT_TRUE(VerifyChunk(TestKey(k), buf.span())) << "wrong chunk served for key " << k;
          ASSERT_NE(static_cast<int64_t>(k), damaged) << "a damaged chunk was served";
        }
      }
      if (damaged >= 0) {
        EXPECT_EQ((*tier)->Stats().corrupt, 1u);
      }
    }

    FsckOptions repair;
    repair.repair = true;
    repair.temp_grace = std::chrono::seconds(0);  // the writer is dead: every temp is stale
    auto fixed = FsckCacheDir(dir.path(), repair);
    ASSERT_TRUE(fixed.ok()) << fixed.status().ToString();
    EXPECT_EQ(fixed->corrupt, 0u) << "the tier already removed the damaged chunk";
    EXPECT_TRUE(fixed->clean());
    FsckOptions check;
    check.temp_grace = std::chrono::seconds(0);
    auto after = FsckCacheDir(dir.path(), check);
    ASSERT_TRUE(after.ok());
    EXPECT_TRUE(after->clean());
    EXPECT_EQ(after->stale_temps + after->corrupt + after->foreign + after->unknown, 0u);
    EXPECT_LE(after->good_bytes, capacity);
  }
  if (rounds >= 50) {
    EXPECT_GE(killed_running, 40);
    EXPECT_GT(temps_seen, 0) << "no kill landed in the middle of a write";
    // Two writers each hold a reservation while a write is in flight.
    EXPECT_GE(max_chunks_seen, 10u) << "the writer never filled the capacity";
  }
  std::printf("%s: %d kills (%d while writing), %d left temporary files, %d chunks damaged\n",
              dir.nfs() ? "nfs" : "local", rounds, killed_running, temps_seen, corrupted);
}

}  // namespace
}  // namespace kvtier
