#include "loadgen/qa_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "loadgen/guards.h"
#include "loadgen/http_stream_client.h"

namespace kvtier::loadgen {
namespace {

// Unix time for steady-clock stamps: the CSV speaks Unix seconds, intervals stay monotonic.
class Timebase {
 public:
  Timebase()
      : steady0_(SteadyClock::now()),
        unix0_(std::chrono::duration<double>(
                   std::chrono::system_clock::now().time_since_epoch())
                   .count()) {}
  double Unix(SteadyClock::time_point t) const {
    return unix0_ + std::chrono::duration<double>(t - steady0_).count();
  }
  double Now() const { return Unix(SteadyClock::now()); }

 private:
  SteadyClock::time_point steady0_;
  double unix0_;
};

class Console {
 public:
  explicit Console(const QaBenchOptions& o) : o_(o) {}
  void Progress(const std::string& line) {
    if (!o_.log) return;
    if (o_.progress_in_place) {
      o_.log("\r" + line + "\x1b[K");
      dirty_ = true;
    } else {
      o_.log(line + "\n");
    }
  }
  void Log(const std::string& line) {
    if (!o_.log) return;
    EndProgress();
    o_.log(line + "\n");
  }
  void Print(const std::string& text) {
    EndProgress();
    if (o_.print) o_.print(text);
  }
  void EndProgress() {
    if (dirty_ && o_.log) o_.log("\n");
    dirty_ = false;
  }

 private:
  const QaBenchOptions& o_;
  bool dirty_ = false;
};

// What one phase (the run, or one capacity stage) collected.
struct PhaseState {
  std::vector<RequestRecord> records;
  std::vector<FailureRecord> failures;
  std::vector<double> launches;
  int64_t peak_in_flight = 0;
  std::string first_error;
  bool missing_usage = false;
};

// Logs the first failure of each kind at once, then a count at most every 10 s.
class FailureLog {
 public:
  explicit FailureLog(Console& console) : console_(console) {}
  void Report(FailureKind kind, const std::string& message, double now) {
    auto& e = entries_[kind];
    ++e.unreported;
    if (e.last_report == 0 || now - e.last_report >= 10) {
      console_.Log(fmt::format("request failed ({}): {}{}", FailureKindName(kind), message,
                               e.unreported > 1 ? fmt::format(" [{} like it since the last report]",
                                                              e.unreported)
                                                : ""));
      e.unreported = 0;
      e.last_report = now;
    }
  }

 private:
  struct Entry {
    int64_t unreported = 0;
    double last_report = 0;
  };
  Console& console_;
  std::map<FailureKind, Entry> entries_;
};

std::string BuildChatBody(const std::string& model, const std::vector<ChatMessage>& messages,
                          int max_tokens, bool ignore_eos) {
  nlohmann::json j;
  j["model"] = model;
  j["messages"] = nlohmann::json::array();
  for (const auto& m : messages) j["messages"].push_back({{"role", m.role}, {"content", m.content}});
  j["temperature"] = 0;
  j["max_tokens"] = max_tokens;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}};
  if (ignore_eos) j["ignore_eos"] = true;
  return j.dump();
}

class HttpLauncher : public Launcher {
 public:
  HttpLauncher(HttpStreamClient& client, const QaBenchOptions& o, const std::string& model,
               const Timebase& tb, PhaseState& state, FailureLog& failures)
      : client_(client), o_(o), model_(model), tb_(tb), state_(state), failures_(failures) {}

  void Launch(UserSession& session, int question_id) override {
    state_.launches.push_back(tb_.Now());
    UserSession* s = &session;
    client_.Submit(
        BuildChatBody(model_, session.history(), o_.workload.answer_len, o_.ignore_eos),
        std::to_string(session.user_id()), [this, s, question_id](ChatResult&& r) {
          if (r.ok()) {
            RequestRecord rec;
            rec.prompt_tokens = r.prompt_tokens;
            rec.generation_tokens = r.completion_tokens;
            rec.ttft = std::chrono::duration<double>(r.first_content - r.launch).count();
            rec.generation_time = std::chrono::duration<double>(r.finish - r.first_content).count();
            rec.user_id = s->user_id();
            rec.question_id = question_id;
            rec.launch_time = tb_.Unix(r.launch);
            rec.finish_time = tb_.Unix(r.finish);
            if (!r.usage_reported) state_.missing_usage = true;
            state_.records.push_back(rec);
            s->OnAnswer(r.content);
          } else {
            const double when = tb_.Unix(r.finish);
            state_.failures.push_back({when, FailureKindName(r.failure)});
            if (state_.first_error.empty()) state_.first_error = r.error;
            failures_.Report(r.failure, r.error, when);
            s->OnFailure();
          }
        });
  }

 private:
  HttpStreamClient& client_;
  const QaBenchOptions& o_;
  const std::string& model_;
  const Timebase& tb_;
  PhaseState& state_;
  FailureLog& failures_;
};

bool Stopped(const QaBenchOptions& o) { return o.stop != nullptr && o.stop->load(); }

int PollTimeoutMs(double now, double until) {
  const double ms = (until - now) * 1000.0;
  return static_cast<int>(std::clamp(std::ceil(ms), 0.0, 50.0));
}

// The best finished rate of all stages but the last (0 when there is only one).
double best_before_last(const std::vector<CapacityStage>& stages) {
  double best = 0;
  for (size_t i = 0; i + 1 < stages.size(); ++i) best = std::max(best, stages[i].finished_rps);
  return best;
}

std::string CapacityTable(const std::vector<CapacityStage>& stages) {
  std::string out = "  streams  finished/s  median TTFT  failed\n";
  for (const auto& s : stages) {
    out += fmt::format("  {:>7}  {:>10.3f}  {:>9.3f} s  {:>6}\n", s.streams, s.finished_rps,
                       s.median_ttft, s.failed);
  }
  return out;
}

}  // namespace

Status ValidateQaBenchOptions(const QaBenchOptions& o) {
  const auto& w = o.workload;
  if (w.num_users < 1 || w.num_users > 100000) {
    return Status::InvalidArgument("--num-users must be in [1, 100000]");
  }
  if (w.num_rounds < 1 || w.num_rounds > 10000) {
    return Status::InvalidArgument("--num-rounds must be in [1, 10000]");
  }
  if (!(w.qps > 0) || !std::isfinite(w.qps)) return Status::InvalidArgument("--qps must be > 0");
  if (w.system_prompt_len < 0 || w.user_history_len < 0) {
    return Status::InvalidArgument("prompt lengths must be >= 0");
  }
  if (w.answer_len < 1) return Status::InvalidArgument("--answer-len must be >= 1");
  if (o.duration_s < 0) return Status::InvalidArgument("--time must be >= 0");
  if (!(o.log_interval_s > 0)) return Status::InvalidArgument("--log-interval must be > 0");
  if (o.warmup_requests < 0) return Status::InvalidArgument("--warmup-requests must be >= 0");
  if (!(o.request_timeout_s > 0)) return Status::InvalidArgument("--request-timeout must be > 0");
  if (o.find_capacity && !(o.capacity_stage_s > 0)) {
    return Status::InvalidArgument("--capacity-stage-time must be > 0");
  }
  if (o.base_url.rfind("http://", 0) != 0 && o.base_url.rfind("https://", 0) != 0) {
    return Status::InvalidArgument(
        fmt::format("--base-url must start with http:// or https://, got \"{}\"", o.base_url));
  }
  return Status::Ok();
}

Result<ServerInfo> QueryServer(const std::string& base_url, const std::string& api_key,
                               const std::string& model, double timeout_s) {
  std::string base = base_url;
  while (!base.empty() && base.back() == '/') base.pop_back();
  const std::string url = base + "/models";
  auto response = HttpGet(url, api_key, timeout_s);
  if (!response.ok()) {
    return Status::Unavailable(fmt::format("{} (is the server running? check --base-url)",
                                           response.status().message()));
  }
  if (response->status != 200) {
    return Status::Unavailable(fmt::format("{} answered HTTP {}: {:.300}", url, response->status,
                                           response->body));
  }
  auto j = nlohmann::json::parse(response->body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array()) {
    return Status::Unavailable(fmt::format(
        "{} did not answer with an OpenAI model list: {:.300}", url, response->body));
  }
  ServerInfo info;
  for (const auto& m : j["data"]) {
    if (!m.is_object() || !m.contains("id") || !m["id"].is_string()) continue;
    const std::string id = m["id"].get<std::string>();
    const bool chosen = model.empty() ? info.models.empty() : id == model;
    info.models.push_back(id);
    if (!chosen) continue;
    for (const char* key : {"max_model_len", "context_length", "max_context_length", "context_window"}) {
      if (m.contains(key) && m[key].is_number_integer()) {
        info.max_model_len = m[key].get<int64_t>();
        break;
      }
    }
  }
  return info;
}

Result<QaBenchResult> RunQaBench(const QaBenchOptions& o) {
  KVTIER_RETURN_IF_ERROR(ValidateQaBenchOptions(o));
  Console console(o);
  QaBenchResult result;
  const WorkloadConfig& w = o.workload;

  // Guard 1: a cache directory left warm by an earlier run.
  if (!o.cache_dir.empty()) {
    KVTIER_RETURN_IF_ERROR(CheckCacheDirIsCold(o.cache_dir, o.allow_warm_cache, &result.warnings));
    for (const auto& warning : result.warnings) console.Log("WARNING: " + warning);
  }

  KVTIER_ASSIGN_OR_RETURN(ServerInfo server,
                          QueryServer(o.base_url, o.api_key, o.model, o.connect_timeout_s));
  if (server.models.empty()) return Status::Unavailable(fmt::format("{} serves no model", o.base_url));
  result.model = o.model.empty() ? server.models.front() : o.model;
  if (std::find(server.models.begin(), server.models.end(), result.model) == server.models.end()) {
    std::string list;
    for (const auto& m : server.models) list += (list.empty() ? "" : ", ") + m;
    return Status::InvalidArgument(
        fmt::format("the server does not serve model \"{}\"; it serves: {}", result.model, list));
  }
  result.max_model_len = o.max_model_len > 0 ? o.max_model_len : server.max_model_len;
  console.Log(fmt::format(
      "server {} serves {} (context window: {})", o.base_url, result.model,
      result.max_model_len > 0 ? fmt::format("{} tokens", result.max_model_len)
                               : std::string("not reported; pass --max-model-len to check prompt sizes")));

  // Guard 2: the peak prompt (last round) must fit the context window.
  KVTIER_RETURN_IF_ERROR(CheckContextWindow(w, result.max_model_len, 1.0));

  HttpStreamClient::Options client_options;
  client_options.base_url = o.base_url;
  client_options.api_key = o.api_key;
  client_options.request_timeout_s = o.request_timeout_s;
  client_options.connect_timeout_s = o.connect_timeout_s;
  KVTIER_ASSIGN_OR_RETURN(auto client, HttpStreamClient::Create(client_options));
  Timebase tb;

  // Warm-up: first-round prompts of users outside the run's id range, excluded from results;
  // their reported prompt sizes calibrate the token estimate.
  if (o.warmup_requests > 0) {
    console.Log(fmt::format("warming up with {} requests", o.warmup_requests));
    int ok = 0;
    std::vector<double> ratios;
    std::string first_error;
    for (int i = 0; i < o.warmup_requests; ++i) {
      std::vector<ChatMessage> messages = {
          {"user", BuildContext(w, -(i + 1)) + BuildQuestion(1)}};
      client->Submit(BuildChatBody(result.model, messages, w.answer_len, o.ignore_eos), "",
                     [&](ChatResult&& r) {
                       if (r.ok()) {
                         ++ok;
                         if (r.usage_reported && r.prompt_tokens > 0) {
                           ratios.push_back(static_cast<double>(r.prompt_tokens) /
                                            static_cast<double>(EstimatePromptTokens(w, 1)));
                         }
                       } else if (first_error.empty()) {
                         first_error = r.error;
                       }
                     });
    }
    while (client->in_flight() > 0 && !Stopped(o)) KVTIER_RETURN_IF_ERROR(client->Poll(50));
    if (Stopped(o)) return Status::Aborted("interrupted during the warm-up");
    if (ok == 0) {
      return Status::Unavailable(
          fmt::format("all {} warm-up requests failed; the first: {}", o.warmup_requests, first_error));
    }
    if (ok < o.warmup_requests) {
      console.Log(fmt::format("WARNING: {} of {} warm-up requests failed; the first: {}",
                              o.warmup_requests - ok, o.warmup_requests, first_error));
    }
    if (!ratios.empty()) result.token_scale = Quantile(ratios, 0.5);
  }
  result.peak_prompt_estimate = static_cast<int64_t>(
      static_cast<double>(EstimatePeakPromptTokens(w)) * std::max(1.0, result.token_scale));
  KVTIER_RETURN_IF_ERROR(CheckContextWindow(w, result.max_model_len, result.token_scale));

  FailureLog failure_log(console);

  // Runs one phase until `end` (Unix time), `stop`, or everything failing.
  auto run_phase = [&](SessionManager& manager, PhaseState& st, double end,
                       const std::function<void(double now)>& on_tick) -> Status {
    HttpLauncher launcher(*client, o, result.model, tb, st, failure_log);
    while (true) {
      const double now = tb.Now();
      if (Stopped(o) || now >= end) break;
      manager.Step(now, launcher);
      st.peak_in_flight = std::max<int64_t>(st.peak_in_flight, static_cast<int64_t>(client->in_flight()));
      if (on_tick) on_tick(now);
      if (st.records.empty() && static_cast<int>(st.failures.size()) >= o.fail_fast_after) {
        return Status::Unavailable(fmt::format("every request failed ({} so far); the first: {}",
                                               st.failures.size(), st.first_error));
      }
      const double wake = std::min({manager.NextEventTime(now), end, now + 0.05});
      KVTIER_RETURN_IF_ERROR(client->Poll(PollTimeoutMs(tb.Now(), wake)));
    }
    return Status::Ok();
  };

  if (o.find_capacity) {
    console.Log(fmt::format(
        "finding capacity: closed-loop stages of {:.0f} s, each user sending its next question as "
        "soon as its answer arrives, doubling the streams until the finished rate stops growing",
        o.capacity_stage_s));
    double best = 0;
    for (int streams = w.num_users; streams <= o.capacity_max_streams; streams *= 2) {
      WorkloadConfig stage_config = w;
      stage_config.num_users = streams;
      SessionManager manager(stage_config, /*closed_loop=*/true);
      PhaseState st;
      const double start = tb.Now();
      const double end = start + o.capacity_stage_s;
      double last_progress = start;
      KVTIER_RETURN_IF_ERROR(run_phase(manager, st, end, [&](double now) {
        if (now - last_progress >= (o.progress_in_place ? o.progress_interval_s : 10.0)) {
          last_progress = now;
          console.Progress(fmt::format("[capacity, {} streams, {:>4.0f}/{:.0f} s] finished {}, failed {}",
                                       streams, now - start, o.capacity_stage_s, st.records.size(),
                                       st.failures.size()));
        }
      }));
      client->AbortAll();
      const double measured_from = start + 0.1 * o.capacity_stage_s;
      const double stop_time = std::min(end, tb.Now());
      Summary s = Summarize(st.records, st.launches, st.failures, measured_from, stop_time, 0, 0);
      CapacityStage stage{streams, s.seconds, s.finished, s.processing_speed, s.median_ttft, s.failed};
      result.stages.push_back(stage);
      console.Log(fmt::format("  {} streams: {:.3f} finished requests/s, median TTFT {:.3f} s{}",
                              streams, stage.finished_rps, stage.median_ttft,
                              stage.failed ? fmt::format(", {} failed", stage.failed) : ""));
      for (const auto& r : st.records) result.records.push_back(r);
      if (Stopped(o)) break;
      if (stage.finished_rps < 1.1 * best) break;  // plateau: more streams only queue
      best = std::max(best, stage.finished_rps);
    }
    for (const auto& s : result.stages) best = std::max(best, s.finished_rps);
    if (best <= 0) {
      return Stopped(o) ? Status::Aborted("interrupted before any request finished")
                        : Status::Unavailable("no request finished during the capacity probe");
    }
    result.service_rate_rps = best;
    // The flag value whose pacing sends capacity_target x the service rate.
    result.recommended_qps = o.capacity_target * best * w.qps / w.expected_qps();
    result.summary = Summarize(result.records, {}, {}, 0, std::numeric_limits<double>::max(), 0, 0);
    console.Print(fmt::format(
        "==================== Capacity ====================\n{}"
        "  Service rate:       {:.3f} finished requests/s\n"
        "  Recommended --qps:  {:.3f} (with --num-rounds {}, it sends {:.3f} requests/s, {:.0f} % "
        "of the service rate)\n",
        CapacityTable(result.stages), best, result.recommended_qps, w.num_rounds,
        o.capacity_target * best, o.capacity_target * 100));
    if (!Stopped(o) && result.stages.back().finished_rps >= 1.1 * best_before_last(result.stages)) {
      result.warnings.push_back(fmt::format(
          "the finished rate was still growing at {} streams, the most --capacity-max-streams "
          "allows: the service rate is at least {:.3f} requests/s; raise --capacity-max-streams",
          result.stages.back().streams, best));
    }
    for (const auto& warning : result.warnings) console.Log("WARNING: " + warning);
    return result;
  }

  // The measured run.
  console.Log(fmt::format(
      "running {} users x {} rounds at {} qps for {}: a send every {:.2f} s per user, a new user "
      "every {:.2f} s; peak prompt about {} tokens",
      w.num_users, w.num_rounds, w.qps,
      o.duration_s > 0 ? fmt::format("{:.0f} s", o.duration_s) : std::string("until interrupted"),
      w.gap_between_requests(), w.gap_between_users(), result.peak_prompt_estimate));
  SessionManager manager(w);
  PhaseState st;
  const double start = tb.Now();
  const double end = o.duration_s > 0 ? start + o.duration_s : std::numeric_limits<double>::infinity();
  double last_log = start, last_progress = start;
  int64_t held_at_last_log = 0;
  int64_t interval_peak = 0;
  const double progress_every = o.progress_in_place ? o.progress_interval_s : 10.0;
  Status run_status = run_phase(manager, st, end, [&](double now) {
    interval_peak = std::max<int64_t>(interval_peak, static_cast<int64_t>(client->in_flight()));
    if (now - last_progress >= progress_every) {
      last_progress = now;
      std::vector<double> recent;
      for (size_t i = st.records.size() > 200 ? st.records.size() - 200 : 0; i < st.records.size(); ++i) {
        recent.push_back(st.records[i].ttft);
      }
      console.Progress(fmt::format(
          "[{:>5.0f} s{}] users {}, in flight {}, sent {}, finished {}, failed {}, median TTFT {:.3f} s",
          now - start, o.duration_s > 0 ? fmt::format(" / {:.0f} s", o.duration_s) : "",
          manager.active_users(), client->in_flight(), st.launches.size(), st.records.size(),
          st.failures.size(), Quantile(recent, 0.5)));
    }
    if (now - last_log >= o.log_interval_s) {
      Summary s = Summarize(st.records, st.launches, st.failures, last_log, now,
                            static_cast<int64_t>(client->in_flight()), w.qps);
      s.expected_qps = w.expected_qps();
      s.held_back = manager.held_back() - held_at_last_log;
      s.peak_in_flight = interval_peak;
      console.Print(FormatSummary(s, fmt::format("Summary of the last {:.0f} s", now - last_log)));
      if (auto warning = SaturationWarning(s, w); !warning.empty()) console.Log("WARNING: " + warning);
      last_log = now;
      held_at_last_log = manager.held_back();
      interval_peak = 0;
    }
  });
  const double stop_time = tb.Now();
  const auto unfinished = static_cast<int64_t>(client->in_flight());
  client->AbortAll();
  KVTIER_RETURN_IF_ERROR(run_status);

  result.records = std::move(st.records);
  result.summary = Summarize(result.records, st.launches, st.failures, start, stop_time, unfinished, w.qps);
  result.summary.expected_qps = w.expected_qps();
  result.summary.held_back = manager.held_back();
  result.summary.peak_in_flight = st.peak_in_flight;
  if (result.records.empty()) {
    if (Stopped(o)) return Status::Aborted("interrupted before any request finished");
    return Status::Unavailable(fmt::format(
        "no request finished in {:.0f} s ({} sent, {} failed{}{}); try a longer --time", stop_time - start,
        st.launches.size(), st.failures.size(), st.first_error.empty() ? "" : "; the first: ",
        st.first_error));
  }
  if (st.missing_usage) {
    result.warnings.push_back(
        "the server did not report token usage in the stream (stream_options.include_usage): "
        "prompt_tokens are 0 and generation_tokens count streamed chunks");
  }
  if (auto warning = SaturationWarning(result.summary, w); !warning.empty()) {
    result.saturated = true;
    result.warnings.push_back(warning);
  }
  console.Print(FormatSummary(result.summary, "Performance summary"));
  for (const auto& warning : result.warnings) console.Log("WARNING: " + warning);
  return result;
}

std::string QaBenchResultToJson(const QaBenchOptions& o, const QaBenchResult& r) {
  const auto& w = o.workload;
  nlohmann::json j;
  j["config"] = {{"base_url", o.base_url},
                 {"model", r.model},
                 {"num_users", w.num_users},
                 {"num_rounds", w.num_rounds},
                 {"qps", w.qps},
                 {"shared_system_prompt", w.system_prompt_len},
                 {"user_history_prompt", w.user_history_len},
                 {"answer_len", w.answer_len},
                 {"time_s", o.duration_s},
                 {"init_user_id", w.init_user_id},
                 {"warmup_requests", o.warmup_requests},
                 {"find_capacity", o.find_capacity}};
  j["max_model_len"] = r.max_model_len;
  j["peak_prompt_tokens_estimate"] = r.peak_prompt_estimate;
  j["token_scale"] = r.token_scale;
  j["summary"] = nlohmann::json::parse(SummaryToJson(r.summary));
  j["saturated"] = r.saturated;
  j["warnings"] = r.warnings;
  if (o.find_capacity) {
    j["capacity"]["service_rate_rps"] = r.service_rate_rps;
    j["capacity"]["recommended_qps"] = r.recommended_qps;
    j["capacity"]["target_fraction"] = o.capacity_target;
    j["capacity"]["stages"] = nlohmann::json::array();
    for (const auto& s : r.stages) {
      j["capacity"]["stages"].push_back({{"streams", s.streams},
                                         {"seconds", s.seconds},
                                         {"finished", s.finished},
                                         {"finished_rps", s.finished_rps},
                                         {"median_ttft_s", s.median_ttft},
                                         {"failed", s.failed}});
    }
  }
  return j.dump(2);
}

}  // namespace kvtier::loadgen
