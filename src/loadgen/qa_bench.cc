#include "loadgen/qa_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/paced_capacity.h"
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
  std::vector<UnfinishedRecord> unfinished;
  std::vector<double> launches;
  int64_t peak_in_flight = 0;
  std::string first_error;
  bool missing_usage = false;
  // By round (the request's place in its conversation as sent): answers, and requests the
  // server refused (never retried).
  std::map<int, int64_t> answered_by_round;
  std::map<int, int64_t> refused_by_round;
  std::string first_refusal;
  int64_t abandoned_users = 0;
  // Connection failures since the last answer, and when the first of them came.
  int connect_failures_in_a_row = 0;
  double first_connect_failure = 0;
  std::string first_connect_error;
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
               const Timebase& tb, PhaseState& state, FailureLog& failures, Console& console)
      : client_(client),
        o_(o),
        model_(model),
        tb_(tb),
        state_(state),
        failures_(failures),
        console_(console) {}

  void Launch(UserSession& session, int question_id) override {
    state_.launches.push_back(tb_.Now());
    UserSession* s = &session;
    // The request's place in its conversation as sent (users created mid-session at the start
    // begin theirs at a later question): what its prompt length depends on.
    const int turn = static_cast<int>(session.history().size() + 1) / 2;
    if (o_.verbose) {
      console_.Log(fmt::format("user {} asks question #{} ({} messages)", session.user_id(),
                               question_id, session.history().size()));
    }
    client_.Submit(
        BuildChatBody(model_, session.history(),
                      AnswerTokens(o_.workload, session.user_id(), question_id), o_.ignore_eos),
        std::to_string(session.user_id()), [this, s, question_id, turn](ChatResult&& r) {
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
            ++state_.answered_by_round[turn];
            state_.connect_failures_in_a_row = 0;
            if (o_.verbose) {
              console_.Log(fmt::format(
                  "user {} question #{} answered: TTFT {:.3f} s, {} prompt tokens, {} generated "
                  "in {:.3f} s",
                  rec.user_id, question_id, rec.ttft, rec.prompt_tokens, rec.generation_tokens,
                  rec.generation_time));
            }
            s->OnAnswer(r.content);
            return;
          }
          const double when = tb_.Unix(r.finish);
          if (r.failure == FailureKind::kUnfinished) {
            // Given up on at the end of the drain: censored, not failed.
            UnfinishedRecord u;
            u.user_id = s->user_id();
            u.question_id = question_id;
            u.launch_time = tb_.Unix(r.launch);
            u.waited = std::chrono::duration<double>(r.finish - r.launch).count();
            if (r.got_content) {
              u.ttft = std::chrono::duration<double>(r.first_content - r.launch).count();
            }
            state_.unfinished.push_back(u);
            s->OnFailure();
            return;
          }
          state_.failures.push_back({when, FailureKindName(r.failure)});
          if (state_.first_error.empty()) state_.first_error = r.error;
          failures_.Report(r.failure, r.error, when);
          if (r.failure == FailureKind::kConnect) {
            if (state_.connect_failures_in_a_row++ == 0) {
              state_.first_connect_failure = when;
              state_.first_connect_error = r.error;
            }
          }
          if (r.failure == FailureKind::kRejected) {
            // The same request would be refused again, and the next round's is longer: the
            // conversation ends here.
            ++state_.refused_by_round[turn];
            if (state_.first_refusal.empty()) state_.first_refusal = r.error;
            ++state_.abandoned_users;
            s->OnRejected();
          } else {
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
  Console& console_;
};

bool Stopped(const QaBenchOptions& o) { return o.stop != nullptr && o.stop->load(); }
bool GaveUp(const QaBenchOptions& o) { return o.give_up != nullptr && o.give_up->load(); }

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
  const bool paced = !stages.empty() && stages.front().qps > 0;
  std::string out = paced ? "      --qps     sent/s  finished/s  median TTFT  failed\n"
                          : "  streams  finished/s  median TTFT  failed\n";
  for (const auto& s : stages) {
    if (paced) {
      out += fmt::format("  {:>9.3f}  {:>9.3f}  {:>10.3f}  {:>9.3f} s  {:>6}\n", s.qps, s.sent_rps,
                         s.finished_rps, s.median_ttft, s.failed);
    } else {
      out += fmt::format("  {:>7}  {:>10.3f}  {:>9.3f} s  {:>6}\n", s.streams, s.finished_rps,
                         s.median_ttft, s.failed);
    }
  }
  return out;
}

// Answers every request at once, as soon as the step that sent it is over.
class InstantLauncher : public Launcher {
 public:
  InstantLauncher(const QaBenchOptions& o, Console& console, const double& now)
      : o_(o), console_(console), now_(now) {}
  void Launch(UserSession& session, int question_id) override {
    ++sends_;
    const int round = static_cast<int>(session.history().size() + 1) / 2;
    const int64_t prompt = EstimatePromptTokens(o_.workload, round);
    peak_prompt_ = std::max(peak_prompt_, prompt);
    if (o_.verbose) {
      console_.Log(fmt::format("[{:>8.2f} s] user {} asks question #{} ({} messages{})", now_,
                               session.user_id(), question_id, session.history().size(),
                               o_.workload.sharegpt
                                   ? std::string()
                                   : fmt::format(", about {} prompt tokens", prompt)));
    }
    pending_.push_back(&session);
  }
  void AnswerAll() {
    for (UserSession* s : pending_) {
      s->OnAnswer(FillerWords(AnswerTokens(o_.workload, s->user_id(), s->question_id())));
    }
    pending_.clear();
  }
  int64_t sends() const { return sends_; }
  int64_t peak_prompt() const { return peak_prompt_; }

 private:
  const QaBenchOptions& o_;
  Console& console_;
  const double& now_;
  std::vector<UserSession*> pending_;
  int64_t sends_ = 0;
  int64_t peak_prompt_ = 0;
};

Result<QaBenchResult> DryRun(const QaBenchOptions& o, Console& console) {
  const WorkloadConfig& w = o.workload;
  QaBenchResult result;
  result.model = o.model;
  result.max_model_len = o.max_model_len;
  if (!w.sharegpt) KVTIER_RETURN_IF_ERROR(CheckContextWindow(w, o.max_model_len, 1.0));
  // One conversation's life when no --time: every user seen from its first question to its last.
  const double seconds =
      o.duration_s > 0 ? o.duration_s : w.gap_between_requests() * std::max(1, w.num_rounds - 1);
  SessionManager manager(w);
  double now = 0;
  InstantLauncher launcher(o, console, now);
  while (now < seconds) {
    manager.Step(now, launcher);
    launcher.AnswerAll();
    now = std::max(manager.NextEventTime(now), now + 1e-3);
  }
  result.dry_run_sends = launcher.sends();
  result.dry_run_users = manager.users_joined();
  result.dry_run_seconds = seconds;
  result.peak_prompt_estimate = std::max(launcher.peak_prompt(), EstimatePeakPromptTokens(w));
  console.Print(fmt::format(
      "==================== Dry run (nothing sent) ====================\n"
      "  Simulated time:                   {:.1f} s\n"
      "  Requests that would be sent:      {} ({:.4f} reqs/s; the pacing's expected {:.4f})\n"
      "  Users joined:                     {}\n"
      "  Largest prompt:                   {}\n",
      seconds, result.dry_run_sends, static_cast<double>(result.dry_run_sends) / seconds,
      w.expected_qps(), result.dry_run_users,
      w.sharegpt ? std::string("not estimated for ShareGPT conversations")
                 : fmt::format("about {} tokens (+ {} to generate)", result.peak_prompt_estimate,
                               w.answer_len)));
  return result;
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
  if (!(o.drain_timeout_s >= 0)) return Status::InvalidArgument("--drain-timeout must be >= 0");
  if (o.server_gone_after < 1) return Status::InvalidArgument("server_gone_after must be >= 1");
  if (o.find_capacity && o.capacity_max_stages < 1) {
    return Status::InvalidArgument("--capacity-max-stages must be >= 1");
  }
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
  // Found now, not after an hour of measurement.
  for (const auto& [flag, path] : o.output_files) KVTIER_RETURN_IF_ERROR(CheckWritable(path, flag));
  if (o.dry_run) return DryRun(o, console);

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

  // Guard 2: the peak prompt (last round) must fit the context window. ShareGPT prompts are not
  // estimated: a request over the window is refused by the server and reported as such.
  if (w.sharegpt) {
    console.Log(fmt::format("prompts from {} ShareGPT conversations: the context-window guard "
                            "cannot estimate them (requests the server refuses are reported)",
                            w.sharegpt->size()));
  } else {
    KVTIER_RETURN_IF_ERROR(CheckContextWindow(w, result.max_model_len, 1.0));
  }

  HttpStreamClient::Options client_options;
  client_options.base_url = o.base_url;
  client_options.api_key = o.api_key;
  client_options.request_timeout_s = o.request_timeout_s;
  client_options.connect_timeout_s = o.connect_timeout_s;
  KVTIER_ASSIGN_OR_RETURN(auto client, HttpStreamClient::Create(client_options));
  Timebase tb;

  // Warm-up: first-round prompts of users outside the run's id range, excluded from results;
  // their reported prompt sizes calibrate the token estimate. --time bounds it, so a stuck
  // server cannot hold the command for a request timeout.
  if (o.warmup_requests > 0) {
    console.Log(fmt::format("warming up with {} requests{}{}", o.warmup_requests,
                            o.warmup_shared_prefix ? " (they cache the shared system prompt)" : "",
                            o.duration_s > 0 ? fmt::format(", for at most {:.0f} s", o.duration_s)
                                             : std::string()));
    int ok = 0;
    std::vector<double> ratios;
    std::string first_error;
    for (int i = 0; i < o.warmup_requests; ++i) {
      // Without the shared prefix, a text of its own comes first: prefix caches match from the
      // first token, so nothing this request leaves behind serves a prompt of the run.
      const std::string lead =
          o.warmup_shared_prefix ? "" : fmt::format("Warm-up request {}, not part of the run. ", i + 1);
      const int64_t lead_tokens = o.warmup_shared_prefix ? 0 : 8;
      std::vector<ChatMessage> messages = {
          {"user", lead + BuildContext(w, -(i + 1)) + BuildQuestion(1)}};
      client->Submit(BuildChatBody(result.model, messages, w.answer_len, o.ignore_eos), "",
                     [&, lead_tokens](ChatResult&& r) {
                       if (r.ok()) {
                         ++ok;
                         if (r.usage_reported && r.prompt_tokens > 0) {
                           ratios.push_back(
                               static_cast<double>(r.prompt_tokens) /
                               static_cast<double>(EstimatePromptTokens(w, 1) + lead_tokens));
                         }
                       } else if (first_error.empty()) {
                         first_error = r.error;
                       }
                     });
    }
    const double warmup_start = tb.Now();
    const double warmup_end = o.duration_s > 0 ? warmup_start + o.duration_s
                                               : std::numeric_limits<double>::infinity();
    double last_note = warmup_start;
    while (client->in_flight() > 0 && !Stopped(o) && tb.Now() < warmup_end) {
      KVTIER_RETURN_IF_ERROR(client->Poll(PollTimeoutMs(tb.Now(), std::min(warmup_end, tb.Now() + 0.05))));
      if (tb.Now() - last_note >= 10) {
        last_note = tb.Now();
        console.Log(fmt::format("warm-up: {} of {} requests answered after {:.0f} s", ok,
                                o.warmup_requests, last_note - warmup_start));
      }
    }
    if (Stopped(o)) return Status::Aborted("interrupted during the warm-up");
    if (const size_t stuck = client->AbortAll(); stuck > 0) {
      return Status::Unavailable(fmt::format(
          "the warm-up did not finish within {:.0f} s (--time bounds it): {} of its {} requests "
          "were still unanswered{}{}; the server is stuck or far slower than this workload needs",
          o.duration_s, stuck, o.warmup_requests, first_error.empty() ? "" : "; the first failure: ",
          first_error));
    }
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
  if (!w.sharegpt) {
    KVTIER_RETURN_IF_ERROR(CheckContextWindow(w, result.max_model_len, result.token_scale));
  }

  FailureLog failure_log(console);

  // Runs one phase until `end` (Unix time), `stop`, the server gone or everything failing. The
  // launcher must outlive the requests it sent: the drain after the phase completes them.
  auto run_phase = [&](SessionManager& manager, HttpLauncher& launcher, PhaseState& st,
                       double end, const std::function<void(double now)>& on_tick) -> Status {
    while (true) {
      const double now = tb.Now();
      if (Stopped(o) || now >= end) break;
      if (st.connect_failures_in_a_row >= o.server_gone_after) break;  // the server is gone
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
    const bool paced = o.capacity_method == CapacityMethod::kPaced;
    if (paced) {
      console.Log(fmt::format(
          "finding capacity: the paced workload in stages of {:g} s, --qps doubling from {:g}, "
          "until the server falls behind (finished rate under 90 % of what the pacing sends) or "
          "its finished rate stops growing",
          o.capacity_stage_s, w.qps));
    } else {
      console.Log(fmt::format(
          "finding capacity: closed-loop stages of {:g} s, each user sending its next question "
          "as soon as its answer arrives, doubling the streams until the finished rate stops "
          "growing",
          o.capacity_stage_s));
    }
    double best = 0;
    int streams = w.num_users;
    double qps = w.qps;
    int next_user_id = w.init_user_id;
    bool last_fell_behind = false;
    for (int n = 0; paced ? n < o.capacity_max_stages : streams <= o.capacity_max_streams; ++n) {
      WorkloadConfig stage_config = w;
      // Every stage has users of its own, as a separate run would: the same users again would
      // find the previous stage's prefixes cached and read as capacity.
      stage_config.init_user_id = next_user_id;
      if (paced) {
        stage_config.qps = qps;
      } else {
        stage_config.num_users = streams;
      }
      SessionManager manager(stage_config, /*closed_loop=*/!paced);
      PhaseState st;
      const double start = tb.Now();
      const double end = start + o.capacity_stage_s;
      double last_progress = start;
      const std::string label =
          paced ? fmt::format("--qps {:g}", qps) : fmt::format("{} streams", streams);
      HttpLauncher launcher(*client, o, result.model, tb, st, failure_log, console);
      KVTIER_RETURN_IF_ERROR(run_phase(manager, launcher, st, end, [&](double now) {
        if (now - last_progress >= (o.progress_in_place ? o.progress_interval_s : 10.0)) {
          last_progress = now;
          console.Progress(fmt::format("[capacity, {}, {:>4.0f}/{:.0f} s] finished {}, failed {}",
                                       label, now - start, o.capacity_stage_s, st.records.size(),
                                       st.failures.size()));
        }
      }));
      client->AbortAll();
      next_user_id += manager.users_joined();
      const double measured_from = start + 0.1 * o.capacity_stage_s;
      const double stop_time = std::min(end, tb.Now());
      Summary s = Summarize(st.records, st.launches, st.failures, measured_from, stop_time, 0, 0);
      CapacityStage stage{paced ? 0 : streams, s.seconds,    s.finished, s.processing_speed,
                          s.median_ttft,       s.failed};
      stage.qps = paced ? qps : 0;
      stage.sent_rps = s.actual_qps;
      result.stages.push_back(stage);
      console.Log(fmt::format("  {}: {:.3f} finished requests/s ({:.3f} sent), median TTFT {:.3f} s{}",
                              label, stage.finished_rps, stage.sent_rps, stage.median_ttft,
                              stage.failed ? fmt::format(", {} failed", stage.failed) : ""));
      for (const auto& r : st.records) result.records.push_back(r);
      if (Stopped(o)) break;
      if (stage.finished_rps < 1.1 * best) break;  // plateau: more load only queues
      best = std::max(best, stage.finished_rps);
      // The paced method's reading: the rate the server achieves once it falls behind what the
      // pacing really sent (docs/bench-qa.md) is its capacity.
      if (paced) {
        std::vector<std::pair<double, double>> finished;
        for (const auto& r : st.records) finished.emplace_back(r.launch_time, r.finish_time);
        last_fell_behind = ReadPacedStage(finished, st.launches, start, stop_time).fell_behind;
        result.stages.back().fell_behind = last_fell_behind;
        if (last_fell_behind) break;
      }
      streams *= 2;
      qps *= 2;
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
    const CapacityStage& last = result.stages.back();
    const bool kept_up = !paced || !last_fell_behind;
    if (!Stopped(o) && kept_up && last.finished_rps >= 1.1 * best_before_last(result.stages)) {
      result.warnings.push_back(
          paced ? fmt::format("the server kept up with --qps {:g}, after the {} stages "
                              "--capacity-max-stages allows: the service rate is at least {:.3f} "
                              "requests/s; raise --capacity-max-stages or start from a higher --qps",
                              last.qps, result.stages.size(), best)
                : fmt::format("the finished rate was still growing at {} streams, the most "
                              "--capacity-max-streams allows: the service rate is at least {:.3f} "
                              "requests/s; raise --capacity-max-streams",
                              last.streams, best));
    }
    for (const auto& warning : result.warnings) console.Log("WARNING: " + warning);
    return result;
  }

  // The measured run.
  console.Log(fmt::format(
      "running {} users x {} rounds at {} qps {}: a send every {:.2f} s per user, a new user "
      "every {:.2f} s; peak prompt about {} tokens; requests in flight at the end are waited for "
      "(up to {:.0f} s) and included",
      w.num_users, w.num_rounds, w.qps,
      o.duration_s > 0 ? fmt::format("for {:g} s", o.duration_s)
                       : std::string("until interrupted (Ctrl-C)"),
      w.gap_between_requests(), w.gap_between_users(), result.peak_prompt_estimate,
      o.drain_timeout_s));
  if (o.duration_s > 0 && o.duration_s < w.gap_between_requests()) {
    console.Log(fmt::format(
        "note: --time {:g} is shorter than a user's gap between questions ({:.1f} s): most users "
        "ask once at most, and the run sends about {:.0f} requests",
        o.duration_s, w.gap_between_requests(), w.expected_qps() * o.duration_s + 1));
  }
  SessionManager manager(w);
  PhaseState st;
  const double start = tb.Now();
  const double end = o.duration_s > 0 ? start + o.duration_s : std::numeric_limits<double>::infinity();
  double last_log = start, last_progress = start;
  // Summaries on a fixed schedule (every log interval from the start), so that a late tick does
  // not push every later summary back; each covers the time since the last one.
  double next_log = start + o.log_interval_s;
  int64_t held_at_last_log = 0;
  int64_t interval_peak = 0;
  const double progress_every = o.progress_in_place ? o.progress_interval_s : 10.0;
  HttpLauncher launcher(*client, o, result.model, tb, st, failure_log, console);
  Status run_status = run_phase(manager, launcher, st, end, [&](double now) {
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
    if (now >= next_log) {
      Summary s = Summarize(st.records, st.launches, st.failures, last_log, now,
                            static_cast<int64_t>(client->in_flight()), w.qps);
      s.expected_qps = w.expected_qps();
      s.held_back = manager.held_back() - held_at_last_log;
      s.peak_in_flight = interval_peak;
      console.Print(FormatSummary(s, fmt::format("Summary of the last {:.0f} s", now - last_log)));
      // Conversations ended by refused requests send less: that is not saturation.
      if (st.abandoned_users == 0) {
        if (auto warning = SaturationWarning(s, w); !warning.empty()) console.Log("WARNING: " + warning);
      }
      last_log = now;
      while (next_log <= now) next_log += o.log_interval_s;
      held_at_last_log = manager.held_back();
      interval_peak = 0;
    }
  });
  const double stop_time = tb.Now();
  const auto on_the_fly = static_cast<int64_t>(client->in_flight());
  if (!run_status.ok()) {
    client->AbortAll();
    return run_status;
  }
  const bool server_gone = st.connect_failures_in_a_row >= o.server_gone_after;

  // Drain: wait for the requests in flight and include them. Leaving them out would drop the
  // slowest answers exactly when the server queues, biasing TTFT low.
  if (on_the_fly > 0 && o.drain_timeout_s > 0 && !GaveUp(o)) {
    // Interrupted: the next interrupt gives up. Ended by --time: the first one does.
    const bool stopped_before = Stopped(o);
    auto give_up = [&] { return GaveUp(o) || (!stopped_before && Stopped(o)); };
    console.Log(fmt::format(
        "sending stopped; waiting up to {:g} s for the {} requests in flight (they are included{})",
        o.drain_timeout_s, on_the_fly,
        o.stop == nullptr ? ""
        : stopped_before  ? "; Ctrl-C again to give up on them"
                          : "; Ctrl-C to give up on them"));
    const double drain_end = tb.Now() + o.drain_timeout_s;
    double last_note = tb.Now();
    while (client->in_flight() > 0 && !give_up() && tb.Now() < drain_end) {
      KVTIER_RETURN_IF_ERROR(client->Poll(PollTimeoutMs(tb.Now(), std::min(drain_end, tb.Now() + 0.05))));
      if (tb.Now() - last_note >= (o.progress_in_place ? o.progress_interval_s : 10.0)) {
        last_note = tb.Now();
        console.Progress(fmt::format("[drain {:>4.0f} s / {:.0f} s] in flight {}",
                                     last_note - stop_time, o.drain_timeout_s, client->in_flight()));
      }
    }
  }
  // What is left is censored: recorded as unfinished with how long it waited.
  client->CancelAll();

  result.unfinished = st.unfinished;
  result.records = std::move(st.records);
  result.abandoned_users = st.abandoned_users;
  result.summary = SummarizeRun(result.records, st.launches, st.failures, st.unfinished, start,
                                stop_time, w.qps);
  result.summary.on_the_fly = on_the_fly;
  result.summary.expected_qps = w.expected_qps();
  result.summary.held_back = manager.held_back();
  result.summary.peak_in_flight = st.peak_in_flight;
  if (server_gone) {
    result.errors.push_back(fmt::format(
        "the server stopped answering {:.0f} s into the run: {} connection failures in a row since "
        "the last answer (the first: {}); the figures cover the run until then",
        st.first_connect_failure - start, st.connect_failures_in_a_row, st.first_connect_error));
  }
  // Refused requests are not retried; a round the server refuses is lost for every user.
  for (const auto& [round, refused] : st.refused_by_round) {
    const int64_t answered = st.answered_by_round[round];
    const std::string what = fmt::format(
        "the server refused {} of the {} requests in round {} of their conversation (HTTP 4xx, not "
        "retried: each ended its user's conversation); the first: {}",
        refused, refused + answered, round, st.first_refusal);
    if (refused >= 2 && refused >= answered) {
      result.errors.push_back(
          what + ". The round is lost, so later rounds are never measured: fix the request (e.g. "
                 "a prompt over the context window: pass --max-model-len, lower --num-rounds, "
                 "--answer-len or the prompt lengths)");
    } else {
      result.warnings.push_back(what);
    }
  }
  if (result.records.empty()) {
    for (const auto& e : result.errors) console.Log("ERROR: " + e);
    if (Stopped(o)) return Status::Aborted("interrupted before any request finished");
    return Status::Unavailable(fmt::format(
        "no request finished in {:.0f} s ({} sent, {} failed, {} unfinished{}{}); try a longer --time",
        stop_time - start, st.launches.size(), st.failures.size(), st.unfinished.size(),
        st.first_error.empty() ? "" : "; the first failure: ", st.first_error));
  }
  if (result.summary.unfinished > 0) {
    result.warnings.push_back(fmt::format(
        "{} requests were still unanswered {:.0f} s after the run stopped sending and are in no "
        "figure ({} had no first token after up to {:.1f} s): TTFT is biased low; raise "
        "--drain-timeout",
        result.summary.unfinished, o.drain_timeout_s,
        result.summary.unfinished_without_first_token, result.summary.unfinished_longest_wait));
  }
  if (st.missing_usage) {
    result.warnings.push_back(
        "the server did not report token usage in the stream (stream_options.include_usage): "
        "prompt_tokens are 0 and generation_tokens count streamed chunks");
  }
  if (result.abandoned_users > 0) {
    result.warnings.push_back(fmt::format(
        "{} conversations ended at a refused request, so fewer requests were sent than the pacing "
        "would (actual QPS {:.3f} against {:.3f}); the saturation check is off for this run",
        result.abandoned_users, result.summary.actual_qps, w.expected_qps()));
  } else if (auto warning = SaturationWarning(result.summary, w); !warning.empty()) {
    result.saturated = true;
    result.warnings.push_back(warning);
  }
  if (auto note = ShortRunNote(result.summary, w); !note.empty()) result.warnings.push_back(note);
  console.Print(FormatSummary(result.summary, "Performance summary"));
  for (const auto& warning : result.warnings) console.Log("WARNING: " + warning);
  for (const auto& error : result.errors) console.Log("ERROR: " + error);
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
                 {"sharegpt_conversations", w.sharegpt ? w.sharegpt->size() : 0},
                 {"warmup_requests", o.warmup_requests},
                 {"warmup_shared_prefix", o.warmup_shared_prefix},
                 {"drain_timeout_s", o.drain_timeout_s},
                 {"in_flight_at_end", "drained and included; unanswered after the drain: unfinished"},
                 {"find_capacity", o.find_capacity}};
  j["max_model_len"] = r.max_model_len;
  j["peak_prompt_tokens_estimate"] = r.peak_prompt_estimate;
  j["token_scale"] = r.token_scale;
  j["summary"] = nlohmann::json::parse(SummaryToJson(r.summary));
  j["saturated"] = r.saturated;
  j["warnings"] = r.warnings;
  j["errors"] = r.errors;
  j["abandoned_users"] = r.abandoned_users;
  j["unfinished"] = nlohmann::json::array();
  for (const auto& u : r.unfinished) {
    j["unfinished"].push_back({{"user_id", u.user_id},
                               {"question_id", u.question_id},
                               {"launch_time", u.launch_time},
                               {"waited_s", u.waited},
                               {"ttft_s", u.ttft >= 0 ? nlohmann::json(u.ttft) : nlohmann::json()}});
  }
  if (o.find_capacity) {
    j["capacity"]["service_rate_rps"] = r.service_rate_rps;
    j["capacity"]["recommended_qps"] = r.recommended_qps;
    j["capacity"]["target_fraction"] = o.capacity_target;
    j["capacity"]["method"] =
        o.capacity_method == CapacityMethod::kPaced ? "paced" : "closed_loop";
    j["capacity"]["stages"] = nlohmann::json::array();
    for (const auto& s : r.stages) {
      j["capacity"]["stages"].push_back({{"streams", s.streams},
                                         {"qps", s.qps},
                                         {"sent_rps", s.sent_rps},
                                         {"seconds", s.seconds},
                                         {"finished", s.finished},
                                         {"finished_rps", s.finished_rps},
                                         {"median_ttft_s", s.median_ttft},
                                         {"failed", s.failed},
                                         {"fell_behind", s.fell_behind}});
    }
  }
  return j.dump(2);
}

}  // namespace kvtier::loadgen
