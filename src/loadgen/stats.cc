#include "loadgen/stats.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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

namespace {

// TTFT, request time and generation throughput over `records`.
void SetLatencies(const std::vector<const RequestRecord*>& records, Summary& s) {
  std::vector<double> ttfts, latencies;
  double per_request_rate = 0;
  int64_t rated = 0;
  for (const RequestRecord* r : records) {
    ttfts.push_back(r->ttft);
    latencies.push_back(r->finish_time - r->launch_time);
    if (r->generation_time > 0) {
      per_request_rate += static_cast<double>(r->generation_tokens) / r->generation_time;
      ++rated;
    }
  }
  s.generation_tokens_per_request_s = rated > 0 ? per_request_rate / static_cast<double>(rated) : 0;
  s.mean_ttft = s.median_ttft = s.p90_ttft = s.median_latency = 0;
  if (!ttfts.empty()) {
    double sum = 0;
    for (double t : ttfts) sum += t;
    s.mean_ttft = sum / static_cast<double>(ttfts.size());
    s.median_ttft = Quantile(ttfts, 0.5);
    s.p90_ttft = Quantile(ttfts, 0.9);
    s.median_latency = Quantile(latencies, 0.5);
  }
}

}  // namespace

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
  std::vector<const RequestRecord*> finished;
  double prompt = 0, generated = 0;
  for (const auto& r : records) {
    if (r.finish_time < start || r.finish_time > end) continue;
    ++s.finished;
    prompt += static_cast<double>(r.prompt_tokens);
    generated += static_cast<double>(r.generation_tokens);
    finished.push_back(&r);
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
  SetLatencies(finished, s);
  return s;
}

Summary SummarizeRun(const std::vector<RequestRecord>& records, const std::vector<double>& launches,
                     const std::vector<FailureRecord>& failures,
                     const std::vector<UnfinishedRecord>& unfinished, double start, double end,
                     double config_qps) {
  Summary s = Summarize(records, launches, {}, start, end, 0, config_qps);
  std::vector<const RequestRecord*> sent_in_run;
  for (const auto& r : records) {
    if (r.launch_time < start || r.launch_time > end) continue;
    sent_in_run.push_back(&r);
    if (r.finish_time > end) ++s.drained;
  }
  SetLatencies(sent_in_run, s);
  for (const auto& f : failures) {
    ++s.failed;
    ++s.failures[f.kind];
  }
  for (const auto& u : unfinished) {
    ++s.unfinished;
    if (u.ttft < 0) ++s.unfinished_without_first_token;
    s.unfinished_longest_wait = std::max(s.unfinished_longest_wait, u.waited);
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

Result<std::vector<RequestRecord>> ReadCsv(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::FromErrno(errno, fmt::format("opening {}", path));
  auto split = [](const std::string& line) {
    std::vector<std::string> cells;
    std::string cell;
    for (char c : line) {
      if (c == ',') {
        cells.push_back(cell);
        cell.clear();
      } else if (c != '\r') {
        cell.push_back(c);
      }
    }
    cells.push_back(cell);
    return cells;
  };
  std::string line;
  if (!std::getline(in, line)) return Status::InvalidArgument(fmt::format("{} is empty", path));
  const std::vector<std::string> header = split(line);
  const char* kColumns[] = {"prompt_tokens", "generation_tokens", "ttft", "generation_time",
                            "user_id", "question_id", "launch_time", "finish_time"};
  int index[8];
  for (int c = 0; c < 8; ++c) {
    auto it = std::find(header.begin(), header.end(), kColumns[c]);
    if (it == header.end()) {
      return Status::InvalidArgument(fmt::format("{}: no column {} in the header", path, kColumns[c]));
    }
    index[c] = static_cast<int>(it - header.begin());
  }
  std::vector<RequestRecord> records;
  for (int number = 2; std::getline(in, line); ++number) {
    if (line.empty() || line == "\r") continue;
    const std::vector<std::string> cells = split(line);
    double v[8];
    for (int c = 0; c < 8; ++c) {
      const auto i = static_cast<size_t>(index[c]);
      char* end = nullptr;
      errno = 0;
      v[c] = i < cells.size() ? std::strtod(cells[i].c_str(), &end) : 0;
      if (i >= cells.size() || end == cells[i].c_str() || *end != '\0' || errno != 0 ||
          !std::isfinite(v[c])) {
        return Status::InvalidArgument(
            fmt::format("{} line {}: {} is not a number", path, number, kColumns[c]));
      }
    }
    RequestRecord r;
    r.prompt_tokens = static_cast<int64_t>(v[0]);
    r.generation_tokens = static_cast<int64_t>(v[1]);
    r.ttft = v[2];
    r.generation_time = v[3];
    r.user_id = static_cast<int>(v[4]);
    r.question_id = static_cast<int>(v[5]);
    r.launch_time = v[6];
    r.finish_time = v[7];
    records.push_back(r);
  }
  return records;
}

Result<Summary> SummarizeCsv(const std::vector<RequestRecord>& records) {
  if (records.empty()) return Status::InvalidArgument("the CSV holds no request");
  double start = records.front().launch_time, end = records.front().finish_time;
  std::vector<double> launches;
  for (const auto& r : records) {
    start = std::min(start, r.launch_time);
    end = std::max(end, r.finish_time);
    launches.push_back(r.launch_time);
  }
  return Summarize(records, launches, {}, start, end, 0, 0);
}

Status CheckWritable(const std::string& path, const std::string& flag) {
  // WriteCsv writes beside the file and renames: the directory must take a new file.
  const std::string probe = path + ".tmp";
  const bool existed = std::filesystem::exists(probe);
  std::ofstream out(probe, std::ios::app);
  if (!out) {
    return Status::InvalidArgument(
        fmt::format("{} {}: cannot write there ({})", flag, path, std::strerror(errno)));
  }
  out.close();
  if (!existed) std::filesystem::remove(probe);
  if (std::filesystem::is_directory(path)) {
    return Status::InvalidArgument(fmt::format("{} {}: is a directory", flag, path));
  }
  return Status::Ok();
}

std::string FormatSummary(const Summary& s, const std::string& title) {
  std::string out;
  out += fmt::format("==================== {} ====================\n", title);
  if (s.config_qps > 0) {  // 0: not known (the summary of a CSV)
    out += fmt::format("  Config QPS:                       {:.4f} reqs/s\n", s.config_qps);
  }
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
  if (s.drained > 0) {
    out += fmt::format("  Finished after the end (drained): {} (in the TTFT figures)\n", s.drained);
  }
  if (s.unfinished > 0) {
    out += fmt::format(
        "  Unfinished, given up (censored):  {} ({} without a first token; waited up to {:.2f} s; "
        "in no figure)\n",
        s.unfinished, s.unfinished_without_first_token, s.unfinished_longest_wait);
  }
  if (s.held_back > 0) {
    out += fmt::format("  Sends held back (answer pending): {}\n", s.held_back);
  }
  if (s.peak_in_flight > 0) {
    out += fmt::format("  Peak concurrent streams:          {}\n", s.peak_in_flight);
  }
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
      {"drained", s.drained},
      {"unfinished", s.unfinished},
      {"unfinished_without_first_token", s.unfinished_without_first_token},
      {"unfinished_longest_wait_s", s.unfinished_longest_wait},
  };
  return j.dump(2);
}

}  // namespace kvtier::loadgen
