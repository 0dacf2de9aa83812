// `kvtier bench tier`: the file tier against the physical limit of the storage under it.
//
// RunTierBench writes then reads `chunks` chunks through a FileTier on `dir`, and in the same run
// does plain writes and reads of files of the same size with the same concurrency: O_DIRECT
// system calls on a local path, plain libnfs on nfs://HOST/EXPORT/PATH (io::NfsRawClient, one
// connection per thread), plain libcurl on s3://BUCKET/PREFIX (io::S3RawClient, one whole-object
// PUT or GET at a time per thread). Each repeat uses a fresh namespace, alternates which of the
// two goes first (so that drift on a shared machine hits both alike) and removes its files
// (unless `keep`). Figures are totals over all repeats.
//
// On a local path the run also checks that the reads came from storage: the files read must not
// be in the page cache afterwards (tmpfs accepts O_DIRECT and serves every read from memory).
// When they are, the result carries a `warning` and its figures are page-cache figures.
//
// Thread-safety: one call per thread; `log` is called on the calling thread.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::benchmarks {

struct TierBenchOptions {
  // A path (created if missing), nfs://HOST/EXPORT/PATH or s3://BUCKET/PREFIX.
  std::string dir;
  uint64_t chunk_mib = 32;             // [1, 4096]
  uint32_t chunks = 32;                // per repeat, > 0
  int readers = 4;                     // [1, 256]: tier read threads, raw readers
  int writers = 4;                     // [1, 256]: tier write threads, raw writers
  int repeats = 4;                     // > 0
  std::string io_engine = "auto";      // auto, io_uring or threads
  int io_depth = 8;                    // tier requests in flight per chunk
  uint64_t request_kib = 4096;         // tier read request size
  uint64_t write_request_kib = 65536;  // tier write request size
  // nfs:// and s3:// only: the tier's connections; 0: max(readers, writers) for NFS, four times
  // that for S3 (whose reads are ranged GETs of several parts at once). At most 256.
  int connections = 0;
  int s3_part_mib = 0;  // s3:// only; 0: the env's default
  bool keep = false;    // leave the tier's chunk files in `dir`
  // Progress: one line (no newline) when the run starts and after each timed phase, and
  // warnings that do not stop the run. Null: silent.
  std::function<void(const std::string&)> log;
};

// Bytes moved by one kind of phase over all repeats, and the time it took.
struct Throughput {
  uint64_t bytes = 0;
  double seconds = 0;
  double GBps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};

struct TierBenchResult {
  Throughput tier_write, tier_read;
  Throughput raw_write, raw_read;  // the reference; its writes include an fdatasync per file
  std::string reference;           // "raw O_DIRECT", "raw libnfs" or "raw libcurl"
  std::string io_engine;           // the tier's, as it reports it
  bool nfs = false, s3 = false;    // dir was nfs:// or s3://
  int connections = 0;             // the tier's connections (nfs:// and s3:// only)
  bool tier_opened_o_direct = false;
  // Of the files read, what the page cache held after the read phases (local paths only).
  uint64_t tier_page_cache_resident_bytes = 0, raw_page_cache_resident_bytes = 0;
  std::vector<std::string> kept_namespaces;  // with `keep`
  // Non-empty: the reads did not come from storage (O_DIRECT refused, or accepted and not
  // honoured); the figures must not be taken for the storage's.
  std::string warning;

  bool remote() const { return nfs || s3; }
  bool o_direct() const { return warning.empty(); }
  uint64_t page_cache_resident_bytes() const {
    return tier_page_cache_resident_bytes + raw_page_cache_resident_bytes;
  }
  double write_ratio() const { return tier_write.GBps() / raw_write.GBps(); }
  double read_ratio() const { return tier_read.GBps() / raw_read.GBps(); }
};

// InvalidArgument, naming the flag of `kvtier bench tier`, when an option is out of range.
Status ValidateTierBenchOptions(const TierBenchOptions& options);

// Runs the benchmark. Fails with InvalidArgument (bad options, not enough free space), or the
// error of the storage (`dir` unusable, a write or read failing, the tier not serving every chunk).
// A failure's message() is complete: it includes the code of the error underneath. The files of
// the reference are removed whatever happens.
Result<TierBenchResult> RunTierBench(const TierBenchOptions& options);

// The JSON document of `kvtier bench tier --json`.
nlohmann::json TierBenchResultToJson(const TierBenchOptions& options,
                                     const TierBenchResult& result);

}  // namespace kvtier::benchmarks
