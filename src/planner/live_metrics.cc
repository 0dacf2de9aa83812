#include "planner/live_metrics.h"

#include <cpp-httplib/httplib.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvtier::planner {
namespace {

bool NameChar(char c, bool first) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':' ||
         (!first && std::isdigit(static_cast<unsigned char>(c)));
}

// One sample line: name[{l="v",...}] value [timestamp]. False when it is not one.
bool ParseSampleLine(std::string_view line, MetricSample* out) {
  size_t i = 0;
  while (i < line.size() && NameChar(line[i], i == 0)) ++i;
  if (i == 0) return false;
  out->name.assign(line.substr(0, i));
  out->labels.clear();
  if (i < line.size() && line[i] == '{') {
    ++i;
    for (;;) {
      while (i < line.size() && (line[i] == ' ' || line[i] == ',')) ++i;
      if (i < line.size() && line[i] == '}') {
        ++i;
        break;
      }
      const size_t start = i;
      while (i < line.size() && NameChar(line[i], i == start)) ++i;
      if (i == start || i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') return false;
      std::string key(line.substr(start, i - start));
      i += 2;
      std::string value;
      while (i < line.size() && line[i] != '"') {
        if (line[i] == '\\' && i + 1 < line.size()) {
          ++i;
          value += line[i] == 'n' ? '\n' : line[i];
        } else {
          value += line[i];
        }
        ++i;
      }
      if (i >= line.size()) return false;
      ++i;  // closing quote
      out->labels.emplace(std::move(key), std::move(value));
    }
  }
  if (i >= line.size() || (line[i] != ' ' && line[i] != '\t')) return false;
  while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
  size_t end = line.find_first_of(" \t", i);
  std::string value(line.substr(i, end == std::string_view::npos ? std::string_view::npos : end - i));
  if (value == "+Inf") {
    out->value = std::numeric_limits<double>::infinity();
    return true;
  }
  if (value == "-Inf") {
    out->value = -std::numeric_limits<double>::infinity();
    return true;
  }
  if (value == "NaN") {
    out->value = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  char* stop = nullptr;
  out->value = std::strtod(value.c_str(), &stop);
  return !value.empty() && stop == value.c_str() + value.size();
}

double Le(const MetricSample& s) {
  auto it = s.labels.find("le");
  if (it == s.labels.end()) return std::numeric_limits<double>::quiet_NaN();
  if (it->second == "+Inf") return std::numeric_limits<double>::infinity();
  return std::strtod(it->second.c_str(), nullptr);
}

}  // namespace

Result<MetricScrape> MetricScrape::Parse(std::string_view text) {
  MetricScrape m;
  size_t lines = 0, bad = 0;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
    if (line.empty() || line.front() == '#') continue;
    ++lines;
    MetricSample s;
    if (ParseSampleLine(line, &s)) {
      m.samples_.push_back(std::move(s));
    } else {
      ++bad;
    }
  }
  if (m.samples_.empty() || bad * 2 > lines) {
    return Status::InvalidArgument(fmt::format(
        "the answer is not Prometheus text ({} of {} lines are not samples)", bad, lines));
  }
  return m;
}

double MetricScrape::Sum(std::string_view name,
                         const std::map<std::string, std::string>& labels) const {
  double total = 0;
  for (const MetricSample& s : samples_) {
    if (s.name != name || !std::isfinite(s.value)) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = s.labels.find(k);
      if (it == s.labels.end() || it->second != v) match = false;
    }
    if (match) total += s.value;
  }
  return total;
}

bool MetricScrape::Has(std::string_view name) const {
  return std::any_of(samples_.begin(), samples_.end(),
                     [&](const MetricSample& s) { return s.name == name; });
}

Result<std::string> HttpGet(const std::string& url, double timeout_s) {
  std::string_view u = url;
  if (u.starts_with("https://")) {
    return Status::InvalidArgument(fmt::format(
        "'{}': https is not supported; scrape the server's plain http port (or through a local "
        "tunnel)", url));
  }
  if (!u.starts_with("http://")) {
    if (u.find("://") != std::string_view::npos) {
      return Status::InvalidArgument(fmt::format("'{}': only http:// URLs are read", url));
    }
  } else {
    u.remove_prefix(7);
  }
  const size_t slash = u.find('/');
  std::string host(u.substr(0, slash));
  std::string path = slash == std::string_view::npos ? "/metrics" : std::string(u.substr(slash));
  if (host.empty()) return Status::InvalidArgument(fmt::format("'{}': no host", url));
  httplib::Client client("http://" + host);
  const auto secs = static_cast<time_t>(timeout_s);
  const auto usecs = static_cast<time_t>((timeout_s - static_cast<double>(secs)) * 1e6);
  client.set_connection_timeout(secs, usecs);
  client.set_read_timeout(secs, usecs);
  auto res = client.Get(path);
  if (!res) {
    return Status::Unavailable(fmt::format("'{}' did not answer: {}", url,
                                           httplib::to_string(res.error())));
  }
  if (res->status != 200) {
    return Status::Unavailable(fmt::format("'{}' answered HTTP {}", url, res->status));
  }
  return res->body;
}

double VllmState::PromptQuantile(double q) const {
  if (prompt_buckets.empty() || prompt_hist_count <= 0) return 0;
  const double want = q * prompt_buckets.back().second;
  double prev_le = 0, prev_n = 0;
  for (const auto& [le, n] : prompt_buckets) {
    if (n >= want) {
      if (!std::isfinite(le)) return prev_le;  // past the last finite bound: that bound
      const double in = n - prev_n;
      return in > 0 ? prev_le + (le - prev_le) * (want - prev_n) / in : le;
    }
    prev_le = le;
    prev_n = n;
  }
  return prev_le;
}

Result<VllmState> ReadVllmState(const MetricScrape& m) {
  bool any = false;
  for (const MetricSample& s : m.samples()) {
    if (s.name.starts_with("vllm:")) any = true;
  }
  if (!any) {
    return Status::InvalidArgument(
        "no vllm: series: this is not a vLLM metrics endpoint (vLLM serves them at /metrics of "
        "its API port)");
  }
  VllmState v;
  v.prompt_tokens = m.Sum("vllm:prompt_tokens_total");
  v.requests = m.Sum("vllm:request_success_total");
  v.prefix_queries = m.Sum("vllm:prefix_cache_queries_total");
  v.prefix_hits = m.Sum("vllm:prefix_cache_hits_total");
  v.has_external = m.Has("vllm:external_prefix_cache_queries_total");
  v.external_queries = m.Sum("vllm:external_prefix_cache_queries_total");
  v.external_hits = m.Sum("vllm:external_prefix_cache_hits_total");
  v.preemptions = m.Sum("vllm:num_preemptions_total");
  v.prompt_hist_sum = m.Sum("vllm:request_prompt_tokens_sum");
  v.prompt_hist_count = m.Sum("vllm:request_prompt_tokens_count");
  // vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; either is read.
  v.kv_cache_usage = m.Has("vllm:kv_cache_usage_perc") ? m.Sum("vllm:kv_cache_usage_perc")
                                                       : m.Sum("vllm:gpu_cache_usage_perc");
  v.running = m.Sum("vllm:num_requests_running");
  v.waiting = m.Sum("vllm:num_requests_waiting");
  std::map<double, double> buckets;  // summed over engines and models
  for (const MetricSample& s : m.samples()) {
    if (s.name == "vllm:request_prompt_tokens_bucket") buckets[Le(s)] += s.value;
  }
  v.prompt_buckets.assign(buckets.begin(), buckets.end());
  return v;
}

VllmState Difference(const VllmState& now, const VllmState& before, double seconds) {
  VllmState d = now;
  auto sub = [](double a, double b) { return std::max(0.0, a - b); };
  d.prompt_tokens = sub(now.prompt_tokens, before.prompt_tokens);
  d.requests = sub(now.requests, before.requests);
  d.prefix_queries = sub(now.prefix_queries, before.prefix_queries);
  d.prefix_hits = sub(now.prefix_hits, before.prefix_hits);
  d.external_queries = sub(now.external_queries, before.external_queries);
  d.external_hits = sub(now.external_hits, before.external_hits);
  d.preemptions = sub(now.preemptions, before.preemptions);
  d.prompt_hist_sum = sub(now.prompt_hist_sum, before.prompt_hist_sum);
  d.prompt_hist_count = sub(now.prompt_hist_count, before.prompt_hist_count);
  for (size_t i = 0; i < d.prompt_buckets.size() && i < before.prompt_buckets.size(); ++i) {
    if (before.prompt_buckets[i].first == d.prompt_buckets[i].first) {
      d.prompt_buckets[i].second = sub(d.prompt_buckets[i].second, before.prompt_buckets[i].second);
    }
  }
  d.window_s = seconds;
  return d;
}

Result<KvtierState> ReadKvtierState(const MetricScrape& m) {
  if (!m.Has("kvtier_bytes_read_total") && !m.Has("kvtier_lookups_total")) {
    return Status::InvalidArgument(
        "no kvtier_bytes_read_total: this is not kvtier serve's metrics endpoint");
  }
  KvtierState k;
  k.memory_bytes_read = m.Sum("kvtier_bytes_read_total", {{"tier", "memory"}});
  k.file_bytes_read = m.Sum("kvtier_bytes_read_total", {{"tier", "file"}});
  k.memory_bytes_written = m.Sum("kvtier_bytes_written_total", {{"tier", "memory"}});
  k.file_bytes_written = m.Sum("kvtier_bytes_written_total", {{"tier", "file"}});
  return k;
}

KvtierState Difference(const KvtierState& now, const KvtierState& before) {
  auto sub = [](double a, double b) { return std::max(0.0, a - b); };
  return {sub(now.memory_bytes_read, before.memory_bytes_read),
          sub(now.file_bytes_read, before.file_bytes_read),
          sub(now.memory_bytes_written, before.memory_bytes_written),
          sub(now.file_bytes_written, before.file_bytes_written)};
}

HitShares ComputeHitShares(const VllmState& v, const std::optional<KvtierState>& k,
                           uint64_t kv_bytes_per_token) {
  HitShares h;
  // Prompt tokens as vLLM counted them; prefix queries count a preempted request again, so the
  // larger of the two is the denominator.
  const double total = std::max(v.prompt_tokens, v.prefix_queries);
  if (total <= 0) {
    h.recompute = 0;
    return h;
  }
  h.gpu = v.prefix_hits / total;
  const double external = v.external_hits / total;
  if (k && kv_bytes_per_token > 0) {
    const double bpt = static_cast<double>(kv_bytes_per_token);
    const double file = k->file_bytes_read / bpt;
    const double memory = std::max(0.0, k->memory_bytes_read / bpt - file);
    h.file = file / total;
    h.memory = memory / total;
    h.external_other = std::max(0.0, external - h.file - h.memory);
  } else {
    h.external_other = external;
  }
  h.recompute = std::max(0.0, 1 - h.gpu - h.memory - h.file - h.external_other);
  return h;
}

MeasuredRegime ClassifyMeasuredRegime(const VllmState& v, std::optional<uint64_t> payoff_tokens) {
  MeasuredRegime r;
  const double queried = std::max(v.prompt_tokens, v.prefix_queries);
  const double external = queried > 0 ? v.external_hits / queried : 0;
  std::vector<std::string> evidence;
  if (external >= 0.01) {
    evidence.push_back(fmt::format("the connector served {:.1f} % of the prompt tokens (what the "
                                   "GPU's prefix cache had evicted)",
                                   100 * external));
  }
  if (v.preemptions > 0) evidence.push_back(fmt::format("{:.0f} preemptions", v.preemptions));
  if (v.kv_cache_usage >= 0.95) {
    evidence.push_back(fmt::format("the KV cache is {:.0f} % full", 100 * v.kv_cache_usage));
  }
  if (evidence.empty()) {
    r.regime = 1;
    r.why = v.has_external
                ? fmt::format("the GPU keeps what is reused: the connector served {:.2f} % of the "
                              "prompt tokens, no preemption, the KV cache {:.0f} % full",
                              100 * external, 100 * v.kv_cache_usage)
                : fmt::format("no sign of eviction (no KV connector reports external hits; no "
                              "preemption; the KV cache {:.0f} % full)",
                              100 * v.kv_cache_usage);
    return r;
  }
  std::string joined;
  for (const auto& e : evidence) joined += (joined.empty() ? "" : "; ") + e;
  const double mean = v.MeanPrompt();
  if (payoff_tokens && mean >= static_cast<double>(*payoff_tokens)) {
    r.regime = 3;
    r.why = fmt::format("the GPU evicts ({}), and the mean prompt ({:.0f} tokens) is past the "
                        "slowest tier's payoff ({} tokens): reading it back wins",
                        joined, mean, *payoff_tokens);
  } else {
    r.regime = 2;
    r.why = fmt::format("the GPU evicts ({}), but the mean prompt ({:.0f} tokens) is below the "
                        "slowest tier's payoff{}: recomputing is cheaper than reading from it",
                        joined, mean,
                        payoff_tokens ? fmt::format(" ({} tokens)", *payoff_tokens)
                                      : std::string(" (reading never wins)"));
  }
  return r;
}

}  // namespace kvtier::planner
