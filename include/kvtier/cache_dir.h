// Whole-directory operations on a file-tier cache (docs/file-format.md), local or nfs://: check
// and repair (`kvtier fsck`), summarize (`kvtier stats`) and empty (`kvtier purge`). They work on
// any cache directory without knowing its namespaces' options: everything needed is in the
// headers.
//
// Thread-safety: each call is independent; they may run while tiers use the directory (a file
// that vanishes during a check is skipped; a chunk being written is a fresh temporary file).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvtier/io.h"
#include "kvtier/status.h"

namespace kvtier {

// OK if `root` holds the kvtier-cache.json marker; kNotFound if `root` does not exist;
// kInvalidArgument if it exists but is not a kvtier cache.
Status CheckCacheDir(const std::string& root, Env* env = nullptr);

struct FsckOptions {
  bool repair = false;  // remove corrupt files and stale temporary files
  std::chrono::seconds temp_grace{600};  // temporary files older than this are stale
  int threads = 2;                       // files checked in parallel
  Env* env = nullptr;                    // nullptr: Env::Default(), or NFS for nfs://
  // Called now and then from the calling thread with (files checked, files in total).
  std::function<void(uint64_t, uint64_t)> progress;
};

struct FsckFinding {
  enum class Kind { kCorrupt, kForeign, kStaleTemp, kUnknown };
  Kind kind;
  std::string path;
  std::string reason;
  bool removed = false;
};
std::string_view FsckFindingKindName(FsckFinding::Kind kind);

struct FsckReport {
  uint64_t namespaces = 0;
  uint64_t files = 0;          // everything looked at
  uint64_t good = 0;           // chunk files that pass every check
  uint64_t good_bytes = 0;
  uint64_t corrupt = 0;        // bad header, checksum, size or truncation
  uint64_t foreign = 0;        // well-formed, but another namespace / version / place
  uint64_t stale_temps = 0;    // temporary files older than the grace period
  uint64_t fresh_temps = 0;    // temporary files younger (writes in flight): left alone
  uint64_t unknown = 0;        // names that are not part of the format: never removed
  uint64_t removed = 0;        // with repair
  uint64_t remove_failures = 0;
  std::vector<FsckFinding> findings;  // every bad file, by name
  // Nothing corrupt or stale is left (after repair, if asked).
  bool clean() const {
    return corrupt + stale_temps == removed && remove_failures == 0;
  }
};

// Reads every chunk file in full (O_DIRECT where possible, so the check does not fill the page
// cache) and checks it against docs/file-format.md. Fails only if `root` is not a readable kvtier
// cache; problems with individual files are findings.
Result<FsckReport> FsckCacheDir(const std::string& root, const FsckOptions& options);

struct NamespaceSummary {
  std::string id;
  std::string model_id;       // from namespace.json; empty if unknown
  uint64_t chunk_bytes = 0;   // likewise
  uint64_t chunks = 0, bytes = 0;
  uint64_t temps = 0, temp_bytes = 0;
  int64_t oldest_mtime_ns = 0, newest_mtime_ns = 0;  // of chunks; 0 when none
};

struct CacheDirSummary {
  std::vector<NamespaceSummary> namespaces;
  uint64_t chunks = 0, bytes = 0, temps = 0, temp_bytes = 0;
  int64_t oldest_mtime_ns = 0, newest_mtime_ns = 0;
};

// Lists the directory (names and stat only; no chunk is read).
Result<CacheDirSummary> SummarizeCacheDir(const std::string& root, Env* env = nullptr);

struct PurgeReport {
  uint64_t files = 0, bytes = 0, directories = 0;
};
// Removes every namespace folder (or only `namespace_id`) with its chunks and temporary files;
// keeps `root` and its marker. Refuses a directory that is not a kvtier cache.
Result<PurgeReport> PurgeCacheDir(const std::string& root, const std::string& namespace_id = "",
                                  Env* env = nullptr);

}  // namespace kvtier
