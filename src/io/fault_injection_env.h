// FaultInjectionEnv wraps any Env and injects faults on a seed: EIO, ENOSPC, short reads and
// writes, bit flips on read, failing syncs and metadata operations, opens that hang, and a
// simulated crash that drops data not yet synced. Crash, corruption and hung-storage tests use
// it, and benchmarks that must show a path makes no I/O call (calls()). Not part of the public
// API: an internal of the tests and tools.
//
// Thread-safety: as Env.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvtier/io.h"

namespace kvtier {

// Probabilities (0..1) of each fault, drawn independently per operation from one seeded generator.
struct FaultInjectionOptions {
  uint64_t seed = 1;
  double read_error = 0;      // a read op fails with EIO
  double write_error = 0;     // a write op fails with EIO
  double no_space = 0;        // a write op fails with ENOSPC
  double short_read = 0;      // a read op moves fewer bytes than asked (not at end of file)
  double short_write = 0;     // a write op moves fewer bytes than asked
  double bit_flip = 0;        // one random bit of a completed read is flipped
  double sync_error = 0;      // Sync or SyncDir fails with EIO
  double metadata_error = 0;  // Open, Rename, Unlink, CreateDirs, List or Stat fails with EIO
  int write_errno = 5;        // what `write_error` fails with: EIO (5), or e.g. EROFS, EACCES
  // A filesystem of this many bytes (0 = no limit): writes and preallocations that would grow
  // the files written through this env beyond it fail with ENOSPC, as on a full disk. Files
  // that existed before are not counted. Applies even while faults are disabled.
  uint64_t space_bytes = 0;
};

// Wraps `base` (not owned; must outlive this) and injects faults. Also records which data and
// directory entries are not yet synced, so that SimulateCrash() can drop them.
class FaultInjectionEnv : public Env {
 public:
  struct Counters {
    uint64_t read_errors = 0, write_errors = 0, no_space = 0, short_reads = 0, short_writes = 0,
             bit_flips = 0, sync_errors = 0, metadata_errors = 0;
    uint64_t total() const {
      return read_errors + write_errors + no_space + short_reads + short_writes + bit_flips +
             sync_errors + metadata_errors;
    }
  };

  FaultInjectionEnv(Env* base, const FaultInjectionOptions& options);
  ~FaultInjectionEnv() override;

  void SetOptions(const FaultInjectionOptions& options);  // also reseeds
  // Faults are injected only while enabled (the default); bookkeeping for crashes continues.
  void SetEnabled(bool enabled);
  Counters counters() const;
  // Calls made through this env so far, faults or not: every Env method (Now() included) and
  // every File method of the files it opened. A wrapper with no faults is thus a counter, for
  // tests and benchmarks that must show a path makes no I/O calls.
  uint64_t calls() const { return calls_.load(std::memory_order_relaxed); }

  // Opens of paths containing `fragment` block, as on a hung NFS server, until ReleaseStalls();
  // then they fail with EIO. An empty fragment stalls nothing. Works while faults are enabled.
  void StallOpens(std::string fragment);
  void ReleaseStalls();
  // Opens blocked by StallOpens right now.
  uint64_t stalled_now() const;
  // Waits until at least `n` opens are blocked, or `timeout`; returns stalled_now() then.
  uint64_t WaitForStalls(uint64_t n, std::chrono::milliseconds timeout);
  // Moves Now() forward (the base env's clock plus everything advanced so far), so that a test
  // can let a timer expire without sleeping.
  void AdvanceClock(std::chrono::nanoseconds by);

  // Simulates a power failure: data written to a file since its last Sync is lost (overwritten
  // with zeros), and files created or renamed into a directory since its last SyncDir disappear.
  // REQUIRES: no File of this env is open (close them first, as a dead process would).
  Status SimulateCrash();

  std::string io_engine_name() const override;
  uint64_t direct_fallbacks() const override { return base_->direct_fallbacks(); }
  Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& options) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Status Unlink(const std::string& path) override;
  Status CreateDirs(const std::string& path) override;
  Status RemoveDir(const std::string& path) override;
  Result<std::vector<DirEntry>> List(const std::string& dir) override;
  Result<FileInfo> Stat(const std::string& path) override;
  Status SyncDir(const std::string& dir) override;
  std::chrono::steady_clock::time_point Now() const override;
  bool publishes_at_sync() const override { return base_->publishes_at_sync(); }

 private:
  friend class FaultFile;
  struct Range {
    uint64_t offset, len;
  };
  struct PathState {
    std::vector<Range> unsynced;  // written since the last Sync
    bool unsynced_entry = false;  // created or renamed here since the parent's last SyncDir
    uint64_t size = 0;            // bytes allocated through this env (for space_bytes)
  };
  // Grows `path` to `end` bytes if space_bytes allows: false (nothing changed) if not.
  bool ClaimSpaceLocked(const std::string& path, uint64_t end);
  void CountCall() const { calls_.fetch_add(1, std::memory_order_relaxed); }
  bool Draw(double p);           // REQUIRES: mu_ held
  uint64_t Uniform(uint64_t n);  // in [0, n); REQUIRES: mu_ held

  Env* const base_;
  mutable std::mutex mu_;
  std::condition_variable stall_cv_;
  std::string stall_fragment_;
  uint64_t stall_generation_ = 0;  // bumped by ReleaseStalls
  uint64_t stalled_now_ = 0;
  FaultInjectionOptions options_;
  std::mt19937_64 rng_;
  bool enabled_ = true;
  Counters counters_;
  std::unordered_map<std::string, PathState> paths_;
  uint64_t space_used_ = 0;  // sum of paths_[*].size
  std::chrono::nanoseconds clock_advance_{0};
  mutable std::atomic<uint64_t> calls_{0};
};

}  // namespace kvtier
