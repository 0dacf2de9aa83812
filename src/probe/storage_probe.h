// The storage probe behind `kvtier bench storage`: what a directory's storage really delivers to
// chunk-sized reads, measured so that the page cache or a cache further down cannot pass itself off
// as storage.
//
// What one run does, inside a fresh private subdirectory of the directory under test:
//  1. writes a pool of chunk-sized files (one set per reader of the largest reader count) and a
//     separate set of control files, with O_DIRECT and fdatasync, several writers in parallel;
//     every 4 KiB sector carries a stamp (run nonce, file, offset), so data is unique (nothing to
//     deduplicate or compress) and every read can prove it returned this run's bytes;
//  2. checks O_DIRECT: that open() accepts it, that the flag stays set, whether misaligned I/O is
//     refused, and (with mincore) that reads left no pages in the page cache;
//  3. for each reader count R, reads the whole pool with R threads, each on its own files
//     (reader r takes files r, r+R, r+2R, ...), one pread of `block_size` at a time;
//  4. reads the control files once with a single O_DIRECT stream (files never read before);
//  5. re-reads the control files: much faster than the first read means a cache below the page
//     cache (hypervisor, storage server, array) is serving repeated reads;
//  6. reads the pool with buffered I/O, first after dropping it from the page cache (cold), then
//     again (warm), for contrast: the warm figure is what a naive benchmark would report;
//  7. removes everything it wrote, also when it fails or is interrupted (see `stop`).
//
// Throughputs are in GB/s (10^9 bytes per second), over the wall time of the whole phase.
//
// Over NFS without a mount (`directory` is nfs://HOST/EXPORT/PATH), the probe's I/O goes through
// an NFS env (NewNfsEnv: libnfs, user space, `nfs_connections` TCP connections) instead of
// system calls: steps 1, 3, 4, 5 and 7 run as above (COMMIT in place of fdatasync, no
// preallocation), each reader opening its own files so that the env's round-robin spreads the
// readers over the connections. Steps 2 and 6 do not apply: this client has no page cache, so
// there is no O_DIRECT to check, no mincore and no buffered read; the report says so
// (`nfs`, ODirectCheck::applicable) rather than reporting them as failed or as zeros.
//
// Thread-safety: RunStorageProbe may be called from any thread; it starts and joins its own
// worker threads and shares nothing between calls.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::probe {

struct StorageProbeOptions {
  std::string directory;              // an existing, writable directory on the storage to test
  uint64_t file_size = 36ull << 20;   // bytes per file: one 256-token chunk of Qwen3-8B
  uint64_t block_size = 1ull << 20;   // bytes per read or write request
  std::vector<int> reader_counts = {1, 16, 32};
  int files_per_reader = 1;           // pool = max(reader_counts) x files_per_reader files
  int control_files = 8;              // read by one stream; never part of the pool
  int writers = 4;                    // threads writing the files
  // nfs:// only: TCP connections of the NFS env, in [0, 256]; 0 = the largest reader count
  // (capped at 256), one connection per reader. Ignored for a local directory.
  int nfs_connections = 0;
  bool keep_files = false;            // leave the files in place (for inspection)
  // Called from the calling thread with one line per step (may be empty).
  std::function<void(const std::string&)> progress;
  // When set and it becomes true, the probe stops within one request per thread, removes its
  // files and returns Aborted.
  const std::atomic<bool>* stop = nullptr;
};

struct PhaseResult {
  int streams = 0;       // threads issuing I/O
  uint64_t bytes = 0;    // bytes moved
  double seconds = 0;    // wall time of the phase
  double GBps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
};

struct ODirectCheck {
  // False over NFS (libnfs has no client page cache: nothing to bypass, nothing to check); the
  // fields below are then unset and `detail` says why.
  bool applicable = true;
  bool open_accepted = false;       // open(O_DIRECT) succeeded
  bool flag_kept = false;           // fcntl(F_GETFL) still shows O_DIRECT
  bool alignment_enforced = false;  // a misaligned O_DIRECT read failed with EINVAL
  // Fraction of the read files' pages found in the page cache (mincore) after the O_DIRECT
  // phases; near 0 when O_DIRECT bypassed it.
  double resident_fraction = 0;
  bool honoured = false;            // all of the above say the page cache was bypassed
  std::string detail;               // one sentence for people
};

struct StorageProbeReport {
  std::string directory;
  std::string filesystem;  // e.g. "ext4", "nfs", "tmpfs"; "nfs (libnfs, user space)" for nfs://
  bool nfs = false;        // measured through the user-space NFS client (nfs:// directory)
  int nfs_connections = 0;  // the NFS env's connections (0 when not nfs)
  uint64_t file_size = 0;
  uint64_t block_size = 0;
  int pool_files = 0;
  int control_files = 0;
  ODirectCheck o_direct;
  PhaseResult write;                // O_DIRECT writes of pool and control files, with fdatasync
  std::vector<PhaseResult> reads;   // one per reader count, in the order requested
  PhaseResult control;              // single stream, first read of the control files
  PhaseResult control_reread;       // single stream, second read of the control files
  PhaseResult buffered_cold;        // single stream, buffered, after POSIX_FADV_DONTNEED
  PhaseResult buffered_warm;        // single stream, buffered, from the page cache
                                    // (both not measured, all zero, over NFS)
  uint64_t verified_bytes = 0;      // bytes read whose every sector's stamp was checked
  std::vector<std::string> warnings;
};

// How much of a set of files the page cache holds, from mincore over a read-only mapping of each
// file: the control that shows whether reads bypassed the page cache (O_DIRECT honoured) or not
// (tmpfs, or a filesystem that ignores the flag). Files that cannot be opened or mapped are
// skipped and not counted in total_bytes. Thread-safe; blocks for a few system calls per file.
struct PageCacheResidency {
  uint64_t resident_bytes = 0;  // bytes of the files found in the page cache
  uint64_t total_bytes = 0;     // bytes of the files examined
};
PageCacheResidency MeasurePageCacheResidency(const std::vector<std::string>& paths);

// Runs the probe. Fails with InvalidArgument for bad options, a malformed nfs:// URL or a
// directory that is missing or not writable, NoSpace when the files would not fit (checked
// beforehand for a local directory only; over NFS a full export fails the writes), IOError for
// failed I/O, Corruption when a read returns bytes this run did not write, and Aborted when
// `stop` was raised. Over NFS also Unavailable when the server cannot be reached or exports no
// prefix of the URL's path (NewNfsEnv's errors). Blocks for the whole run (seconds to minutes,
// depending on sizes and storage).
Result<StorageProbeReport> RunStorageProbe(const StorageProbeOptions& options);

// The report as JSON: readers (list of {readers, read_GBps, bytes, seconds}), control_GBps,
// control_reread_GBps, buffered_read_GBps (warm), buffered_cold_read_GBps, write_GBps, o_direct,
// o_direct_applicable, o_direct_detail, verified_bytes, nfs_connections, and the run's
// parameters and warnings. What does not apply (over NFS: o_direct, the buffered figures, the
// page-cache fraction, the alignment check) is null, never a number.
std::string StorageProbeReportToJson(const StorageProbeReport& report);

// The report as lines for people: one line per measured workload, then the verdict.
std::string StorageProbeReportToText(const StorageProbeReport& report);

}  // namespace kvtier::probe
