// Per-request records of the chat benchmark, their CSV form, and the summary arithmetic.
//
// The summary over a window [start, end] follows the LMCache multi-round QA benchmark:
//  * Config QPS: the requested rate;
//  * Actual QPS: requests sent in the window (finished, failed or still running) / window length;
//  * Processing speed: requests finished successfully in the window / window length;
//  * Requests on-the-fly: unanswered requests at the end of the window;
//  * Input / Output tokens per second: prompt / generated tokens of the finished requests /
//    window length;
//  * Average generation throughput per request: mean of generated tokens / generation time;
//  * TTFT: mean, median and p90 over the finished requests (linear interpolation between ranks).
//
// The summary of a whole run (SummarizeRun) differs in one way: the requests still in flight when
// the run stopped sending were drained (waited for), and their TTFT and request time count in the
// latency statistics, as in the LMCache benchmark, which waits for them too; leaving them out
// biases TTFT low exactly when the server queues. The rates stay those of the sending window.
// Requests still unanswered when the drain gave up are counted as unfinished, with how long
// they had waited (their TTFT is at least that), and are in no average.
//
// Thread-safety: values and free functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::loadgen {

// One finished request. Times in seconds; launch and finish are Unix times.
struct RequestRecord {
  int64_t prompt_tokens = 0;
  int64_t generation_tokens = 0;
  double ttft = 0;             // launch -> first non-empty content
  double generation_time = 0;  // first content -> end of stream
  int user_id = 0;
  int question_id = 0;
  double launch_time = 0;
  double finish_time = 0;
};

struct FailureRecord {
  double finish_time = 0;  // Unix time
  std::string kind;        // FailureKindName
};

struct Summary {
  double start = 0, end = 0, seconds = 0;
  double config_qps = 0;
  double expected_qps = 0;      // what the pacing sends when the server keeps up (0: not shown)
  double actual_qps = 0;
  double processing_speed = 0;
  int64_t on_the_fly = 0;
  int64_t sent = 0;
  int64_t finished = 0;
  int64_t failed = 0;
  std::map<std::string, int64_t> failures;  // by kind
  double input_tokens_per_s = 0;
  double output_tokens_per_s = 0;
  double generation_tokens_per_request_s = 0;
  double mean_ttft = 0, median_ttft = 0, p90_ttft = 0;
  double median_latency = 0;    // launch -> end of stream
  int64_t held_back = 0;        // sends delayed because the user's previous answer was pending
  int64_t peak_in_flight = 0;   // most concurrent streams seen in the window
  // SummarizeRun only:
  int64_t drained = 0;             // finished after the sending stopped; in the latency figures
  int64_t unfinished = 0;          // given up on at the end of the drain; in no figure
  int64_t unfinished_without_first_token = 0;
  double unfinished_longest_wait = 0;  // seconds from launch to the end of the drain
};

// A request given up on at the end of a run (censored): its TTFT is unknown but at least
// `waited` when it had no first token yet.
struct UnfinishedRecord {
  int user_id = 0;
  int question_id = 0;
  double launch_time = 0;  // Unix time
  double waited = 0;       // seconds from launch to when it was given up on
  double ttft = -1;        // seconds, when the first token had come; -1 otherwise
};

// q in [0, 1]; linear interpolation between closest ranks (as numpy and pandas do). 0 if empty.
double Quantile(std::vector<double> values, double q);

// `launches`: Unix times of every request sent (any outcome).
Summary Summarize(const std::vector<RequestRecord>& records, const std::vector<double>& launches,
                  const std::vector<FailureRecord>& failures, double start, double end,
                  int64_t on_the_fly, double config_qps);

// The summary of a measured run that sent requests during [start, end] and then drained them
// (see above): counts and rates over [start, end] as Summarize; TTFT, request time and the
// generation throughput over every finished request launched in [start, end], drained ones
// included; every failure of the run counted, whenever it came.
Summary SummarizeRun(const std::vector<RequestRecord>& records, const std::vector<double>& launches,
                     const std::vector<FailureRecord>& failures,
                     const std::vector<UnfinishedRecord>& unfinished, double start, double end,
                     double config_qps);

// The header is exactly
// prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,launch_time,finish_time
std::string CsvHeader();
std::string CsvRow(const RequestRecord& r);
Status WriteCsv(const std::string& path, const std::vector<RequestRecord>& records);
// Reads a CSV written by WriteCsv or by LMCache's benchmark (columns found by name in the header;
// others ignored). InvalidArgument names the line of a malformed row or a missing column.
Result<std::vector<RequestRecord>> ReadCsv(const std::string& path);
// The summary LMCache's --process-summary prints for a CSV: the window from the first launch to
// the last finish, every row in it. InvalidArgument when there is no row.
Result<Summary> SummarizeCsv(const std::vector<RequestRecord>& records);

// OK when `path` can be created or overwritten (tried with a file beside it, then removed).
// Fails with InvalidArgument naming `flag` and the reason.
Status CheckWritable(const std::string& path, const std::string& flag);

// Multi-line text block for people; `title` heads it. Config QPS and the peak concurrent
// streams are left out when 0 (unknown, as in the summary of a CSV).
std::string FormatSummary(const Summary& s, const std::string& title);
// JSON object (as text) with the same figures, snake_case keys.
std::string SummaryToJson(const Summary& s);

}  // namespace kvtier::loadgen
