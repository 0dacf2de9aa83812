// `kvtier bench qa`: multi-round chat load generator for OpenAI-compatible servers, compatible
// with LMCache's multi-round QA benchmark.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "loadgen/qa_bench.h"
#include "loadgen/stats.h"
#include "tools/command.h"

namespace {

std::atomic<bool> g_stop{false};

void OnSignal(int) { g_stop.store(true); }

struct QaArgs {
  kvtier::loadgen::QaBenchOptions options;
  std::string output = "summary.csv";
  std::string json_summary;
};

int RunBenchQa(QaArgs& a) {
  using namespace kvtier::loadgen;
  auto& o = a.options;
  if (o.api_key.empty()) {
    if (const char* key = std::getenv("OPENAI_API_KEY")) o.api_key = key;
  }
  o.stop = &g_stop;
  o.print = [](const std::string& s) {
    fmt::print("{}", s);
    std::fflush(stdout);
  };
  o.log = [](const std::string& s) {
    fmt::print(stderr, "{}", s);
    std::fflush(stderr);
  };
  o.progress_in_place = ::isatty(STDERR_FILENO) != 0;

  // First Ctrl-C: stop sending, print the final summary and write the files. Second: quit.
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sa.sa_flags = SA_RESETHAND;
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
  return rc;
}

void AddBenchQa(CLI::App& parent, kvtier::tools::CommandContext& ctx) {
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
  cmd->add_option("--time", o.duration_s, "Seconds to run (0: until Ctrl-C)")->capture_default_str();
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
                "Overload the server on purpose (closed loop, doubling the streams from "
                "--num-users) and report its service rate and the qps for 65 % of it");
  cmd->add_option("--capacity-stage-time", o.capacity_stage_s,
                  "Seconds per --find-capacity stage")
      ->capture_default_str();
  cmd->add_option("--capacity-max-streams", o.capacity_max_streams,
                  "Most concurrent streams --find-capacity tries")
      ->capture_default_str();
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchQa(*args); });
}

const bool kRegistered = kvtier::tools::RegisterCommand("bench", &AddBenchQa);

}  // namespace
