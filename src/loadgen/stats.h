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
};

// q in [0, 1]; linear interpolation between closest ranks (as numpy and pandas do). 0 if empty.
double Quantile(std::vector<double> values, double q);

// `launches`: Unix times of every request sent (any outcome).
Summary Summarize(const std::vector<RequestRecord>& records, const std::vector<double>& launches,
                  const std::vector<FailureRecord>& failures, double start, double end,
                  int64_t on_the_fly, double config_qps);

// The header is exactly
// prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,launch_time,finish_time
std::string CsvHeader();
std::string CsvRow(const RequestRecord& r);
Status WriteCsv(const std::string& path, const std::vector<RequestRecord>& records);

// Multi-line text block for people; `title` heads it.
std::string FormatSummary(const Summary& s, const std::string& title);
// JSON object (as text) with the same figures, snake_case keys.
std::string SummaryToJson(const Summary& s);

}  // namespace kvtier::loadgen
