#include "loadgen/stats.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvtier::loadgen {

double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double pos = std::clamp(q, 0.0, 1.0) * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return values[lo] + (values[hi] - values[lo]) * frac;
}

Summary Summarize(const std::vector<RequestRecord>& records, const std::vector<double>& launches,
                  const std::vector<FailureRecord>& failures, double start, double end,
                  int64_t on_the_fly, double config_qps) {
  Summary s;
  s.start = start;
  s.end = end;
  s.seconds = std::max(end - start, 1e-9);
  s.config_qps = config_qps;
  s.on_the_fly = on_the_fly;
  for (double t : launches) s.sent += (t >= start && t <= end) ? 1 : 0;
  std::vector<double> ttfts, latencies;
  double prompt = 0, generated = 0, per_request_rate = 0;
  int64_t rated = 0;
  for (const auto& r : records) {
    if (r.finish_time < start || r.finish_time > end) continue;
    ++s.finished;
    prompt += static_cast<double>(r.prompt_tokens);
    generated += static_cast<double>(r.generation_tokens);
    ttfts.push_back(r.ttft);
    latencies.push_back(r.finish_time - r.launch_time);
    if (r.generation_time > 0) {
      per_request_rate += static_cast<double>(r.generation_tokens) / r.generation_time;
      ++rated;
    }
  }
  for (const auto& f : failures) {
    if (f.finish_time < start || f.finish_time > end) continue;
    ++s.failed;
    ++s.failures[f.kind];
  }
  s.actual_qps = static_cast<double>(s.sent) / s.seconds;
  s.processing_speed = static_cast<double>(s.finished) / s.seconds;
  s.input_tokens_per_s = prompt / s.seconds;
  s.output_tokens_per_s = generated / s.seconds;
  s.generation_tokens_per_request_s = rated > 0 ? per_request_rate / static_cast<double>(rated) : 0;
  if (!ttfts.empty()) {
    double sum = 0;
    for (double t : ttfts) sum += t;
    s.mean_ttft = sum / static_cast<double>(ttfts.size());
    s.median_ttft = Quantile(ttfts, 0.5);
    s.p90_ttft = Quantile(ttfts, 0.9);
    s.median_latency = Quantile(latencies, 0.5);
  }
  return s;
}

std::string CsvHeader() {
  return "prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,launch_time,"
         "finish_time";
}

std::string CsvRow(const RequestRecord& r) {
  return fmt::format("{},{},{:.6f},{:.6f},{},{},{:.6f},{:.6f}", r.prompt_tokens,
                     r.generation_tokens, r.ttft, r.generation_time, r.user_id, r.question_id,
                     r.launch_time, r.finish_time);
}

Status WriteCsv(const std::string& path, const std::vector<RequestRecord>& records) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return Status::FromErrno(errno, fmt::format("creating {}", tmp));
    out << CsvHeader() << '\n';
    for (const auto& r : records) out << CsvRow(r) << '\n';
    out.flush();
    if (!out) return Status::IOError(fmt::format("writing {}", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return Status::FromErrno(errno, fmt::format("renaming {} to {}", tmp, path));
  }
  return Status::Ok();
}

std::string FormatSummary(const Summary& s, const std::string& title) {
  std::string out;
  out += fmt::format("==================== {} ====================\n", title);
  out += fmt::format("  Config QPS:                       {:.4f} reqs/s\n", s.config_qps);
  if (s.expected_qps > 0) {
    out += fmt::format("  Expected QPS (pacing):            {:.4f} reqs/s\n", s.expected_qps);
  }
  out += fmt::format("  Actual QPS:                       {:.4f} reqs/s ({} sent)\n", s.actual_qps,
                     s.sent);
  out += fmt::format("  Processing speed:                 {:.4f} reqs/s ({} finished)\n",
                     s.processing_speed, s.finished);
  out += fmt::format("  Requests on-the-fly:              {}\n", s.on_the_fly);
  out += fmt::format("  Input tokens per second:          {:.1f} tokens/s\n", s.input_tokens_per_s);
  out += fmt::format("  Output tokens per second:         {:.1f} tokens/s\n", s.output_tokens_per_s);
  out += fmt::format("  Average generation throughput:    {:.2f} tokens/req/s\n",
                     s.generation_tokens_per_request_s);
  out += fmt::format("  Average TTFT:                     {:.4f} s\n", s.mean_ttft);
  out += fmt::format("  Median TTFT:                      {:.4f} s\n", s.median_ttft);
  out += fmt::format("  P90 TTFT:                         {:.4f} s\n", s.p90_ttft);
  out += fmt::format("  Median request time:              {:.4f} s\n", s.median_latency);
  if (s.failed > 0) {
    std::string kinds;
    for (const auto& [kind, n] : s.failures) {
      kinds += fmt::format("{}{} {}", kinds.empty() ? "" : ", ", n, kind);
    }
    out += fmt::format("  Failed requests:                  {} ({})\n", s.failed, kinds);
  }
  if (s.held_back > 0) {
    out += fmt::format("  Sends held back (answer pending): {}\n", s.held_back);
  }
  out += fmt::format("  Peak concurrent streams:          {}\n", s.peak_in_flight);
  out += fmt::format("  Window:                           {:.2f} s\n", s.seconds);
  return out;
}

std::string SummaryToJson(const Summary& s) {
  nlohmann::json j = {
      {"window_start", s.start},
      {"window_end", s.end},
      {"window_seconds", s.seconds},
      {"config_qps", s.config_qps},
      {"expected_qps", s.expected_qps},
      {"actual_qps", s.actual_qps},
      {"processing_speed_rps", s.processing_speed},
      {"requests_on_the_fly", s.on_the_fly},
      {"sent", s.sent},
      {"finished", s.finished},
      {"failed", s.failed},
      {"failures", s.failures},
      {"input_tokens_per_s", s.input_tokens_per_s},
      {"output_tokens_per_s", s.output_tokens_per_s},
      {"generation_tokens_per_request_s", s.generation_tokens_per_request_s},
      {"mean_ttft_s", s.mean_ttft},
      {"median_ttft_s", s.median_ttft},
      {"p90_ttft_s", s.p90_ttft},
      {"median_request_time_s", s.median_latency},
      {"held_back_sends", s.held_back},
      {"peak_concurrent_streams", s.peak_in_flight},
  };
  return j.dump(2);
}

}  // namespace kvtier::loadgen
