// The workload of a served model, derived from its request records (planner/request_log.h):
// prompt-length quantiles, conversations (their rounds, growth per round and peaks), how many
// are active at once, the arrival rate (busiest and typical hour), and the planner inputs that
// reproduce it.
//
// TrafficAccumulator takes records one at a time in any order and holds memory bounded by the
// number of distinct prompt lengths, the conversations active within `session_timeout_s` of the
// latest record, and a fixed-size time series (MemoryBytes() says how much). Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "planner/request_log.h"

namespace kvtier::planner {

struct TrafficOptions {
  // A conversation with no request for this long is over (a later one with its id starts
  // another). Also bounds the memory: only conversations this recent are held.
  double session_timeout_s = 1800;
  uint64_t context_window = 0;  // tokens; 0 = not checked
};

struct Quantiles {
  uint64_t count = 0;
  double mean = 0;
  uint64_t median = 0, p90 = 0, p99 = 0, max = 0;
};

struct WindowOverflow {
  std::string conversation;  // empty for a request with no conversation
  uint64_t peak_tokens = 0;  // prompt plus completion at its largest
  int64_t round = -1;        // the round that went over, when known
};

struct TrafficSummary {
  uint64_t records = 0;
  Quantiles prompt;      // every request's prompt tokens
  Quantiles completion;  // where the records carry them
  std::map<uint64_t, uint64_t> prompt_histogram;  // prompt tokens -> requests

  // Conversations (records with a user, session or conversation id).
  uint64_t conversations = 0;
  uint64_t complete_conversations = 0;  // neither cut by the log's start or end
  Quantiles rounds;                     // of complete conversations (all when none are)
  Quantiles first_prompt;               // round 1's prompt, where round 1 is in the log
  Quantiles growth_per_round;           // mean prompt growth between rounds, per conversation
  Quantiles peak;                       // per conversation: its largest prompt + completion
  std::map<uint64_t, uint64_t> peak_histogram;

  // Time (records with a time stamp).
  bool timed = false;
  double first_time_s = 0, last_time_s = 0;
  double mean_rate_rps = 0;  // over the whole log
  double window_s = 0;       // the "hour" (shorter when the log is)
  double busiest_start_s = 0, busiest_rate_rps = 0;
  double typical_rate_rps = 0;  // median over the windows with traffic
  uint64_t windows = 0;
  // Conversations active at once (first to last request): the median over the busiest window,
  // the median over the typical windows, and the largest.
  double active_busiest = 0, active_typical = 0, active_peak = 0;

  uint64_t context_window = 0;
  uint64_t window_overflows = 0;  // conversations (or lone requests) past the window
  std::vector<WindowOverflow> overflow_examples;
};

class TrafficAccumulator {
 public:
  explicit TrafficAccumulator(TrafficOptions options = {});
  void Add(const RequestRecord& r);
  TrafficSummary Finish();
  // What the accumulator holds now, approximately.
  size_t MemoryBytes() const;
  size_t ActiveConversations() const { return active_.size(); }

 private:
  struct Conversation {
    double first_t = 0, last_t = 0;
    bool timed = false;
    uint64_t requests = 0;
    int64_t first_round = -1, max_round = -1, last_round = -1;
    uint64_t first_prompt = 0, last_prompt = 0, peak = 0;
    int64_t peak_round = -1;
    bool saw_round_one = false;
    uint64_t round_one_prompt = 0;
    double growth_sum = 0;
    uint64_t growth_steps = 0;
  };
  // Coverage is kept in fixed point (1/kScale of a conversation) so merges stay exact sums.
  static constexpr int64_t kScale = 1 << 20;
  // A difference array of active conversations and a count of arrivals per bucket; buckets
  // double in width when the span outgrows kMaxBuckets, so its size is bounded.
  struct TimeSeries {
    static constexpr size_t kMaxBuckets = 1 << 18;
    double origin = 0, width = 1;
    bool started = false;
    std::vector<int64_t> active_diff;
    std::vector<uint64_t> arrivals;
    void Reserve(double t);  // makes t fall inside
    size_t Index(double t) const;
  };
  void Fold(const std::string& id, const Conversation& c, bool at_end);
  void Expire();

  TrafficOptions options_;
  uint64_t records_ = 0;
  std::unordered_map<uint64_t, uint64_t> prompt_counts_, completion_counts_;
  double prompt_sum_ = 0, completion_sum_ = 0;
  std::unordered_map<std::string, Conversation> active_;
  std::unordered_map<uint64_t, uint64_t> rounds_complete_, rounds_all_, first_prompt_, growth_,
      peak_;
  double rounds_complete_sum_ = 0, rounds_all_sum_ = 0, first_prompt_sum_ = 0, growth_sum_ = 0,
         peak_sum_ = 0;
  uint64_t conversations_ = 0, complete_ = 0;
  // Conversations already folded: their intervals for the censoring test at the end use the
  // median gap, which is only known then; expired ones are complete by definition.
  std::unordered_map<uint64_t, uint64_t> gap_counts_;  // rounded seconds between rounds
  TimeSeries series_;
  bool any_time_ = false;
  double min_t_ = 0, max_t_ = 0;
  uint64_t since_expire_ = 0;
  uint64_t overflows_ = 0;
  std::vector<WindowOverflow> overflow_examples_;
};

// The planner inputs that reproduce a summary (docs/planner.md, "Your own traffic").
struct DerivedWorkload {
  uint32_t users = 1, rounds = 1;
  double qps = 0;  // 0 when the records have no time stamps
  uint64_t question_tokens = 1, answer_tokens = 1, system_prompt_tokens = 0;
  // First-round contexts whose conversation peaks are the median, p90 and largest peak.
  uint64_t context_median = 1, context_p90 = 1, context_peak = 1;
  std::vector<std::string> notes;  // what was assumed, and why
};
// `system_prompt_tokens` is the shared prefix the logs cannot show (0 unless the user knows it);
// `answer_fallback` the answer length when records carry no completion counts.
DerivedWorkload DeriveWorkload(const TrafficSummary& s, uint64_t system_prompt_tokens,
                               uint64_t answer_fallback);

std::string FormatTraffic(const TrafficSummary& s);
nlohmann::json TrafficToJson(const TrafficSummary& s, const DerivedWorkload& w);

// A text histogram of per-conversation peaks (per-request prompts without conversations) with
// the eviction-onset and payoff thresholds marked, `width` columns wide.
std::string ContextPlot(const TrafficSummary& s, double eviction_onset_peak_tokens,
                        std::optional<uint64_t> payoff_tokens, const std::string& payoff_tier,
                        int width = 60);
// The same as a gnuplot script drawing to `path` (.svg or .png).
std::string ContextPlotScript(const TrafficSummary& s, double eviction_onset_peak_tokens,
                              std::optional<uint64_t> payoff_tokens,
                              const std::string& payoff_tier, const std::string& path);

}  // namespace kvtier::planner
