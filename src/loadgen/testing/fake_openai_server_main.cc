// kvtier-fake-openai-server: the test server of the load generator as a program, to run
// `kvtier bench qa` against by hand (scale and overhead measurements, demonstrations).
#include <csignal>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "loadgen/testing/fake_openai_server.h"

namespace {
volatile std::sig_atomic_t g_stop = 0;
}

int main(int argc, char** argv) {
  kvtier::loadgen::testing::FakeServerOptions o;
  CLI::App app{"A streaming OpenAI-compatible test server for `kvtier bench qa` (not a model: it "
               "answers with numbered words)",
               "kvtier-fake-openai-server"};
  app.add_option("--host", o.host, "Address to listen on")->capture_default_str();
  app.add_option("--port", o.port, "Port (0: any free port, printed at start)")->capture_default_str();
  app.add_option("--model", o.model, "Model name it serves")->capture_default_str();
  app.add_option("--max-model-len", o.max_model_len,
                 "Context window in tokens: longer requests get HTTP 400 (0: none)")
      ->capture_default_str();
  app.add_flag("--report-max-model-len,!--hide-max-model-len", o.report_max_model_len,
               "Report the context window in /v1/models")
      ->capture_default_str();
  app.add_option("--first-token-delay", o.first_token_delay_s, "Seconds before the first token")
      ->capture_default_str();
  app.add_option("--prefill-per-token", o.prefill_s_per_token,
                 "Seconds of extra first-token delay per prompt token")->capture_default_str();
  app.add_option("--inter-token-delay", o.inter_token_delay_s, "Seconds between tokens")
      ->capture_default_str();
  app.add_option("--max-concurrent", o.max_concurrent,
                 "Requests served at once, the rest wait (0: unlimited)")->capture_default_str();
  app.add_option("--error-every", o.error_every,
                 "Every Nth request fails with HTTP --error-status (0: never)")
      ->capture_default_str();
  app.add_option("--error-status", o.error_status, "HTTP status of the injected failures")
      ->capture_default_str();
  app.add_option("--close-every", o.close_every, "Every Nth stream is cut short (0: never)")
      ->capture_default_str();
  app.add_option("--threads", o.threads, "Server threads (one per open connection)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto server = kvtier::loadgen::testing::FakeOpenAiServer::Start(o);
  if (!server.ok()) {
    fmt::print(stderr, "error: {}\n", server.status().ToString());
    return 1;
  }
  std::signal(SIGINT, [](int) { g_stop = 1; });
  std::signal(SIGTERM, [](int) { g_stop = 1; });
  fmt::print("serving {} at {}\n", o.model, (*server)->base_url());
  std::fflush(stdout);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  fmt::print("{} chat requests served, at most {} at once\n", (*server)->chat_requests(),
             (*server)->max_active());
  return 0;
}
