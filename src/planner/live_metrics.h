// A running server's state, read from its Prometheus endpoint: vLLM's /metrics (prompt tokens,
// the prefix cache's queries and hits, the KV connector's, KV cache usage, preemptions,
// requests) and, optionally, `kvtier serve`'s (bytes read per tier). Read-only: it only GETs.
//
// The text format is parsed here because prometheus-cpp, which the server uses to publish,
// has no parser; only what the exposition format needs for these series is read (names,
// labels, values; timestamps and exemplars are ignored). Values; thread-compatible.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::planner {

struct MetricSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

class MetricScrape {
 public:
  // Fails on text with no sample at all, or whose lines are mostly not samples (an HTML page,
  // a JSON answer): what a URL that is not a Prometheus endpoint returns.
  static Result<MetricScrape> Parse(std::string_view text);
  // Sum over the series of `name` whose labels include all of `labels`; 0 when none.
  double Sum(std::string_view name, const std::map<std::string, std::string>& labels = {}) const;
  bool Has(std::string_view name) const;
  const std::vector<MetricSample>& samples() const { return samples_; }

 private:
  std::vector<MetricSample> samples_;
};

// GETs `url` (http://host:port/path; /metrics when no path). Fails with a clear message when
// the host does not answer within `timeout_s`, answers with a status other than 200, or the
// URL is not http://.
Result<std::string> HttpGet(const std::string& url, double timeout_s);

// What vLLM's counters say, over a window (the difference of two scrapes) or since its start.
struct VllmState {
  double prompt_tokens = 0;    // vllm:prompt_tokens_total
  double requests = 0;         // vllm:request_success_total
  double prefix_queries = 0;   // vllm:prefix_cache_queries_total (tokens)
  double prefix_hits = 0;      // vllm:prefix_cache_hits_total
  bool has_external = false;   // a KV connector reports vllm:external_prefix_cache_*
  double external_queries = 0;
  double external_hits = 0;
  double preemptions = 0;      // vllm:num_preemptions_total
  double prompt_hist_sum = 0, prompt_hist_count = 0;  // vllm:request_prompt_tokens
  std::vector<std::pair<double, double>> prompt_buckets;  // (le, cumulative count)
  // Gauges, from the last scrape.
  double kv_cache_usage = 0;  // vllm:kv_cache_usage_perc (a fraction, despite its name)
  double running = 0, waiting = 0;
  double window_s = 0;  // 0: totals since the server started

  double MeanPrompt() const { return prompt_hist_count > 0 ? prompt_hist_sum / prompt_hist_count : 0; }
  // A quantile of prompt tokens from the histogram's buckets (linear within a bucket).
  double PromptQuantile(double q) const;
};
// Fails when the scrape holds no vllm: series ("not a vLLM metrics endpoint").
Result<VllmState> ReadVllmState(const MetricScrape& now);
// The counters' growth from `before` to `now` over `seconds` (gauges are now's).
VllmState Difference(const VllmState& now, const VllmState& before, double seconds);

struct KvtierState {
  double memory_bytes_read = 0, file_bytes_read = 0;  // kvtier_bytes_read_total{tier=...}
  double memory_bytes_written = 0, file_bytes_written = 0;
};
Result<KvtierState> ReadKvtierState(const MetricScrape& now);
KvtierState Difference(const KvtierState& now, const KvtierState& before);

// Shares of prompt tokens by where they came from: vLLM's GPU prefix cache, kvtier's memory
// tier, its file tier (a file-tier hit passes through memory and is counted once, as file),
// other external sources (a connector that is not kvtier, or kvtier without its metrics), and
// recomputed.
struct HitShares {
  double gpu = 0, memory = 0, file = 0, external_other = 0, recompute = 0;
};
HitShares ComputeHitShares(const VllmState& v, const std::optional<KvtierState>& k,
                           uint64_t kv_bytes_per_token);

// The regime the hit rates show (DESIGN.md's three): 1 when the GPU keeps what is reused (the
// connector serves under 1 % of the tokens queried, no preemption, the KV cache not full);
// otherwise 3 when the mean prompt is at least `payoff_tokens` of the slowest tier, else 2.
struct MeasuredRegime {
  int regime = 1;
  std::string why;
};
MeasuredRegime ClassifyMeasuredRegime(const VllmState& v, std::optional<uint64_t> payoff_tokens);

}  // namespace kvtier::planner
