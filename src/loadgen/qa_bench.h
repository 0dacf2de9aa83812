// `kvtier bench qa`: the multi-round chat load generator for OpenAI-compatible servers.
//
// RunQaBench checks the server (GET /models), applies the guards (cold cache directory, context
// window), sends a few warm-up requests (excluded from the results, and used to check how the
// server counts prompt tokens), then either
//  * runs the workload (workload.h) for `duration_s`, printing a summary every
//    `log_interval_s`; then stops sending, drains the requests still in flight (waits for them, up
//    to `drain_timeout_s`, and includes them: see stats.h) and prints the final summary, or
//  * with `find_capacity`, overloads the server on purpose and reports the finished-request rate
//    it reaches (the service rate) and the qps that keeps the server at 65 % of it. The paced
//    method (the default, the published benchmark's own): the workload itself in stages with
//    --qps doubling, until the server falls behind the pacing or its finished rate stops growing
//    by 10 %. The closed loop: stages with 1x, 2x, 4x ... `num_users` conversations each asking
//    again as soon as answered, until the finished rate stops growing by 10 %. The two keep
//    prefixes differently hot (back-to-back users keep theirs), so they can disagree near the
//    cache's eviction threshold.
// Everything runs on the calling thread, over one libcurl multi handle.
//
// Thread-safety: one call per thread; the options' callbacks are called on the calling thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/status.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"

namespace kvtier::loadgen {

enum class CapacityMethod { kPaced, kClosedLoop };

struct QaBenchOptions {
  WorkloadConfig workload;
  std::string base_url = "http://localhost:8000/v1";
  std::string model;             // empty: the first model the server lists
  std::string api_key;           // bearer token, if the server wants one
  double duration_s = 60;        // --time; 0 = until `stop`. Also bounds the warm-up.
  double log_interval_s = 30;
  int warmup_requests = 10;
  double request_timeout_s = 600;
  double connect_timeout_s = 10;
  bool ignore_eos = false;       // vLLM's extension: always generate answer_len tokens
  std::string cache_dir;         // guard: refuse when it holds files
  bool allow_warm_cache = false;
  int64_t max_model_len = 0;     // 0: as the server reports in /models
  bool find_capacity = false;
  CapacityMethod capacity_method = CapacityMethod::kPaced;
  double capacity_stage_s = 20;  // seconds per stage
  int capacity_max_streams = 1024;  // closed loop: the most concurrent conversations
  int capacity_max_stages = 8;      // paced: the most stages (--qps x 2^7 at most)
  double capacity_target = 0.65; // fraction of the service rate to recommend
  // Abort when this many requests failed and none succeeded.
  int fail_fast_after = 20;
  // At the end of the run, how long to wait for the requests in flight (they are included);
  // those still unanswered then are recorded as unfinished. 0: do not wait.
  double drain_timeout_s = 600;
  // The warm-up's prompts begin with the run's shared system prompt (so the server has cached
  // it before the run, as a server in production would have). false: each warm-up prompt begins
  // with a text of its own, so nothing it leaves in the cache is a prefix of the run's prompts.
  bool warmup_shared_prefix = true;
  // Files the caller will write after the run (--output, --json-summary): refused before any
  // request is sent when they cannot be written.
  std::vector<std::pair<std::string, std::string>> output_files;  // (flag, path)
  // This many connection failures in a row, with no answer between them, mean the server is
  // gone: the run stops and reports it as an error.
  int server_gone_after = 3;
  bool verbose = false;  // log every send and every answer
  // Send nothing: play the workload's pacing on a simulated clock for `duration_s` (or one
  // conversation's life when 0), answering every request at once, and report what would be sent.
  bool dry_run = false;
  const std::atomic<bool>* stop = nullptr;     // stop sending (then drain)
  const std::atomic<bool>* give_up = nullptr;  // stop draining: the rest is unfinished
  std::function<void(const std::string&)> print;  // results (summaries, tables)
  std::function<void(const std::string&)> log;    // progress, warnings, errors
  bool progress_in_place = false;  // progress line rewritten with \r (a terminal)
  double progress_interval_s = 1;
};

struct CapacityStage {
  int streams = 0;            // closed loop; 0 for the paced method
  double seconds = 0;         // measured window (after the stage's first tenth)
  int64_t finished = 0;
  double finished_rps = 0;
  double median_ttft = 0;
  int64_t failed = 0;
  double qps = 0;             // paced: the stage's --qps; 0 for the closed loop
  double sent_rps = 0;        // requests sent per second in the measured window
  // Paced: the server finished under 90 % of what was sent one latency earlier (ReadPacedStage),
  // which ends the probe. A probe also ends on a plateau (finished rate under 1.1x the best before).
  bool fell_behind = false;
};

struct QaBenchResult {
  std::string model;
  int64_t max_model_len = 0;           // 0 when unknown
  int64_t peak_prompt_estimate = 0;    // tokens, after calibration
  double token_scale = 1;              // server tokens / estimated tokens in the warm-up
  std::vector<RequestRecord> records;  // finished requests of the measured run, drained included
  std::vector<UnfinishedRecord> unfinished;  // given up on at the end of the drain
  Summary summary;                     // the whole measured run
  std::vector<std::string> warnings;
  bool saturated = false;
  // Faults that make the run's figures unfit to publish although it measured something: a round
  // of the conversation systematically refused by the server, the server gone mid-run. The
  // command prints the summary, writes its files, then these, and exits non-zero.
  std::vector<std::string> errors;
  int64_t abandoned_users = 0;  // conversations ended by a refused request
  // --dry-run only:
  int64_t dry_run_sends = 0;
  int dry_run_users = 0;
  double dry_run_seconds = 0;
  // --find-capacity only:
  std::vector<CapacityStage> stages;
  double service_rate_rps = 0;
  double recommended_qps = 0;
};

Status ValidateQaBenchOptions(const QaBenchOptions& options);

// Fails with InvalidArgument (bad options, a guard refused, an output file that cannot be
// written), Unavailable (server unreachable, the warm-up failing or outlasting `duration_s`, every
// request failing), Aborted (stopped before anything finished). A run that measured something but
// went wrong returns its result with `errors`.
Result<QaBenchResult> RunQaBench(const QaBenchOptions& options);

// The JSON document for --json-summary: options, final summary, warnings, capacity stages.
std::string QaBenchResultToJson(const QaBenchOptions& options, const QaBenchResult& result);

struct ServerInfo {
  std::vector<std::string> models;
  int64_t max_model_len = 0;  // of the first model, or of `model` if listed; 0 when unreported
};
// GET <base_url>/models. Unavailable when unreachable or answering with an error.
Result<ServerInfo> QueryServer(const std::string& base_url, const std::string& api_key,
                               const std::string& model, double timeout_s);

}  // namespace kvtier::loadgen
