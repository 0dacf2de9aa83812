// `kvtier plan`: thresholds, predicted TTFT with and without offload, the regime and a plot.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>

#include "planner/live_metrics.h"
#include "planner/options.h"
#include "planner/plan.h"
#include "planner/request_log.h"
#include "planner/traffic.h"
#include "planner/units.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

// The inputs of --from-log and --from-metrics (the rest are the planner's own flags).
struct TrafficFlags {
  std::vector<std::string> logs;
  std::string log_format = "auto";
  std::string log_fields;
  std::string session_timeout = "30m";
  std::string max_model_len;
  std::string context_plot;
  std::string metrics_url;
  std::string kvtier_metrics_url;
  std::string watch;
  std::string scrape_timeout = "10s";
  std::string more_users = "2";
  std::string larger_tier = "2";
};

int Fail(const Status& s) {
  fmt::print(stderr, "kvtier plan: {}\n", s.message());
  return 1;
}

Status RunGnuplot(const std::string& script, const std::string& path) {
  FILE* p = ::popen("gnuplot 2>&1", "w");
  if (p == nullptr) return Status::Unavailable("cannot run gnuplot (is it installed?)");
  std::fwrite(script.data(), 1, script.size(), p);
  const int rc = ::pclose(p);
  if (rc != 0) {
    return Status::Unavailable(fmt::format(
        "gnuplot failed drawing '{}' (exit {}; is gnuplot installed?)", path, rc));
  }
  return Status::Ok();
}

// The planner's flags with the derived workload filled in, except where the command line or
// --config gave a value (one that differs from the default): what the user says wins over what
// the logs suggest.
planner::PlannerFlags WithDerived(const CLI::App& cmd, planner::PlannerFlags f,
                                  const planner::DerivedWorkload& w,
                                  const std::vector<uint64_t>& contexts) {
  const planner::PlannerFlags defaults;
  auto unset = [&](const char* flag, std::string planner::PlannerFlags::*member) {
    return cmd.count(flag) == 0 && f.*member == defaults.*member;
  };
  using F = planner::PlannerFlags;
  if (unset("--users", &F::users)) f.users = std::to_string(w.users);
  if (unset("--rounds", &F::rounds)) f.rounds = std::to_string(w.rounds);
  if (unset("--question-tokens", &F::question_tokens)) {
    f.question_tokens = std::to_string(w.question_tokens);
  }
  if (unset("--answer-tokens", &F::answer_tokens)) f.answer_tokens = std::to_string(w.answer_tokens);
  if (unset("--system-prompt", &F::system_prompt)) {
    f.system_prompt = std::to_string(w.system_prompt_tokens);
  }
  if (unset("--qps", &F::qps) && unset("--load", &F::load) && w.qps > 0) {
    f.qps = fmt::format("{:.6g}", w.qps);
  }
  std::string list;
  for (uint64_t c : contexts) list += (list.empty() ? "" : ",") + std::to_string(c);
  f.context = list;
  return f;
}

int RunFromLog(const CLI::App& cmd, planner::PlannerFlags flags, const TrafficFlags& t,
               bool fast) {
  using namespace planner;
  auto format = ParseLogFormat(t.log_format);
  if (!format.ok()) return Fail(format.status());
  auto mapping = ParseFieldMapping(t.log_fields);
  if (!mapping.ok()) return Fail(mapping.status());
  auto timeout = ParseDuration(t.session_timeout);
  if (!timeout.ok()) return Fail(timeout.status().WithContext("--session-timeout"));
  if (!(*timeout > 0)) return Fail(Status::InvalidArgument("--session-timeout must be > 0"));
  TrafficOptions options;
  options.session_timeout_s = *timeout;
  if (!t.max_model_len.empty()) {
    auto window = ParseTokens(t.max_model_len);
    if (!window.ok()) return Fail(window.status().WithContext("--max-model-len"));
    options.context_window = *window;
  } else {
    auto model = LoadModel(flags.model, 1, flags.dtype, flags.weight_dtype);
    if (!model.ok()) return Fail(model.status());
    options.context_window = model->max_context;
  }
  // Refuse a bad plan input before a long read, not after it.
  if (auto check = BuildPlanInputs(cmd, flags, true); !check.ok()) return Fail(check.status());

  const bool tty = ::isatty(STDERR_FILENO) != 0;
  auto progress = [&](const LogReadProgress& p) {
    static auto last_line = std::chrono::steady_clock::time_point{};
    const auto now = std::chrono::steady_clock::now();
    const std::string pct =
        p.file_bytes > 0 ? fmt::format(" ({:.0f} %)", 100.0 * static_cast<double>(p.bytes_read) /
                                                          static_cast<double>(p.file_bytes))
                         : "";
    if (tty) {
      fmt::print(stderr, "\rreading {}: {} lines, {}{}   ", p.file, p.lines,
                 FormatBytes(static_cast<double>(p.bytes_read)), pct);
    } else if (now - last_line >= std::chrono::seconds(10)) {
      last_line = now;
      fmt::print(stderr, "reading {}: {} lines, {}{}\n", p.file, p.lines,
                 FormatBytes(static_cast<double>(p.bytes_read)), pct);
    }
  };
  TrafficAccumulator acc(options);
  uint64_t lines = 0, records = 0, malformed = 0, ignored = 0, without_tokens = 0;
  std::vector<std::string> examples, notes;
  const auto start = std::chrono::steady_clock::now();
  for (const std::string& path : t.logs) {
    auto counts = ReadRequestLog(path, *format, *mapping,
                                 [&](const RequestRecord& r) { acc.Add(r); }, progress);
    if (tty) fmt::print(stderr, "\n");
    if (!counts.ok()) return Fail(counts.status());
    lines += counts->lines;
    records += counts->records;
    malformed += counts->malformed;
    ignored += counts->ignored;
    without_tokens += counts->requests_without_tokens;
    for (auto& e : counts->malformed_examples) {
      if (examples.size() < 5) examples.push_back(e);
    }
    fmt::print(stderr, "{}: {}{}, {} lines, {} records, {} malformed{}\n", path,
               LogFormatName(counts->format), counts->gzip ? " (gzip)" : "", counts->lines,
               counts->records, counts->malformed,
               counts->truncated ? "; the file ends mid-line or mid-stream (cut short?)" : "");
  }
  const double read_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  TrafficSummary summary = acc.Finish();
  if (records == 0) {
    std::string why = "no request records in the log(s)";
    if (without_tokens > 0) {
      why += fmt::format(
          ": {} vLLM request lines carry no token counts (vLLM since 0.10 logs a prompt's token "
          "ids only at DEBUG: run it with VLLM_LOGGING_LEVEL=DEBUG and --enable-log-requests, "
          "see docs/planner.md)",
          without_tokens);
    } else if (malformed > 0) {
      why += fmt::format(": all {} candidate lines were malformed (first: {})", malformed,
                         examples.empty() ? "" : examples.front());
    } else {
      why += " (a CSV whose header names no prompt column needs --log-format csv and "
             "--log-fields prompt=COLUMN; other formats: docs/planner.md)";
    }
    return Fail(Status::InvalidArgument(why));
  }
  // The logs cannot show a shared system prompt: 0 unless the user says how long it is.
  const planner::PlannerFlags defaults;
  uint64_t system_prompt = 0, answer_fallback = 100;
  if (cmd.count("--system-prompt") > 0 || flags.system_prompt != defaults.system_prompt) {
    auto v = ParseTokens(flags.system_prompt);
    if (!v.ok()) return Fail(v.status().WithContext("--system-prompt"));
    system_prompt = *v;
  }
  if (auto v = ParseTokens(flags.answer_tokens); v.ok()) answer_fallback = *v;
  DerivedWorkload derived = DeriveWorkload(summary, system_prompt, answer_fallback);
  std::vector<uint64_t> contexts = {derived.context_median, derived.context_p90,
                                    derived.context_peak};
  std::vector<uint64_t> unique = contexts;
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  planner::PlannerFlags planned = WithDerived(cmd, flags, derived, unique);
  auto inputs = BuildPlanInputs(cmd, planned, fast);
  if (!inputs.ok()) return Fail(inputs.status().WithContext("the derived workload"));
  auto plan_progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
  auto report = RunPlan(*inputs, plan_progress);
  if (!report.ok()) return Fail(report.status());

  const std::string payoff_tier =
      report->tier_names.empty() ? std::string() : report->tier_names.back();
  const std::optional<uint64_t> payoff =
      report->payoff_tokens.empty() ? std::nullopt : report->payoff_tokens.back();
  auto regime_of = [&](uint64_t context) {
    for (const auto& p : report->points) {
      if (p.context_tokens == context) return p.regime;
    }
    return 0;
  };
  const char* labels[] = {"median", "p90", "peak"};
  if (flags.json) {
    nlohmann::json j;
    j["read"] = {{"files", t.logs},     {"lines", lines},       {"records", records},
                 {"ignored", ignored},  {"malformed", malformed}, {"malformed_examples", examples},
                 {"requests_without_tokens", without_tokens}, {"seconds", read_s}};
    j["traffic"] = TrafficToJson(summary, derived);
    nlohmann::json points = nlohmann::json::array();
    for (int i = 0; i < 3; ++i) {
      points.push_back({{"at", labels[i]}, {"context_tokens", contexts[i]},
                        {"regime", regime_of(contexts[i])}});
    }
    j["points"] = points;
    j["plan"] = ReportToJson(*report);
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("Traffic: {} records from {} file(s) ({} lines; {} malformed, skipped; read in "
               "{:.1f} s)\n",
               records, t.logs.size(), lines, malformed, read_s);
    for (const auto& e : examples) fmt::print("  malformed: {}\n", e);
    fmt::print("{}", FormatTraffic(summary));
    fmt::print("\nDerived workload (flags given on the command line are kept):\n");
    fmt::print("  --users {} --rounds {} --question-tokens {} --answer-tokens {} --system-prompt "
               "{}{}\n",
               inputs->workload.users, inputs->workload.rounds, inputs->workload.question_tokens,
               inputs->workload.answer_tokens, inputs->workload.system_prompt_tokens,
               inputs->qps > 0 ? fmt::format(" --qps {:.4g} (the busiest window's)", inputs->qps)
                               : std::string());
    for (const auto& n : derived.notes) fmt::print("  note: {}\n", n);
    fmt::print("  plan points (first-round context whose conversation peaks at the {}):\n",
               summary.conversations > 0 ? "median, p90 and largest peak"
                                         : "median, p90 and largest prompt");
    for (int i = 0; i < 3; ++i) {
      fmt::print("    {:<6} context {:>8} tokens: regime {}\n", labels[i], contexts[i],
                 regime_of(contexts[i]));
    }
    fmt::print("\n{}", FormatReport(*report));
    fmt::print("\n{}", ContextPlot(summary, report->eviction_onset_peak_tokens, payoff,
                                    payoff_tier));
  }
  if (!t.context_plot.empty()) {
    if (!t.context_plot.ends_with(".svg") && !t.context_plot.ends_with(".png")) {
      return Fail(Status::InvalidArgument("--context-plot: the file must end in .svg or .png"));
    }
    Status s = RunGnuplot(ContextPlotScript(summary, report->eviction_onset_peak_tokens, payoff,
                                            payoff_tier, t.context_plot),
                          t.context_plot);
    if (!s.ok()) return Fail(s);
    fmt::print(stderr, "context plot written to {}\n", t.context_plot);
  }
  if (!flags.plot.empty()) {
    if (Status s = WritePlot(*report, flags.plot); !s.ok()) return Fail(s);
    fmt::print(stderr, "plot written to {}\n", flags.plot);
  }
  return 0;
}

int RunFromMetrics(const CLI::App& cmd, planner::PlannerFlags flags, const TrafficFlags& t,
                   bool fast) {
  using namespace planner;
  auto timeout = ParseDuration(t.scrape_timeout);
  if (!timeout.ok() || !(*timeout > 0)) {
    return Fail(Status::InvalidArgument("--scrape-timeout must be a duration > 0"));
  }
  double watch_s = 0;
  if (!t.watch.empty()) {
    auto w = ParseDuration(t.watch);
    if (!w.ok()) return Fail(w.status().WithContext("--watch"));
    if (!(*w >= 1)) return Fail(Status::InvalidArgument("--watch must be at least 1 s"));
    watch_s = *w;
  }
  auto more_users = ParseNumber(t.more_users, "--more-users");
  auto larger_tier = ParseNumber(t.larger_tier, "--larger-tier");
  if (!more_users.ok() || !(*more_users > 0)) {
    return Fail(Status::InvalidArgument("--more-users must be a factor > 0"));
  }
  if (!larger_tier.ok() || !(*larger_tier > 0)) {
    return Fail(Status::InvalidArgument("--larger-tier must be a factor > 0"));
  }
  if (auto check = BuildPlanInputs(cmd, flags, true); !check.ok()) return Fail(check.status());
  auto scrape = [&]() -> Result<std::pair<VllmState, std::optional<KvtierState>>> {
    KVTIER_ASSIGN_OR_RETURN(std::string text, HttpGet(t.metrics_url, *timeout));
    auto parsed = MetricScrape::Parse(text);
    if (!parsed.ok()) return parsed.status().WithContext(t.metrics_url);
    auto v = ReadVllmState(*parsed);
    if (!v.ok()) return v.status().WithContext(t.metrics_url);
    std::optional<KvtierState> k;
    if (!t.kvtier_metrics_url.empty()) {
      KVTIER_ASSIGN_OR_RETURN(std::string ktext, HttpGet(t.kvtier_metrics_url, *timeout));
      auto kp = MetricScrape::Parse(ktext);
      if (!kp.ok()) return kp.status().WithContext(t.kvtier_metrics_url);
      auto ks = ReadKvtierState(*kp);
      if (!ks.ok()) return ks.status().WithContext(t.kvtier_metrics_url);
      k = *ks;
    }
    return std::make_pair(*v, k);
  };
  auto first = scrape();
  if (!first.ok()) return Fail(first.status());
  VllmState v = first->first;
  std::optional<KvtierState> k = first->second;
  if (watch_s > 0) {
    const auto start = std::chrono::steady_clock::now();
    const auto end = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(watch_s));
    while (std::chrono::steady_clock::now() < end) {
      const auto left = end - std::chrono::steady_clock::now();
      std::this_thread::sleep_for(
          std::min<std::chrono::steady_clock::duration>(left, std::chrono::seconds(10)));
      const double done =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      fmt::print(stderr, "watching {}: {:.0f} of {:.0f} s\n", t.metrics_url, done, watch_s);
    }
    auto second = scrape();
    if (!second.ok()) return Fail(second.status());
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    v = Difference(second->first, first->first, secs);
    if (k && second->second) k = Difference(*second->second, *k);
  }

  // The planner at the scraped prompt length: the mean prompt of a conversation of `rounds`
  // rounds is system + context + question + (rounds - 1) / 2 x (question + answer).
  auto base = BuildPlanInputs(cmd, flags, true);
  if (!base.ok()) return Fail(base.status());
  const Workload& w0 = base->workload;
  const double mean_prompt = v.MeanPrompt();
  if (cmd.count("--context") == 0 && mean_prompt > 0) {
    const double fixed = static_cast<double>(w0.system_prompt_tokens + w0.question_tokens) +
                         (w0.rounds - 1) / 2.0 * static_cast<double>(w0.question_tokens +
                                                                     w0.answer_tokens);
    flags.context = std::to_string(static_cast<uint64_t>(std::max(1.0, mean_prompt - fixed)));
  }
  if (cmd.count("--qps") == 0 && cmd.count("--load") == 0 && v.window_s > 0 && v.requests > 0) {
    const double rate = v.requests / v.window_s;
    flags.qps = fmt::format("{:.6g}", w0.rounds > 1 ? rate * (w0.rounds - 1) / w0.rounds : rate);
  }
  auto plan_for = [&](double users_factor, double tier_factor) -> Result<PlanReport> {
    KVTIER_ASSIGN_OR_RETURN(PlanInputs in, BuildPlanInputs(cmd, flags, fast));
    in.workload.users = static_cast<uint32_t>(
        std::max(1.0, std::round(in.workload.users * users_factor)));
    if (!in.tiers.empty()) in.tiers.front().capacity_bytes *= tier_factor;
    in.sensitivity = false;
    return RunPlan(in, [](const std::string& line) { fmt::print(stderr, "{}\n", line); });
  };
  auto now = plan_for(1, 1);
  if (!now.ok()) return Fail(now.status());
  auto more = plan_for(*more_users, 1);
  if (!more.ok()) return Fail(more.status());
  auto larger = plan_for(1, *larger_tier);
  if (!larger.ok()) return Fail(larger.status());
  const std::optional<uint64_t> payoff =
      now->payoff_tokens.empty() ? std::nullopt : now->payoff_tokens.back();
  const MeasuredRegime measured = ClassifyMeasuredRegime(v, payoff);
  const HitShares shares = ComputeHitShares(v, k, base->model.kv_bytes_per_token());

  auto point_json = [](const PlanReport& r) {
    const PointReport& p = r.points.front();
    return nlohmann::json{{"users", r.workload.users},
                          {"context_tokens", p.context_tokens},
                          {"regime", p.regime},
                          {"mean_ttft_s_no_offload", p.baseline.mean_ttft_s},
                          {"mean_ttft_s_offload", p.offload.mean_ttft_s},
                          {"token_share_offload", p.offload.token_share}};
  };
  if (flags.json) {
    nlohmann::json j;
    j["window_s"] = v.window_s;
    j["vllm"] = {{"prompt_tokens", v.prompt_tokens},
                 {"requests", v.requests},
                 {"mean_prompt_tokens", mean_prompt},
                 {"prompt_p90_tokens", v.PromptQuantile(0.9)},
                 {"prefix_cache_queries", v.prefix_queries},
                 {"prefix_cache_hits", v.prefix_hits},
                 {"external_connector", v.has_external},
                 {"external_queries", v.external_queries},
                 {"external_hits", v.external_hits},
                 {"preemptions", v.preemptions},
                 {"kv_cache_usage", v.kv_cache_usage},
                 {"running", v.running},
                 {"waiting", v.waiting}};
    if (k) {
      j["kvtier"] = {{"memory_bytes_read", k->memory_bytes_read},
                     {"file_bytes_read", k->file_bytes_read},
                     {"memory_bytes_written", k->memory_bytes_written},
                     {"file_bytes_written", k->file_bytes_written}};
    }
    j["hit_shares"] = {{"gpu", shares.gpu},       {"memory", shares.memory},
                       {"file", shares.file},     {"external_other", shares.external_other},
                       {"recompute", shares.recompute}};
    j["measured_regime"] = measured.regime;
    j["measured_regime_why"] = measured.why;
    j["predicted"] = {{"now", point_json(*now)},
                      {"more_users", point_json(*more)},
                      {"larger_tier", point_json(*larger)},
                      {"more_users_factor", *more_users},
                      {"larger_tier_factor", *larger_tier}};
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("vLLM at {} ({}):\n", t.metrics_url,
             v.window_s > 0 ? fmt::format("over {:.0f} s", v.window_s)
                            : std::string("totals since it started; --watch for a window"));
  fmt::print("  requests {:.0f}, prompt tokens {:.0f} (mean prompt {:.0f}, p90 about {:.0f})\n",
             v.requests, v.prompt_tokens, mean_prompt, v.PromptQuantile(0.9));
  fmt::print("  prefix cache: {:.0f} of {:.0f} queried tokens hit ({:.1f} %)\n", v.prefix_hits,
             v.prefix_queries, v.prefix_queries > 0 ? 100 * v.prefix_hits / v.prefix_queries : 0);
  if (v.has_external) {
    fmt::print("  KV connector: {:.0f} of {:.0f} queried tokens hit\n", v.external_hits,
               v.external_queries);
  } else {
    fmt::print("  KV connector: none reports (no vllm:external_prefix_cache_* series)\n");
  }
  fmt::print("  KV cache {:.0f} % full; {:.0f} running, {:.0f} waiting; {:.0f} preemptions\n",
             100 * v.kv_cache_usage, v.running, v.waiting, v.preemptions);
  fmt::print("Prompt tokens by source: GPU {:.1f} %, kvtier memory {:.1f} %, kvtier file {:.1f} %"
             "{}, recomputed {:.1f} %\n",
             100 * shares.gpu, 100 * shares.memory, 100 * shares.file,
             shares.external_other > 0
                 ? fmt::format(", other external {:.1f} %", 100 * shares.external_other)
                 : std::string(),
             100 * shares.recompute);
  if (!k && v.has_external) {
    fmt::print("  (give --kvtier-metrics URL to split the connector's hits by tier)\n");
  }
  fmt::print("Regime now (measured): {}: {}\n", measured.regime, measured.why);
  auto line = [&](const char* what, const PlanReport& r) {
    const PointReport& p = r.points.front();
    fmt::print("  {:<28} users {:>4}  context {:>7}  regime {}  mean TTFT {} without offload, {} "
               "with\n",
               what, r.workload.users, p.context_tokens, p.regime,
               FormatSeconds(p.baseline.mean_ttft_s), FormatSeconds(p.offload.mean_ttft_s));
  };
  fmt::print("The planner ({}; --users {} from the flags, context from the mean prompt):\n",
             fast ? "closed forms" : "simulated", base->workload.users);
  line("as now", *now);
  line(fmt::format("{:g}x the users", *more_users).c_str(), *more);
  line(fmt::format("{:g}x the first tier", *larger_tier).c_str(), *larger);
  if (now->points.front().regime != measured.regime) {
    fmt::print("  note: the planner's regime differs from the measured one: check --users, "
               "--gpu-kv-gb and the tiers against the server\n");
  }
  return 0;
}

int RunPlanCommand(const CLI::App& cmd, planner::PlannerFlags& flags, bool fast,
                   const TrafficFlags& traffic) {
  auto fail = [](const Status& s) { return Fail(s); };
  if (Status s = planner::MergeConfigFile(cmd, &flags); !s.ok()) return fail(s);
  if (!traffic.logs.empty() && !traffic.metrics_url.empty()) {
    return fail(Status::InvalidArgument("give --from-log or --from-metrics, not both"));
  }
  if (!traffic.logs.empty()) return RunFromLog(cmd, flags, traffic, fast);
  if (!traffic.metrics_url.empty()) return RunFromMetrics(cmd, flags, traffic, fast);
  auto inputs = planner::BuildPlanInputs(cmd, flags, fast);
  if (!inputs.ok()) return fail(inputs.status());
  if (!flags.plot.empty() && !flags.plot.ends_with(".svg") && !flags.plot.ends_with(".png")) {
    return fail(Status::InvalidArgument(
        fmt::format("--plot '{}': the file must end in .svg or .png", flags.plot)));
  }
  auto progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
  auto report = planner::RunPlan(*inputs, progress);
  if (!report.ok()) return fail(report.status());
  if (!fast) {
    fmt::print(stderr, "simulated {} context length(s) in {:.2f} s of host time (main runs)\n",
               report->points.size(), report->total_sim_wall_s);
  }
  if (flags.json) {
    fmt::print("{}\n", planner::ReportToJson(*report).dump(2));
  } else {
    fmt::print("{}", planner::FormatReport(*report));
  }
  if (!flags.plot.empty()) {
    if (Status s = planner::WritePlot(*report, flags.plot); !s.ok()) return fail(s);
    fmt::print(stderr, "plot written to {}\n", flags.plot);
  }
  return 0;
}

void AddPlan(CLI::App& parent, CommandContext& ctx) {
  auto* cmd = parent.add_subcommand(
      "plan",
      "Predict whether KV offload pays for a model, GPU, workload and tiers: KV size, the "
      "eviction-onset and payoff thresholds, TTFT with and without offload, the regime, a plot");
  cmd->footer(
      "Units: sizes need one (8GiB = 8 x 2^30 bytes, 19GB = 19 x 10^9; 8 or 8G alone is refused "
      "as ambiguous); bandwidths are per second (3.55GB/s, 20GiB/s, "
      "25Gbit/s); durations take s/m/h (bare = seconds); token counts take k = x1024.\n"
      "By default each context length is simulated twice (no offload, offload) with the "
      "discrete-event model of `kvtier simulate`; --fast uses the closed forms only.\n"
      "Regimes: 1 = the working set fits in GPU memory; 2 = the GPU evicts but recomputing is "
      "cheaper than reading from the slowest tier; 3 = reading from it wins.");
  auto flags = std::make_shared<planner::PlannerFlags>();
  auto fast = std::make_shared<bool>(false);
  auto traffic = std::make_shared<TrafficFlags>();
  planner::AddPlannerFlags(cmd, flags.get());
  auto* g = "Your own traffic (docs/planner.md)";
  cmd->add_option("--from-log", traffic->logs,
                  "Derive the workload from request logs (JSON lines of OpenAI responses or usage "
                  "objects, vLLM's request log, bench qa's or LMCache's CSV; gzip read as is), "
                  "then plan for its median, p90 and peak conversation")
      ->type_name("FILE...")->group(g);
  cmd->add_option("--log-format", traffic->log_format, "auto, jsonl, vllm or csv")
      ->capture_default_str()->type_name("FORMAT")->group(g);
  cmd->add_option("--log-fields", traffic->log_fields,
                  "Where each field is, for other logs: prompt=,completion=,user=,time=,round= "
                  "with a CSV column or a dotted JSON path (e.g. "
                  "prompt=usage.prompt_tokens,user=metadata.user_id,time=startTime)")
      ->type_name("FIELD=NAME,...")->group(g);
  cmd->add_option("--session-timeout", traffic->session_timeout,
                  "A conversation idle this long is over (its id may start another)")
      ->capture_default_str()->type_name("TIME")->group(g);
  cmd->add_option("--max-model-len", traffic->max_model_len,
                  "Context window to check conversations against (default: the model's)")
      ->type_name("TOKENS")->group(g);
  cmd->add_option("--context-plot", traffic->context_plot,
                  "Also draw the context distribution against the thresholds (gnuplot)")
      ->type_name("FILE.svg|png")->group(g);
  cmd->add_option("--from-metrics", traffic->metrics_url,
                  "Read a running vLLM's Prometheus endpoint (http://HOST:PORT[/metrics]): "
                  "which regime it is in, hit shares by tier, what more users or a larger tier "
                  "would do")
      ->type_name("URL")->group(g);
  cmd->add_option("--kvtier-metrics", traffic->kvtier_metrics_url,
                  "With --from-metrics: kvtier serve's /metrics, to split hits by tier")
      ->type_name("URL")->group(g);
  cmd->add_option("--watch", traffic->watch,
                  "With --from-metrics: scrape twice, this long apart, and use the difference "
                  "(default: one scrape, totals since the server started)")
      ->type_name("TIME")->group(g);
  cmd->add_option("--scrape-timeout", traffic->scrape_timeout, "Per HTTP request")
      ->capture_default_str()->type_name("TIME")->group(g);
  cmd->add_option("--more-users", traffic->more_users,
                  "With --from-metrics: the factor of users to predict for")
      ->capture_default_str()->type_name("FACTOR")->group(g);
  cmd->add_option("--larger-tier", traffic->larger_tier,
                  "With --from-metrics: the factor of the first tier's capacity to predict for")
      ->capture_default_str()->type_name("FACTOR")->group(g);
  cmd->add_flag("--fast", *fast,
                "Closed forms only: instant, but ignores queueing and the order of eviction");
  cmd->callback([cmd, flags, fast, traffic, &ctx] {
    ctx.exit_code = RunPlanCommand(*cmd, *flags, *fast, *traffic);
  });
}

const bool kRegistered = RegisterCommand("", &AddPlan);

}  // namespace
}  // namespace kvtier::tools
