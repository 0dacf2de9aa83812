// `kvtier bench qa`: multi-round chat load generator for OpenAI-compatible servers, compatible
// with LMCache's multi-round QA benchmark.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include <fmt/format.h>

#include "loadgen/qa_bench.h"
#include "loadgen/stats.h"
#include "tools/command.h"

namespace {

std::atomic<bool> g_stop{false};
std::atomic<bool> g_give_up{false};

// First signal: stop sending and drain. Second: stop draining, summarize, write the files.
// Third: quit at once.
void OnSignal(int sig) {
  if (!g_stop.exchange(true)) return;
  if (!g_give_up.exchange(true)) return;
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

struct QaArgs {
  kvtier::loadgen::QaBenchOptions options;
  std::string output = "summary.csv";
  std::string json_summary;
  std::string process_summary;
  bool request_with_user_id = false;
  std::string sharegpt;  // the ShareGPT file, when --sharegpt
};

// LMCache's --process-summary: the summary of a CSV of an earlier run, nothing sent.
int ProcessSummary(const std::string& path) {
  using namespace kvtier::loadgen;
  auto records = ReadCsv(path);
  if (!records.ok()) {
    fmt::print(stderr, "error: {}\n", records.status().ToString());
    return 1;
  }
  auto summary = SummarizeCsv(*records);
  if (!summary.ok()) {
    fmt::print(stderr, "error: {}: {}\n", path, summary.status().ToString());
    return 1;
  }
  fmt::print("{}", FormatSummary(*summary, fmt::format("Summary of {}", path)));
  return 0;
}

int RunBenchQa(QaArgs& a) {
  using namespace kvtier::loadgen;
  if (!a.process_summary.empty()) return ProcessSummary(a.process_summary);
  auto& o = a.options;
  if (!a.sharegpt.empty()) {
    auto conversations = LoadSharegpt(a.sharegpt, o.workload.num_rounds);
    if (!conversations.ok()) {
      fmt::print(stderr, "error: --sharegpt: {}\n", conversations.status().ToString());
      return 1;
    }
    fmt::print(stderr, "{} ShareGPT conversations of more than {} turns in {}\n",
               conversations->size(), 2 * o.workload.num_rounds, a.sharegpt);
    o.workload.sharegpt = std::make_shared<const std::vector<SharegptConversation>>(
        std::move(conversations).value());
  }
  if (o.dry_run) {
    a.output.clear();  // nothing measured, nothing to write
    a.json_summary.clear();
  }
  if (!a.output.empty()) o.output_files.emplace_back("--output", a.output);
  if (!a.json_summary.empty()) o.output_files.emplace_back("--json-summary", a.json_summary);
  if (o.api_key.empty()) {
    if (const char* key = std::getenv("OPENAI_API_KEY")) o.api_key = key;
  }
  o.stop = &g_stop;
  o.give_up = &g_give_up;
  o.print = [](const std::string& s) {
    fmt::print("{}", s);
    std::fflush(stdout);
  };
  o.log = [](const std::string& s) {
    fmt::print(stderr, "{}", s);
    std::fflush(stderr);
  };
  o.progress_in_place = ::isatty(STDERR_FILENO) != 0;

  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  auto result = RunQaBench(o);
  if (!result.ok()) {
    fmt::print(stderr, "error: {}\n", result.status().ToString());
    return result.status().code() == kvtier::StatusCode::kAborted ? 130 : 1;
  }
  int rc = 0;
  if (!a.output.empty()) {
    if (auto s = WriteCsv(a.output, result->records); !s.ok()) {
      fmt::print(stderr, "error: {}\n", s.ToString());
      rc = 1;
    } else {
      fmt::print(stderr, "{} requests written to {}\n", result->records.size(), a.output);
    }
  }
  if (!a.json_summary.empty()) {
    std::ofstream out(a.json_summary, std::ios::trunc);
    out << QaBenchResultToJson(o, *result) << '\n';
    if (!out) {
      fmt::print(stderr, "error: cannot write {}\n", a.json_summary);
      rc = 1;
    }
  }
  if (!result->errors.empty()) {
    fmt::print(stderr,
               "error: the run went wrong (ERROR above); the files it wrote are for inspection, "
               "not for publication\n");
    rc = 1;
  }
  return rc;
}

void AddBenchQa(CLI::App& parent, kvtier::tools::CommandContext& ctx) {
  using kvtier::loadgen::CapacityMethod;
  auto args = std::make_shared<QaArgs>();
  auto& o = args->options;
  auto& w = o.workload;
  auto* cmd = parent.add_subcommand(
      "qa",
      "Multi-round chat load generator for any OpenAI-compatible server, compatible with LMCache's "
      "multi-round QA benchmark: users hold growing conversations (the whole history is re-sent "
      "every round), a user asks every num-users/qps seconds, TTFT is measured at the first "
      "streamed content. Guards refuse a warm --cache-dir and prompts that outgrow the context "
      "window; --find-capacity measures the server's service rate.");
  cmd->add_option("--num-users", w.num_users, "Users active at once")->capture_default_str();
  cmd->add_option("--num-rounds", w.num_rounds, "Questions per user conversation")
      ->capture_default_str();
  cmd->add_option("--qps", w.qps, "Requests per second over all users (config QPS)")
      ->capture_default_str();
  cmd->add_option("--shared-system-prompt", w.system_prompt_len,
                  "Tokens (words) of the system prompt shared by every user")
      ->capture_default_str();
  cmd->add_option("--user-history-prompt", w.user_history_len,
                  "Tokens (words) of each user's own context")
      ->capture_default_str();
  cmd->add_option("--answer-len", w.answer_len, "max_tokens of every answer")->capture_default_str();
  cmd->add_option("--time", o.duration_s,
                  "Seconds to send requests (0: until Ctrl-C); also the most the warm-up may take. "
                  "Requests in flight at the end are then waited for (--drain-timeout) and included")
      ->capture_default_str();
  cmd->add_option("--drain-timeout", o.drain_timeout_s,
                  "Seconds to wait at the end (or after Ctrl-C) for requests in flight, which are "
                  "included in the results; those still unanswered then are reported as unfinished "
                  "(censored, with how long they waited). 0: do not wait. A second Ctrl-C stops "
                  "waiting")
      ->capture_default_str();
  cmd->add_option("--model", o.model, "Model name (default: the first the server lists)");
  cmd->add_option("--base-url", o.base_url, "Server's OpenAI API root")->capture_default_str();
  cmd->add_option("--api-key", o.api_key, "Bearer token (default: $OPENAI_API_KEY, if set)");
  cmd->add_option("--output", args->output,
                  "CSV of finished requests (empty: none); columns prompt_tokens,"
                  "generation_tokens,ttft,generation_time,user_id,question_id,launch_time,"
                  "finish_time (seconds; times are Unix times)")
      ->capture_default_str();
  cmd->add_option("--json-summary", args->json_summary, "Also write the final summary as JSON here");
  cmd->add_option("--init-user-id", w.init_user_id, "User ids start after this one")
      ->capture_default_str();
  cmd->add_option("--log-interval", o.log_interval_s, "Seconds between interim summaries")
      ->capture_default_str();
  cmd->add_option("--warmup-requests", o.warmup_requests,
                  "Requests sent (and excluded) before the run")
      ->capture_default_str();
  cmd->add_flag("--warmup-shared-prefix,!--no-warmup-shared-prefix", o.warmup_shared_prefix,
                "Warm-up prompts begin with the run's shared system prompt, so the server has "
                "cached it before the run (the default; LMCache's warm-up does not). "
                "--no-warmup-shared-prefix gives each warm-up prompt a beginning of its own");
  cmd->add_option("--request-timeout", o.request_timeout_s, "Seconds before a request is abandoned")
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", o.ignore_eos,
                "Ask the server to generate --answer-len tokens regardless of end-of-sequence "
                "(a vLLM extension)");
  cmd->add_option("--cache-dir", o.cache_dir,
                  "The KV cache directory the server uses: refuse to start if it holds files");
  cmd->add_flag("--allow-warm-cache", o.allow_warm_cache,
                "Run even if --cache-dir holds chunks from an earlier run");
  cmd->add_option("--max-model-len", o.max_model_len,
                  "Server's context window in tokens (default: what /models reports)");
  cmd->add_flag("--find-capacity", o.find_capacity,
                "Overload the server on purpose and report its service rate and the qps for 65 % "
                "of it (see --capacity-method)");
  cmd->add_option("--capacity-method", o.capacity_method,
                  "paced: the workload itself, --qps doubling from its value until the server "
                  "falls behind (the published benchmark's method); closed-loop: --num-users "
                  "doubling, each user asking again as soon as answered")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, CapacityMethod>{{"paced", CapacityMethod::kPaced},
                                                {"closed-loop", CapacityMethod::kClosedLoop}},
          CLI::ignore_case))
      ->default_str("paced");
  cmd->add_option("--capacity-stage-time", o.capacity_stage_s,
                  "Seconds per --find-capacity stage")
      ->capture_default_str();
  cmd->add_option("--capacity-max-streams", o.capacity_max_streams,
                  "Most concurrent streams --capacity-method closed-loop tries")
      ->capture_default_str();
  cmd->add_option("--capacity-max-stages", o.capacity_max_stages,
                  "Most stages --capacity-method paced runs (the last at --qps x 2^(N-1))")
      ->capture_default_str();
  // LMCache's flags, so its command lines run unchanged.
  cmd->add_flag("--request-with-user-id", args->request_with_user_id,
                "Accepted for LMCache's command lines: the x-user-id header is always sent, as "
                "LMCache's script does whatever this flag says");
  cmd->add_flag("--verbose", o.verbose, "Log every request sent and every answer");
  cmd->add_flag("--sharegpt{ShareGPT.json}", args->sharegpt,
                "Ask the user turns of LMCache's ShareGPT file (ShareGPT.json in the current "
                "directory, as LMCache's script reads it, or --sharegpt=FILE) instead of the "
                "synthetic questions, each answer capped at the recorded answer's length and "
                "--answer-len; only conversations of more than 2 x --num-rounds turns")
      ->expected(0, 1);
  cmd->add_flag("--dry-run", o.dry_run,
                "Send nothing: play the pacing on a simulated clock for --time seconds (one "
                "conversation's life when 0) and print what would be sent; writes no file");
  cmd->add_option("--process-summary", args->process_summary,
                  "Print the summary of a CSV written by an earlier run (this tool's or "
                  "LMCache's) and exit; every other flag is ignored");
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchQa(*args); });
}

const bool kRegistered = kvtier::tools::RegisterCommand("bench", &AddBenchQa);

}  // namespace
