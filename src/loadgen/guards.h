// Guards against the classic mistakes of cache benchmarks (DESIGN.md, "Measuring honestly"):
// starting from a warm cache directory, prompts that overflow the context window in the last
// rounds, and load above the server's service rate.
//
// Thread-safety: free functions without shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvtier/status.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"

namespace kvtier::loadgen {

struct CacheDirContents {
  // Regular files anywhere below the directory, except the metadata a kvtier file tier writes
  // when it opens an empty directory (kvtier-cache.json, namespace.json): a server started on
  // an empty directory before the benchmark has not warmed it.
  int64_t files = 0;
  uint64_t bytes = 0;
  std::string example;  // one of them, for the message
};

// Fails with InvalidArgument when `dir` does not exist or is not a directory.
Result<CacheDirContents> InspectCacheDir(const std::string& dir);

// OK when `dir` holds no files. Otherwise fails with InvalidArgument (stale chunks from an
// earlier run inflate hit rates), unless `allow_warm`, in which case it appends a warning.
Status CheckCacheDirIsCold(const std::string& dir, bool allow_warm,
                           std::vector<std::string>* warnings);

// OK when the last round's prompt (estimated, times `token_scale` when the server was seen to
// count more tokens than estimated, plus a 5 % margin for answers that re-tokenize longer) plus
// `answer_len` fits in `max_model_len`. Fails with
// InvalidArgument naming the numbers and what to change. max_model_len 0 = unknown = OK.
Status CheckContextWindow(const WorkloadConfig& config, int64_t max_model_len, double token_scale);

// A warning when the run could not keep its configured pacing: actual QPS under `min_ratio` x the
// rate the pacing should send (config.expected_qps(): the server is saturated), or more than a
// tenth of the sends held back behind unanswered requests (answers take longer than a user's gap
// between questions). Empty when the pacing held.
// A window in which the pacing should send fewer than kMinSendsToJudgePacing requests (and did)
// is not judged: a few sends more or less are rounding, not saturation.
std::string SaturationWarning(const Summary& summary, const WorkloadConfig& config,
                              double min_ratio = 0.9);
inline constexpr int kMinSendsToJudgePacing = 10;

// A note when the window was too short for SaturationWarning to judge it; empty otherwise.
std::string ShortRunNote(const Summary& summary, const WorkloadConfig& config);

}  // namespace kvtier::loadgen
