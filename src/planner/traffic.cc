#include "planner/traffic.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>

namespace kvtier::planner {
namespace {

constexpr double kHour = 3600;
constexpr size_t kMaxOverflowExamples = 5;

std::string Commas(uint64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return s;
}

Quantiles ToQuantiles(const std::unordered_map<uint64_t, uint64_t>& counts, double sum,
                      std::map<uint64_t, uint64_t>* sorted_out = nullptr) {
  Quantiles q;
  std::vector<std::pair<uint64_t, uint64_t>> v(counts.begin(), counts.end());
  std::sort(v.begin(), v.end());
  for (const auto& [value, n] : v) q.count += n;
  if (q.count == 0) return q;
  q.mean = sum / static_cast<double>(q.count);
  q.max = v.back().first;
  auto at = [&](double f) {
    // The smallest value with at least f of the records at or below it.
    const uint64_t need = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(f * q.count)));
    uint64_t cum = 0;
    for (const auto& [value, n] : v) {
      cum += n;
      if (cum >= need) return value;
    }
    return v.back().first;
  };
  q.median = at(0.5);
  q.p90 = at(0.9);
  q.p99 = at(0.99);
  if (sorted_out) sorted_out->insert(v.begin(), v.end());
  return q;
}

double MedianOf(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

uint64_t MedianGapTenths(const std::unordered_map<uint64_t, uint64_t>& gaps) {
  return ToQuantiles(gaps, 0).median;
}

std::string FormatTime(double t) {
  const std::time_t s = static_cast<std::time_t>(t);
  std::tm tm{};
  gmtime_r(&s, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

std::string QuantileLine(const Quantiles& q) {
  return fmt::format("median {}, p90 {}, p99 {}, peak {} (mean {:.0f})", Commas(q.median),
                     Commas(q.p90), Commas(q.p99), Commas(q.max), q.mean);
}

nlohmann::json QuantilesJson(const Quantiles& q) {
  return {{"count", q.count}, {"mean", q.mean}, {"median", q.median},
          {"p90", q.p90},     {"p99", q.p99},   {"max", q.max}};
}

}  // namespace

void TrafficAccumulator::TimeSeries::Reserve(double t) {
  if (!started) {
    started = true;
    width = 1;
    origin = std::floor(t);
    active_diff.assign(1024, 0);
    arrivals.assign(1024, 0);
    return;
  }
  auto merge = [this] {
    // Doubles the width. The diff array is turned into coverage, pairs averaged, then back.
    std::vector<double> cov(active_diff.size());
    double run = 0;
    for (size_t i = 0; i < active_diff.size(); ++i) cov[i] = run += static_cast<double>(active_diff[i]) / kScale;
    const size_t half = (active_diff.size() + 1) / 2;
    std::vector<int64_t> diff(half, 0);
    std::vector<uint64_t> arr(half, 0);
    double prev = 0;
    for (size_t k = 0; k < half; ++k) {
      const double a = cov[2 * k], b = 2 * k + 1 < cov.size() ? cov[2 * k + 1] : 0;
      const double c = (a + b) / 2;
      diff[k] = std::llround((c - prev) * kScale);
      prev = c;
      arr[k] = arrivals[2 * k] + (2 * k + 1 < arrivals.size() ? arrivals[2 * k + 1] : 0);
    }
    active_diff = std::move(diff);
    arrivals = std::move(arr);
    width *= 2;
  };
  if (t < origin) {
    // An earlier record (files out of order): prepend whole buckets.
    const size_t extra = static_cast<size_t>(std::ceil((origin - t) / width));
    const size_t grow = std::max(extra, active_diff.size() / 2);
    active_diff.insert(active_diff.begin(), grow, 0);
    arrivals.insert(arrivals.begin(), grow, 0);
    origin -= static_cast<double>(grow) * width;
  }
  while (active_diff.size() > kMaxBuckets) merge();
  for (;;) {
    const double idx = std::floor((t - origin) / width);
    if (idx + 2 < static_cast<double>(active_diff.size())) return;
    if (active_diff.size() < kMaxBuckets) {
      const size_t want = std::min(kMaxBuckets, std::max(active_diff.size() * 2,
                                                         static_cast<size_t>(idx) + 3));
      active_diff.resize(want, 0);
      arrivals.resize(want, 0);
    } else {
      merge();
    }
  }
}

size_t TrafficAccumulator::TimeSeries::Index(double t) const {
  const double idx = std::floor((t - origin) / width);
  return static_cast<size_t>(std::clamp(idx, 0.0, static_cast<double>(active_diff.size() - 1)));
}

TrafficAccumulator::TrafficAccumulator(TrafficOptions options) : options_(options) {}

void TrafficAccumulator::Add(const RequestRecord& r) {
  ++records_;
  ++prompt_counts_[r.prompt_tokens];
  prompt_sum_ += static_cast<double>(r.prompt_tokens);
  if (r.has_completion) {
    ++completion_counts_[r.completion_tokens];
    completion_sum_ += static_cast<double>(r.completion_tokens);
  }
  const bool timed = std::isfinite(r.time_s);
  if (timed) {
    if (!any_time_) {
      min_t_ = max_t_ = r.time_s;
      any_time_ = true;
    }
    min_t_ = std::min(min_t_, r.time_s);
    max_t_ = std::max(max_t_, r.time_s);
    series_.Reserve(r.time_s);
    ++series_.arrivals[series_.Index(r.time_s)];
  }
  const uint64_t size = r.prompt_tokens + r.completion_tokens;
  if (r.conversation.empty()) {
    if (options_.context_window > 0 && size > options_.context_window) {
      ++overflows_;
      if (overflow_examples_.size() < kMaxOverflowExamples) {
        overflow_examples_.push_back({"", size, r.round});
      }
    }
  } else {
    Conversation& c = active_[r.conversation];
    if (c.requests == 0) {
      c.first_prompt = r.prompt_tokens;
      c.first_round = r.round;
      if (timed) {
        c.timed = true;
        c.first_t = c.last_t = r.time_s;
      }
    } else {
      const bool same_round = r.round >= 1 && r.round == c.last_round;
      if (!same_round) {
        const int64_t steps = r.round >= 1 && c.last_round >= 1 ? r.round - c.last_round : 1;
        if (steps > 0) {
          c.growth_sum += (static_cast<double>(r.prompt_tokens) -
                           static_cast<double>(c.last_prompt)) / static_cast<double>(steps);
          c.growth_steps += 1;
        }
      }
      if (timed && c.timed && r.time_s > c.last_t && !same_round) {
        ++gap_counts_[static_cast<uint64_t>(std::llround((r.time_s - c.last_t) * 10))];
      }
      if (timed) {
        if (!c.timed) {
          c.timed = true;
          c.first_t = c.last_t = r.time_s;
        }
        c.first_t = std::min(c.first_t, r.time_s);
        c.last_t = std::max(c.last_t, r.time_s);
      }
    }
    ++c.requests;
    if (r.round >= 1) {
      c.first_round = c.first_round < 1 ? r.round : std::min(c.first_round, r.round);
      c.max_round = std::max(c.max_round, r.round);
      if (r.round == 1 && !c.saw_round_one) {
        c.saw_round_one = true;
        c.round_one_prompt = r.prompt_tokens;
      }
    }
    c.last_round = r.round;
    c.last_prompt = r.prompt_tokens;
    if (size > c.peak) {
      c.peak = size;
      c.peak_round = r.round;
    }
  }
  if (++since_expire_ >= (1 << 16)) {
    since_expire_ = 0;
    Expire();
  }
}

void TrafficAccumulator::Expire() {
  if (!any_time_) return;
  for (auto it = active_.begin(); it != active_.end();) {
    if (it->second.timed && max_t_ - it->second.last_t > options_.session_timeout_s) {
      Fold(it->first, it->second, /*at_end=*/false);
      it = active_.erase(it);
    } else {
      ++it;
    }
  }
}

void TrafficAccumulator::Fold(const std::string& id, const Conversation& c, bool at_end) {
  ++conversations_;
  const uint64_t rounds = c.max_round >= 1 ? static_cast<uint64_t>(c.max_round) : c.requests;
  // A conversation the log's edges may have cut: it started within 1.5 typical gaps of the
  // log's start (only when rounds are not numbered: numbered rounds say where it began), or its
  // last request came within 1.5 gaps of the end (its next question would be after the log).
  bool cut = false;
  if (c.timed && !gap_counts_.empty()) {
    const double gap = 1.5 * static_cast<double>(MedianGapTenths(gap_counts_)) / 10;
    if (c.max_round < 1 && c.first_t - min_t_ < gap) cut = true;
    if (at_end && max_t_ - c.last_t < gap) cut = true;
  }
  ++rounds_all_[rounds];
  rounds_all_sum_ += static_cast<double>(rounds);
  if (!cut) {
    ++complete_;
    ++rounds_complete_[rounds];
    rounds_complete_sum_ += static_cast<double>(rounds);
  }
  if (c.saw_round_one || (c.first_round < 1 && !cut)) {
    const uint64_t p = c.saw_round_one ? c.round_one_prompt : c.first_prompt;
    ++first_prompt_[p];
    first_prompt_sum_ += static_cast<double>(p);
  }
  if (c.growth_steps > 0) {
    const uint64_t g = static_cast<uint64_t>(
        std::llround(std::max(0.0, c.growth_sum / static_cast<double>(c.growth_steps))));
    ++growth_[g];
    growth_sum_ += static_cast<double>(g);
  }
  ++peak_[c.peak];
  peak_sum_ += static_cast<double>(c.peak);
  if (options_.context_window > 0 && c.peak > options_.context_window) {
    ++overflows_;
    if (overflow_examples_.size() < kMaxOverflowExamples) {
      overflow_examples_.push_back({id, c.peak, c.peak_round});
    }
  }
  if (c.timed && c.last_t > c.first_t) {
    // Time-weighted: each bucket gets the fraction of it the conversation spans.
    const double w = series_.width;
    const size_t a = series_.Index(c.first_t), b = series_.Index(c.last_t);
    auto add = [&](size_t k, double fraction) {
      const auto v = std::llround(fraction * kScale);
      series_.active_diff[k] += v;
      if (k + 1 < series_.active_diff.size()) series_.active_diff[k + 1] -= v;
    };
    const double a_end = series_.origin + static_cast<double>(a + 1) * w;
    const double b_start = series_.origin + static_cast<double>(b) * w;
    if (a == b) {
      add(a, (c.last_t - c.first_t) / w);
    } else {
      add(a, (a_end - c.first_t) / w);
      add(b, (c.last_t - b_start) / w);
      if (b > a + 1) {
        series_.active_diff[a + 1] += kScale;
        series_.active_diff[b] -= kScale;
      }
    }
  }
}

size_t TrafficAccumulator::MemoryBytes() const {
  // Hash-map nodes cost about their payload plus two pointers and the bucket array.
  constexpr size_t kNode = 48;
  size_t bytes = (prompt_counts_.size() + completion_counts_.size() + rounds_complete_.size() +
                  rounds_all_.size() + first_prompt_.size() + growth_.size() + peak_.size() +
                  gap_counts_.size()) * kNode;
  for (const auto& [id, c] : active_) bytes += kNode + sizeof(Conversation) + id.capacity();
  bytes += series_.active_diff.capacity() * sizeof(int64_t) +
           series_.arrivals.capacity() * sizeof(uint64_t);
  return bytes;
}

TrafficSummary TrafficAccumulator::Finish() {
  for (const auto& [id, c] : active_) Fold(id, c, /*at_end=*/true);
  active_.clear();
  TrafficSummary s;
  s.records = records_;
  s.prompt = ToQuantiles(prompt_counts_, prompt_sum_, &s.prompt_histogram);
  s.completion = ToQuantiles(completion_counts_, completion_sum_);
  s.conversations = conversations_;
  s.complete_conversations = complete_;
  s.rounds = complete_ > 0 ? ToQuantiles(rounds_complete_, rounds_complete_sum_)
                           : ToQuantiles(rounds_all_, rounds_all_sum_);
  s.first_prompt = ToQuantiles(first_prompt_, first_prompt_sum_);
  s.growth_per_round = ToQuantiles(growth_, growth_sum_);
  s.peak = ToQuantiles(peak_, peak_sum_, &s.peak_histogram);
  s.context_window = options_.context_window;
  s.window_overflows = overflows_;
  s.overflow_examples = overflow_examples_;

  if (any_time_ && series_.started) {
    s.timed = true;
    s.first_time_s = min_t_;
    s.last_time_s = max_t_;
    const double span = std::max(max_t_ - min_t_, series_.width);
    s.mean_rate_rps = static_cast<double>(records_) / span;
    const double w = series_.width;
    const size_t first = series_.Index(min_t_), last = series_.Index(max_t_);
    std::vector<double> cov(last - first + 1);
    double run = 0;
    for (size_t i = 0; i <= last; ++i) {
      run += static_cast<double>(series_.active_diff[i]) / kScale;
      if (i >= first) cov[i - first] = std::max(0.0, run);
    }
    // The window: an hour, or the whole log when it is shorter.
    s.window_s = std::min(kHour, span);
    const size_t wb = std::max<size_t>(1, static_cast<size_t>(std::llround(s.window_s / w)));
    const size_t n = cov.size();
    // Busiest: the window of wb buckets with the most arrivals.
    uint64_t sum = 0, best = 0;
    size_t best_start = 0;
    for (size_t i = 0; i < n; ++i) {
      sum += series_.arrivals[first + i];
      if (i >= wb) sum -= series_.arrivals[first + i - wb];
      if (i + 1 >= wb && sum > best) {
        best = sum;
        best_start = i + 1 - wb;
      }
    }
    if (n < wb) {
      best = records_;
      best_start = 0;
    }
    s.busiest_start_s = series_.origin + static_cast<double>(first + best_start) * w;
    s.busiest_rate_rps = static_cast<double>(best) / s.window_s;
    auto median_cov = [&](size_t from, size_t count) {
      std::vector<double> v(cov.begin() + static_cast<ptrdiff_t>(from),
                            cov.begin() + static_cast<ptrdiff_t>(std::min(n, from + count)));
      return MedianOf(std::move(v));
    };
    s.active_busiest = median_cov(best_start, wb);
    s.active_peak = *std::max_element(cov.begin(), cov.end());
    // Typical: the median of the back-to-back windows that saw a request.
    std::vector<std::pair<double, size_t>> windows;  // (rate, start)
    for (size_t start = 0; start < n; start += wb) {
      uint64_t a = 0;
      for (size_t i = start; i < std::min(n, start + wb); ++i) a += series_.arrivals[first + i];
      if (a > 0) {
        const double len = std::min(static_cast<double>(std::min(n, start + wb) - start) * w,
                                    s.window_s);
        windows.emplace_back(static_cast<double>(a) / std::max(len, w), start);
      }
    }
    // A log shorter than an hour has one window: the busiest is also the typical one.
    if (span < kHour && !windows.empty()) windows.resize(1);
    s.windows = windows.size();
    if (!windows.empty()) {
      std::sort(windows.begin(), windows.end());
      const auto& mid = windows[(windows.size() - 1) / 2];
      s.typical_rate_rps = windows.size() == 1 ? s.busiest_rate_rps : mid.first;
      s.active_typical = median_cov(mid.second, wb);
    }
  }
  return s;
}

DerivedWorkload DeriveWorkload(const TrafficSummary& s, uint64_t system_prompt_tokens,
                               uint64_t answer_fallback) {
  DerivedWorkload w;
  w.system_prompt_tokens = system_prompt_tokens;
  const bool conversations = s.conversations > 0;
  w.rounds = conversations ? static_cast<uint32_t>(std::max<uint64_t>(1, s.rounds.median)) : 1;
  if (s.completion.count > 0) {
    w.answer_tokens = std::max<uint64_t>(1, s.completion.median);
  } else {
    w.answer_tokens = std::max<uint64_t>(1, answer_fallback);
    w.notes.push_back(fmt::format(
        "the records carry no completion counts: answers taken as {} tokens (--answer-tokens)",
        w.answer_tokens));
  }
  if (conversations && s.growth_per_round.count > 0) {
    // Each round's prompt holds the previous answer and the new question.
    const uint64_t g = s.growth_per_round.median;
    w.question_tokens = g > w.answer_tokens ? g - w.answer_tokens : 1;
    if (g <= w.answer_tokens) {
      w.notes.push_back(fmt::format(
          "prompts grow {} tokens a round, not more than an answer ({}): questions taken as 1 "
          "token (answers trimmed from the history, or a client that resends less)",
          g, w.answer_tokens));
    }
  } else {
    w.question_tokens = 1;
    if (!conversations) {
      w.notes.push_back(
          "no user, session or conversation ids: every request is a conversation of one round "
          "(give --log-fields user=FIELD if the records have one)");
    }
  }
  if (conversations && s.timed) {
    w.users = static_cast<uint32_t>(std::max(1.0, std::round(s.active_busiest)));
  } else {
    w.users = 1;
    w.notes.push_back(s.timed ? "no conversations: --users (from the flag) is not derived"
                              : "no time stamps: --users and --qps are not derived");
  }
  if (s.timed && s.busiest_rate_rps > 0) {
    // bench qa's pacing (and the planner's): rounds questions are sent over rounds - 1 gaps.
    w.qps = w.rounds > 1 ? s.busiest_rate_rps * (w.rounds - 1) / w.rounds : s.busiest_rate_rps;
  }
  // A conversation's peak is system + context + rounds x (question + answer).
  const uint64_t per_round = w.rounds * (w.question_tokens + w.answer_tokens);
  auto context_for = [&](uint64_t peak) -> uint64_t {
    const uint64_t fixed = system_prompt_tokens + per_round;
    return peak > fixed ? peak - fixed : 1;
  };
  if (conversations) {
    w.context_median = context_for(s.peak.median);
    w.context_p90 = context_for(s.peak.p90);
    w.context_peak = context_for(s.peak.max);
  } else {
    w.context_median = context_for(s.prompt.median + w.answer_tokens);
    w.context_p90 = context_for(s.prompt.p90 + w.answer_tokens);
    w.context_peak = context_for(s.prompt.max + w.answer_tokens);
  }
  return w;
}

std::string FormatTraffic(const TrafficSummary& s) {
  std::string out;
  out += fmt::format("  prompt tokens       {}\n", QuantileLine(s.prompt));
  if (s.completion.count > 0) {
    out += fmt::format("  completion tokens   {}\n", QuantileLine(s.completion));
  }
  if (s.conversations > 0) {
    out += fmt::format("  conversations       {} ({} not cut by the log's start or end)\n",
                       Commas(s.conversations), Commas(s.complete_conversations));
    out += fmt::format("    rounds            {}\n", QuantileLine(s.rounds));
    if (s.first_prompt.count > 0) {
      out += fmt::format("    first-round prompt {}\n", QuantileLine(s.first_prompt));
    }
    if (s.growth_per_round.count > 0) {
      out += fmt::format("    growth per round  {} tokens\n", QuantileLine(s.growth_per_round));
    }
    out += fmt::format("    peak (prompt + answer) {}\n", QuantileLine(s.peak));
  }
  if (s.timed) {
    out += fmt::format("  time                {} to {} UTC ({:.0f} s); {:.3f} requests/s overall\n",
                       FormatTime(s.first_time_s), FormatTime(s.last_time_s),
                       s.last_time_s - s.first_time_s, s.mean_rate_rps);
    const std::string window =
        s.window_s >= kHour ? "hour" : fmt::format("{:.0f} s (the whole log)", s.window_s);
    out += fmt::format("  busiest {}   from {}: {:.3f} requests/s", window,
                       FormatTime(s.busiest_start_s), s.busiest_rate_rps);
    if (s.conversations > 0) {
      out += fmt::format(", {:.1f} conversations active at once (median)", s.active_busiest);
    }
    out += "\n";
    if (s.windows > 1) {
      out += fmt::format("  typical hour        {:.3f} requests/s", s.typical_rate_rps);
      if (s.conversations > 0) out += fmt::format(", {:.1f} conversations active", s.active_typical);
      out += fmt::format(" (median of {} hours with traffic)\n", s.windows);
    }
    if (s.conversations > 0) {
      out += fmt::format("  most active at once {:.1f} conversations\n", s.active_peak);
    }
  }
  if (s.context_window > 0) {
    if (s.window_overflows == 0) {
      out += fmt::format("  context window      {} tokens: no {} exceeds it\n",
                         Commas(s.context_window),
                         s.conversations > 0 ? "conversation" : "request");
    } else {
      out += fmt::format("  WARNING: {} {} exceed the context window of {} tokens:",
                         Commas(s.window_overflows),
                         s.conversations > 0 ? "conversations" : "requests",
                         Commas(s.context_window));
      for (const WindowOverflow& o : s.overflow_examples) {
        out += fmt::format(" {}{} tokens{};",
                           o.conversation.empty() ? "" : "'" + o.conversation + "' ",
                           Commas(o.peak_tokens),
                           o.round >= 1 ? fmt::format(" at round {}", o.round) : "");
      }
      out += " a server with this window refuses (or truncates) them\n";
    }
  }
  return out;
}

nlohmann::json TrafficToJson(const TrafficSummary& s, const DerivedWorkload& w) {
  nlohmann::json j = {
      {"records", s.records},
      {"prompt_tokens", QuantilesJson(s.prompt)},
      {"completion_tokens", QuantilesJson(s.completion)},
      {"conversations", s.conversations},
      {"complete_conversations", s.complete_conversations},
      {"rounds", QuantilesJson(s.rounds)},
      {"first_round_prompt", QuantilesJson(s.first_prompt)},
      {"growth_per_round", QuantilesJson(s.growth_per_round)},
      {"conversation_peak", QuantilesJson(s.peak)},
      {"context_window", s.context_window},
      {"window_overflows", s.window_overflows},
  };
  nlohmann::json overflow = nlohmann::json::array();
  for (const auto& o : s.overflow_examples) {
    overflow.push_back({{"conversation", o.conversation}, {"peak_tokens", o.peak_tokens},
                        {"round", o.round}});
  }
  j["overflow_examples"] = overflow;
  if (s.timed) {
    j["time"] = {{"first_s", s.first_time_s},
                 {"last_s", s.last_time_s},
                 {"mean_rate_rps", s.mean_rate_rps},
                 {"window_s", s.window_s},
                 {"busiest_start_s", s.busiest_start_s},
                 {"busiest_rate_rps", s.busiest_rate_rps},
                 {"typical_rate_rps", s.typical_rate_rps},
                 {"windows", s.windows},
                 {"active_busiest", s.active_busiest},
                 {"active_typical", s.active_typical},
                 {"active_peak", s.active_peak}};
  }
  j["derived"] = {{"users", w.users},
                  {"rounds", w.rounds},
                  {"qps", w.qps},
                  {"question_tokens", w.question_tokens},
                  {"answer_tokens", w.answer_tokens},
                  {"system_prompt_tokens", w.system_prompt_tokens},
                  {"context_median", w.context_median},
                  {"context_p90", w.context_p90},
                  {"context_peak", w.context_peak},
                  {"notes", w.notes}};
  return j;
}

namespace {

// Log-spaced bins of the distribution that is plotted: conversation peaks, else prompts.
struct Bins {
  std::vector<double> lo, hi;
  std::vector<uint64_t> count;
  const char* what = "";
};

Bins MakeBins(const TrafficSummary& s, int nbins, double mark1 = 0, double mark2 = 0) {
  Bins b;
  const bool conv = s.conversations > 0;
  const auto& hist = conv ? s.peak_histogram : s.prompt_histogram;
  b.what = conv ? "conversation peaks (prompt + answer, tokens)" : "prompts (tokens)";
  if (hist.empty()) return b;
  // The range covers the data and the thresholds, so that both show where they fall.
  double min = std::max(1.0, static_cast<double>(hist.begin()->first));
  double max = static_cast<double>(hist.rbegin()->first) + 1;
  const double data_min = min, data_max = max;
  for (double m : {mark1, mark2}) {
    // A threshold far from every value is named below the plot instead of stretching it.
    if (m > 1 && m >= data_min / 8 && m <= data_max * 8) {
      min = std::min(min, m);
      max = std::max(max, m * 1.01);
    }
  }
  max = std::max(max, min * 1.01);
  const double step = std::log(max / min) / nbins;
  for (int i = 0; i < nbins; ++i) {
    b.lo.push_back(min * std::exp(step * i));
    b.hi.push_back(min * std::exp(step * (i + 1)));
  }
  b.count.assign(static_cast<size_t>(nbins), 0);
  for (const auto& [v, n] : hist) {
    const double x = std::max(1.0, static_cast<double>(v));
    int i = static_cast<int>(std::log(x / min) / step);
    b.count[static_cast<size_t>(std::clamp(i, 0, nbins - 1))] += n;
  }
  return b;
}

}  // namespace

std::string ContextPlot(const TrafficSummary& s, double eviction_onset_peak_tokens,
                        std::optional<uint64_t> payoff_tokens, const std::string& payoff_tier,
                        int width) {
  const Bins b = MakeBins(s, 16, eviction_onset_peak_tokens,
                          payoff_tokens ? static_cast<double>(*payoff_tokens) : 0);
  if (b.count.empty()) return "";
  const uint64_t top = *std::max_element(b.count.begin(), b.count.end());
  std::string out = fmt::format("Distribution of {}; E = eviction onset ({} tokens per user)",
                                b.what, Commas(static_cast<uint64_t>(eviction_onset_peak_tokens)));
  if (payoff_tokens) {
    out += *payoff_tokens <= 1
               ? fmt::format(", P = {} pays off (any prefix)", payoff_tier)
               : fmt::format(", P = {} pays off ({} tokens)", payoff_tier, Commas(*payoff_tokens));
  }
  out += "\n";
  for (size_t i = 0; i < b.count.size(); ++i) {
    const int bar = top ? static_cast<int>(std::llround(static_cast<double>(b.count[i]) * width /
                                                        static_cast<double>(top)))
                        : 0;
    std::string marks;
    if (eviction_onset_peak_tokens >= b.lo[i] && eviction_onset_peak_tokens < b.hi[i]) marks += " <E";
    if (payoff_tokens && *payoff_tokens >= b.lo[i] && *payoff_tokens < b.hi[i]) marks += " <P";
    out += fmt::format("  {:>9} - {:>9} |{:<{}}| {}{}\n",
                       Commas(static_cast<uint64_t>(b.lo[i])),
                       Commas(static_cast<uint64_t>(b.hi[i])), std::string(static_cast<size_t>(bar), '#'),
                       width, Commas(b.count[i]), marks);
  }
  const double lo = b.lo.front(), hi = b.hi.back();
  if (eviction_onset_peak_tokens < lo || eviction_onset_peak_tokens >= hi) {
    out += fmt::format("  E lies {} every {} shown\n",
                       eviction_onset_peak_tokens < lo ? "below" : "above",
                       s.conversations > 0 ? "conversation" : "prompt");
  }
  if (payoff_tokens && (*payoff_tokens < lo || *payoff_tokens >= hi)) {
    out += fmt::format("  P lies {} every {} shown\n", *payoff_tokens < lo ? "below" : "above",
                       s.conversations > 0 ? "conversation" : "prompt");
  }
  return out;
}

std::string ContextPlotScript(const TrafficSummary& s, double eviction_onset_peak_tokens,
                              std::optional<uint64_t> payoff_tokens,
                              const std::string& payoff_tier, const std::string& path) {
  const Bins b = MakeBins(s, 40, eviction_onset_peak_tokens,
                          payoff_tokens ? static_cast<double>(*payoff_tokens) : 0);
  const bool png = path.ends_with(".png");
  std::string out;
  out += png ? "set terminal pngcairo size 1000,600\n" : "set terminal svg size 1000,600\n";
  out += fmt::format("set output '{}'\n", path);
  out += fmt::format("set title 'Distribution of {}'\n", b.what);
  out += "set xlabel 'tokens'\nset ylabel 'count'\nset logscale x\nset style fill solid 0.6\n";
  out += "set grid\n";
  out += fmt::format(
      "set arrow from {0},graph 0 to {0},graph 1 nohead lc rgb 'red' lw 2\n"
      "set label 'eviction onset' at {0},graph 0.95 left offset 0.5,0 tc rgb 'red'\n",
      std::max(1.0, eviction_onset_peak_tokens));
  if (payoff_tokens) {
    out += fmt::format(
        "set arrow from {0},graph 0 to {0},graph 1 nohead lc rgb 'blue' lw 2\n"
        "set label '{1} pays off' at {0},graph 0.88 left offset 0.5,0 tc rgb 'blue'\n",
        std::max<uint64_t>(1, *payoff_tokens), payoff_tier);
  }
  out += "$data << EOD\n";
  for (size_t i = 0; i < b.count.size(); ++i) {
    out += fmt::format("{} {} {}\n", std::sqrt(b.lo[i] * b.hi[i]), b.count[i], b.hi[i] - b.lo[i]);
  }
  out += "EOD\nplot $data using 1:2:3 with boxes title 'count' lc rgb '#4477aa'\n";
  return out;
}

}  // namespace kvtier::planner
