// The load generator end to end, against the streaming test server.
#include "loadgen/qa_bench.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "loadgen/stats.h"
#include "loadgen/testing/fake_openai_server.h"
#include "testing/temp_dir.h"

namespace kvtier::loadgen {
namespace {

using testing::FakeOpenAiServer;
using testing::FakeServerOptions;

std::unique_ptr<FakeOpenAiServer> StartServer(FakeServerOptions o = {}) {
  auto server = FakeOpenAiServer::Start(o);
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  return std::move(server).value();
}

QaBenchOptions SmallRun(const FakeOpenAiServer& server) {
  QaBenchOptions o;
  o.base_url = server.base_url();
  o.workload.num_users = 4;
  o.workload.num_rounds = 3;
  o.workload.qps = 8;
  o.workload.system_prompt_len = 20;
  o.workload.user_history_len = 30;
  o.workload.answer_len = 5;
  o.duration_s = 2;
  o.log_interval_s = 100;
  o.warmup_requests = 2;
  o.request_timeout_s = 20;
  return o;
}

TEST(QaBench, ReproducesTheConversationsAndMeasuresThem) {
  auto server = StartServer();
  auto o = SmallRun(*server);
  std::string printed;
  o.print = [&](const std::string& s) { printed += s; };
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_EQ(result->model, "fake-model");
  EXPECT_EQ(result->max_model_len, 32768);
  ASSERT_GE(result->records.size(), 8u);
  EXPECT_EQ(result->summary.failed, 0);
  EXPECT_NE(printed.find("Performance summary"), std::string::npos);

  // What the server saw: every request streamed with usage, temperature 0, max_tokens = answer
  // length; each user's requests re-send the whole conversation, growing by two messages a round.
  std::map<std::string, std::vector<testing::ReceivedRequest>> by_user;
  for (const auto& r : server->received()) {
    EXPECT_TRUE(r.include_usage);
    EXPECT_EQ(r.temperature, 0);
    EXPECT_EQ(r.max_tokens, 5);
    if (!r.user_id.empty()) by_user[r.user_id].push_back(r);
  }
  ASSERT_FALSE(by_user.empty());
  for (const auto& [user, requests] : by_user) {
    for (size_t k = 0; k < requests.size(); ++k) {
      const auto& r = requests[k];
      EXPECT_EQ(r.messages, static_cast<int>(2 * k + 1)) << "user " << user;
      EXPECT_EQ(r.first_message.rfind("This is the shared system prompt", 0), 0u);
      EXPECT_NE(r.first_message.find("User " + user + " "), std::string::npos);
      EXPECT_NE(r.last_message.find("Here's question #"), std::string::npos);
      for (size_t m = 1; m < r.roles.size(); m += 2) EXPECT_EQ(r.roles[m], "assistant");
      if (k > 0) {
        // + the answer (5 words) and the question (14 words), 4 tokens of markup each.
        EXPECT_EQ(r.prompt_tokens, requests[k - 1].prompt_tokens + (5 + 4) + (14 + 4));
      }
    }
  }
  // What was recorded matches what the server counted.
  for (const auto& rec : result->records) {
    EXPECT_EQ(rec.generation_tokens, 5);
    EXPECT_GT(rec.prompt_tokens, 50);
    EXPECT_GE(rec.ttft, 0);
    EXPECT_GT(rec.finish_time, rec.launch_time);
    EXPECT_GE(rec.question_id, 1);
    EXPECT_LE(rec.question_id, 3);
  }
}

TEST(QaBench, TtftIsTheTimeToTheFirstContentAndGenerationTheRest) {
  FakeServerOptions so;
  so.first_token_delay_s = 0.15;
  so.inter_token_delay_s = 0.02;
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.duration_s = 1.5;
  o.warmup_requests = 1;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_FALSE(result->records.empty());
  // What the server guarantees holds for every request: the first content comes no sooner
  // than its delay, and the last after the first. How much later is up to the machine (a
  // descheduled client reads several tokens at once), so the upper bounds and the gaps are
  // checked on the medians: one late request on a loaded machine is not a wrong measurement.
  std::vector<double> generation;
  for (const auto& r : result->records) {
    EXPECT_GE(r.ttft, 0.15);
    EXPECT_GE(r.generation_time, 0);
    generation.push_back(r.generation_time);
  }
  std::nth_element(generation.begin(), generation.begin() + generation.size() / 2,
                   generation.end());
  const double median_generation = generation[generation.size() / 2];
  EXPECT_GE(result->summary.median_ttft, 0.15);
  EXPECT_LT(result->summary.median_ttft, 0.35);
  // 4 gaps of 20 ms between 5 tokens; allow one to vanish (a first token read late).
  EXPECT_GE(median_generation, 3 * 0.02);
  EXPECT_LT(median_generation, 0.4);
}

TEST(QaBench, Sustains200ConcurrentStreams) {
  FakeServerOptions so;
  so.inter_token_delay_s = 0.05;  // an answer streams for about 1 s
  so.threads = 400;
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.workload.num_users = 240;
  o.workload.num_rounds = 3;
  o.workload.qps = 240;  // each user sends every second, so nearly all are streaming at once
  o.workload.answer_len = 20;
  o.duration_s = 3;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GE(result->summary.peak_in_flight, 200);
  EXPECT_GE(server->max_active(), 200);
  EXPECT_EQ(result->summary.failed, 0);
  EXPECT_GE(result->summary.finished, 200);
}

TEST(QaBench, AddsLittleToTtftAgainstAnInstantServer) {
  auto server = StartServer();  // answers at once
  auto o = SmallRun(*server);
  o.workload.num_users = 20;
  o.workload.qps = 100;
  o.workload.num_rounds = 5;
  o.duration_s = 2;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_GE(result->records.size(), 100u);
  // The whole loopback round trip, server included, as the client sees it. The requirement,
  // under 1 ms at p50 in a Release build, is shown by the benchmark (docs/benchmarks.md); here,
  // beside other tests on a loaded machine or under sanitizers, only that the client adds
  // milliseconds, not the tens a request that waited on a timer or a lock would show.
  EXPECT_LT(result->summary.median_ttft, 0.02);
}

TEST(QaBench, FindsTheServiceRate) {
  FakeServerOptions so;
  so.max_concurrent = 2;           // two requests at a time, the rest queue
  so.first_token_delay_s = 0.02;
  so.inter_token_delay_s = 0.005;  // 0.04 s per request: 2 / 0.04 = 50 requests/s
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.workload.num_users = 2;
  o.find_capacity = true;
  o.capacity_method = CapacityMethod::kClosedLoop;
  o.capacity_stage_s = 1.5;
  o.capacity_max_streams = 16;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_GE(result->stages.size(), 2u);  // it went past the point where more streams only queue
  EXPECT_EQ(result->stages[0].streams, 2);
  EXPECT_EQ(result->stages[1].streams, 4);
  // At most the server's 50/s (and a little noise); a loaded machine's client and server
  // wake late and lower it, but not to half.
  EXPECT_GT(result->service_rate_rps, 25);
  EXPECT_LT(result->service_rate_rps, 55);
  // The recommended --qps makes the pacing send 65 % of the service rate: with 3 rounds it sends
  // 3/2 x qps.
  EXPECT_NEAR(result->recommended_qps, 0.65 * result->service_rate_rps * 2 / 3, 1e-9);
  EXPECT_LE(server->max_active(), 2);
  // The overloaded stages queue: their TTFT grows.
  EXPECT_GT(result->stages.back().median_ttft, result->stages.front().median_ttft);
}

TEST(QaBench, FindsTheServiceRateByOverloadingThePacedWorkload) {
  FakeServerOptions so;
  so.max_concurrent = 2;           // two requests at a time, the rest queue
  so.first_token_delay_s = 0.02;
  so.inter_token_delay_s = 0.005;  // 0.04 s per request: 2 / 0.04 = 50 requests/s
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.workload.num_users = 16;
  o.workload.qps = 8;  // the pacing sends 12/s, then 24, 48, 96
  o.find_capacity = true;  // the paced method is the default
  o.capacity_stage_s = 1.5;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_GE(result->stages.size(), 3u);
  EXPECT_DOUBLE_EQ(result->stages[0].qps, 8);
  EXPECT_DOUBLE_EQ(result->stages[1].qps, 16);
  EXPECT_EQ(result->stages[0].streams, 0);
  // It stopped once the server fell behind what the pacing sent, or stopped growing: judged as
  // the probe judges it (the sends it really made, not the nominal --qps a loaded machine's
  // pacing may not keep: 43.7 finished against a nominal 48 sent was once called kept up).
  const auto& last = result->stages.back();
  double best_before = 0;
  for (size_t i = 0; i + 1 < result->stages.size(); ++i) {
    best_before = std::max(best_before, result->stages[i].finished_rps);
    EXPECT_FALSE(result->stages[i].fell_behind);
  }
  EXPECT_TRUE(last.fell_behind || last.finished_rps < 1.1 * best_before)
      << last.finished_rps << " finished/s, " << last.sent_rps << " sent/s, best before "
      << best_before;
  // At most the server's 50/s (and a little noise); a loaded machine's client and server
  // wake late and lower it, but not to half.
  EXPECT_GT(result->service_rate_rps, 25);
  EXPECT_LT(result->service_rate_rps, 55);
  EXPECT_NEAR(result->recommended_qps, 0.65 * result->service_rate_rps * 2 / 3, 1e-9);
  EXPECT_LE(server->max_active(), 2);
  auto json = nlohmann::json::parse(QaBenchResultToJson(o, *result));
  EXPECT_EQ(json["capacity"]["method"], "paced");
  EXPECT_EQ(json["capacity"]["stages"].back()["fell_behind"], last.fell_behind);
}

TEST(QaBench, WarnsWhenTheServerIsSaturated) {
  FakeServerOptions so;
  so.max_concurrent = 1;
  so.first_token_delay_s = 0.1;  // 10 requests/s at most
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.workload.num_users = 10;
  o.workload.qps = 40;
  o.duration_s = 2;
  o.warmup_requests = 1;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_TRUE(result->saturated);
  bool found = false;
  for (const auto& w : result->warnings) found |= w.find("saturated") != std::string::npos;
  EXPECT_TRUE(found);
  EXPECT_GT(result->summary.held_back, 0);
}

TEST(QaBench, RefusesAWarmCacheDirectoryBeforeSendingAnything) {
  auto server = StartServer();
  kvtier::testing::TempDir cache("cache");
  std::ofstream(cache.Sub("chunk-from-last-run")) << "kv";
  auto o = SmallRun(*server);
  o.cache_dir = cache.path();
  auto result = RunQaBench(o);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("--allow-warm-cache"), std::string::npos);
  EXPECT_EQ(server->chat_requests(), 0);

  o.allow_warm_cache = true;
  o.duration_s = 0.5;
  auto allowed = RunQaBench(o);
  ASSERT_TRUE(allowed.ok()) << allowed.status().ToString();
  ASSERT_FALSE(allowed->warnings.empty());
}

TEST(QaBench, RefusesPromptsThatOutgrowTheContextWindow) {
  FakeServerOptions so;
  so.max_model_len = 400;  // reported by /v1/models
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.workload.num_rounds = 10;
  o.workload.answer_len = 50;  // the first round fits; round 10 (~ 50 + 9 x 50 + ...) does not
  ASSERT_LT(EstimatePromptTokens(o.workload, 1), 400);
  auto result = RunQaBench(o);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("context window of 400"), std::string::npos)
      << result.status().message();
  EXPECT_EQ(server->chat_requests(), 0);

  // --max-model-len overrides what the server says.
  auto big = StartServer();
  auto o2 = SmallRun(*big);
  o2.workload = o.workload;
  o2.max_model_len = 400;
  EXPECT_EQ(RunQaBench(o2).status().code(), StatusCode::kInvalidArgument);
}

TEST(QaBench, CountsErrorsAndEarlyClosesWithoutStopping) {
  FakeServerOptions so;
  so.error_every = 5;
  so.close_every = 7;
  so.close_after_tokens = 2;
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.workload.qps = 20;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GT(result->summary.failures["http_status"], 0);
  EXPECT_GT(result->summary.failures["early_close"], 0);
  EXPECT_GT(result->summary.finished, 10);

  FakeServerOptions clean_cut = so;
  clean_cut.error_every = 0;
  clean_cut.close_abruptly = false;  // ends the stream politely, but without [DONE]
  auto server2 = StartServer(clean_cut);
  auto o2 = SmallRun(*server2);
  o2.workload.qps = 20;
  auto result2 = RunQaBench(o2);
  ASSERT_TRUE(result2.ok()) << result2.status().ToString();
  EXPECT_GT(result2->summary.failures["early_close"], 0);
}

TEST(QaBench, FailsClearlyWhenTheServerDoesNotWork) {
  int dead_port;
  {
    auto gone = StartServer();
    dead_port = gone->port();
  }
  QaBenchOptions o;
  o.base_url = "http://127.0.0.1:" + std::to_string(dead_port) + "/v1";
  o.connect_timeout_s = 2;
  auto unreachable = RunQaBench(o);
  EXPECT_EQ(unreachable.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(unreachable.status().message().find("cannot reach"), std::string::npos)
      << unreachable.status().message();

  FakeServerOptions broken;
  broken.fail_all = true;
  auto server = StartServer(broken);
  auto o2 = SmallRun(*server);
  auto failing = RunQaBench(o2);
  EXPECT_EQ(failing.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(failing.status().message().find("injected failure"), std::string::npos)
      << failing.status().message();

  auto ok_server = StartServer();
  auto o3 = SmallRun(*ok_server);
  o3.model = "no-such-model";
  auto wrong_model = RunQaBench(o3);
  EXPECT_EQ(wrong_model.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong_model.status().message().find("fake-model"), std::string::npos);

  auto o4 = SmallRun(*ok_server);
  o4.workload.qps = 0;
  EXPECT_EQ(RunQaBench(o4).status().code(), StatusCode::kInvalidArgument);
  o4 = SmallRun(*ok_server);
  o4.base_url = "localhost:8000";
  EXPECT_EQ(RunQaBench(o4).status().code(), StatusCode::kInvalidArgument);
}

TEST(QaBench, PrintsASummaryEveryLogInterval) {
  auto server = StartServer();
  auto o = SmallRun(*server);
  o.duration_s = 1.8;
  o.log_interval_s = 0.5;  // summaries at 0.5, 1.0 and 1.5 s (the run's timer keeps to them)
  int intervals = 0;
  o.print = [&](const std::string& s) {
    if (s.find("Summary of the last") != std::string::npos) ++intervals;
  };
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GE(intervals, 3);
  EXPECT_LE(intervals, 4);
}

TEST(QaBench, StopsWhenAsked) {
  FakeServerOptions so;
  so.inter_token_delay_s = 0.01;
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.duration_s = 0;  // until stopped
  std::atomic<bool> stop{false};
  o.stop = &stop;
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    stop = true;
  });
  auto result = RunQaBench(o);
  stopper.join();
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GT(result->summary.finished, 0);
  EXPECT_LT(result->summary.seconds, 5);
}


// Every request sent is accounted for: answered (drained ones included), failed or unfinished.
int64_t Accounted(const QaBenchResult& r) {
  return static_cast<int64_t>(r.records.size()) + r.summary.failed +
         static_cast<int64_t>(r.unfinished.size());
}

TEST(QaBench, DrainsTheRequestsInFlightAtTheEndAndIncludesThem) {
  // A saturated server: one request at a time, 0.15 s each, so requests queue and the ones in
  // flight at the end are the ones that waited longest.
  FakeServerOptions so;
  so.max_concurrent = 1;
  so.first_token_delay_s = 0.15;
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.workload.num_users = 6;
  o.workload.qps = 12;
  o.duration_s = 1.5;
  o.warmup_requests = 1;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GT(result->summary.on_the_fly, 0);
  EXPECT_EQ(result->summary.drained, result->summary.on_the_fly);
  EXPECT_EQ(result->summary.unfinished, 0);
  EXPECT_TRUE(result->unfinished.empty());
  // Every request launched in the run is in the records, the drained ones finishing after the
  // window; their TTFT counts, so the mean covers the whole queue.
  EXPECT_EQ(static_cast<int64_t>(result->records.size()), result->summary.sent);
  const double window_end = result->summary.end;
  double late_max_ttft = 0;
  for (const auto& r : result->records) {
    if (r.finish_time > window_end) late_max_ttft = std::max(late_max_ttft, r.ttft);
  }
  EXPECT_GT(late_max_ttft, 0.15);
  EXPECT_EQ(Accounted(*result), result->summary.sent);
}

TEST(QaBench, RecordsWhatTheDrainCannotWaitForAsUnfinished) {
  FakeServerOptions so;
  so.first_token_delay_s = 0.8;
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.duration_s = 2;
  o.warmup_requests = 1;
  o.drain_timeout_s = 0.1;  // shorter than any answer
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_GT(result->summary.on_the_fly, 0);
  // Those sent in the last 0.1 s of an answer's 0.8 s finish during the drain; the others not.
  EXPECT_GT(result->summary.unfinished, 0);
  EXPECT_EQ(result->summary.unfinished + result->summary.drained, result->summary.on_the_fly);
  EXPECT_EQ(result->summary.unfinished_without_first_token, result->summary.unfinished);
  ASSERT_EQ(static_cast<int64_t>(result->unfinished.size()), result->summary.unfinished);
  for (const auto& u : result->unfinished) {
    EXPECT_GE(u.waited, 0.09);
    EXPECT_LT(u.waited, 0.8 + 0.5);
    EXPECT_LT(u.ttft, 0);
  }
  EXPECT_EQ(Accounted(*result), result->summary.sent);
  bool warned = false;
  for (const auto& w : result->warnings) warned |= w.find("biased low") != std::string::npos;
  EXPECT_TRUE(warned);
  auto json = nlohmann::json::parse(QaBenchResultToJson(o, *result));
  EXPECT_EQ(json["summary"]["unfinished"].get<int64_t>(), result->summary.unfinished);
  EXPECT_EQ(json["unfinished"].size(), result->unfinished.size());
}

TEST(QaBench, ASecondStopGivesUpOnTheDrain) {
  FakeServerOptions so;
  // Answers take far longer than the bound below, so that a drain that waited for them fails
  // it however loaded the machine (the server's teardown still waits them out).
  so.first_token_delay_s = 8;
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.duration_s = 0;
  o.warmup_requests = 0;
  std::atomic<bool> stop{false}, give_up{false};
  o.stop = &stop;
  o.give_up = &give_up;
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    stop = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    give_up = true;
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto result = RunQaBench(o);
  stopper.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(6));
  // Nothing finished: interrupted, with the requests unanswered.
  EXPECT_EQ(result.status().code(), StatusCode::kAborted);
}

TEST(QaBench, RefusedRequestsAreNotRetriedAndALostRoundFailsTheRun) {
  // The server refuses the third round (its prompt is over a context window it does not
  // report), as vLLM does with HTTP 400.
  FakeServerOptions so;
  so.max_model_len = 130;  // round 1: 85 + 5 tokens, round 2: 112 + 5, round 3: 139 + 5
  so.report_max_model_len = false;
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.duration_s = 2.5;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GE(result->summary.failures["rejected"], 2);
  EXPECT_EQ(result->summary.failures["http_status"], 0);
  EXPECT_EQ(result->abandoned_users, result->summary.failures["rejected"]);
  ASSERT_FALSE(result->errors.empty());
  EXPECT_NE(result->errors[0].find("round 3"), std::string::npos) << result->errors[0];
  EXPECT_NE(result->errors[0].find("maximum context length"), std::string::npos)
      << result->errors[0];
  // No user asked its refused question twice.
  std::map<std::string, int> third_round_asks;
  for (const auto& r : server->received()) {
    if (!r.user_id.empty() && r.messages == 5) ++third_round_asks[r.user_id];
  }
  ASSERT_FALSE(third_round_asks.empty());
  for (const auto& [user, asks] : third_round_asks) EXPECT_EQ(asks, 1) << "user " << user;
  auto json = nlohmann::json::parse(QaBenchResultToJson(o, *result));
  EXPECT_FALSE(json["errors"].empty());
}

TEST(QaBench, AServerThatDiesMidRunFailsTheRun) {
  auto server = StartServer();
  auto o = SmallRun(*server);
  o.duration_s = 30;  // far past the bound below: the run must end when the server goes
  o.warmup_requests = 1;
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    server->Stop();
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto result = RunQaBench(o);
  killer.join();
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GT(result->summary.finished, 0);
  ASSERT_FALSE(result->errors.empty());
  EXPECT_NE(result->errors[0].find("stopped answering"), std::string::npos) << result->errors[0];
  EXPECT_GT(result->summary.failures["connect"], 0);
  // It stopped when the server went, not at the end of --time.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
}

TEST(QaBench, TimeBoundsTheWarmUp) {
  FakeServerOptions so;
  so.first_token_delay_s = 10;  // a stuck server, as far as a 0.3 s run is concerned
  auto server = StartServer(so);
  auto o = SmallRun(*server);
  o.duration_s = 0.3;
  const auto t0 = std::chrono::steady_clock::now();
  auto result = RunQaBench(o);
  // It gave up on the warm-up, well before the server would have answered.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(result.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(result.status().message().find("warm-up did not finish within"), std::string::npos)
      << result.status().message();
}

TEST(QaBench, RefusesAnUnwritableOutputBeforeSendingAnything) {
  auto server = StartServer();
  auto o = SmallRun(*server);
  o.output_files = {{"--output", "/nonexistent-kvtier-dir/summary.csv"}};
  auto result = RunQaBench(o);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("--output /nonexistent-kvtier-dir/summary.csv"),
            std::string::npos)
      << result.status().message();
  EXPECT_EQ(server->chat_requests(), 0);

  kvtier::testing::TempDir dir("out");
  o.output_files = {{"--output", dir.Sub("summary.csv")}};
  o.duration_s = 0.5;
  EXPECT_TRUE(RunQaBench(o).ok());
  EXPECT_FALSE(std::filesystem::exists(dir.Sub("summary.csv.tmp")));
}

TEST(QaBench, TheWarmUpCachesTheSharedPrefixOnlyWhenAsked) {
  for (bool shared : {true, false}) {
    auto server = StartServer();
    auto o = SmallRun(*server);
    o.warmup_shared_prefix = shared;
    o.duration_s = 0.3;
    ASSERT_TRUE(RunQaBench(o).ok());
    int warmups = 0;
    for (const auto& r : server->received()) {
      if (!r.user_id.empty()) continue;  // warm-up requests carry no user id
      ++warmups;
      EXPECT_EQ(r.first_message.rfind("This is the shared system prompt", 0) == 0, shared)
          << r.first_message;
    }
    EXPECT_EQ(warmups, 2);
  }
}

TEST(QaBench, AsksTheShareGptQuestionsWithTheirAnswerLengths) {
  auto server = StartServer();
  auto o = SmallRun(*server);
  auto conversations = std::make_shared<std::vector<SharegptConversation>>();
  conversations->push_back({{"first question", "second question", "third question"}, {2, 3, 4}});
  o.workload.sharegpt = conversations;
  o.duration_s = 1;
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  int asked = 0;
  for (const auto& r : server->received()) {
    if (r.user_id.empty()) continue;  // the warm-up
    ++asked;
    // Users created mid-conversation at the start send the context with a later question.
    const std::string& q = r.last_message;
    const bool known = q.ends_with("first question") || q.ends_with("second question") ||
                       q.ends_with("third question");
    EXPECT_TRUE(known) << q;
    EXPECT_EQ(q.find("Here's question"), std::string::npos) << q;
    if (q.ends_with("first question")) {
      EXPECT_EQ(r.max_tokens, 2);
    }
    if (q.ends_with("second question")) {
      EXPECT_EQ(r.max_tokens, 3);
    }
    if (q.ends_with("third question")) {
      EXPECT_EQ(r.max_tokens, 4);
    }
  }
  EXPECT_GT(asked, 0);
  for (const auto& rec : result->records) EXPECT_LE(rec.generation_tokens, 5);
}

TEST(QaBench, ADryRunSendsNothingAndCountsWhatItWouldSend) {
  QaBenchOptions o;
  o.base_url = "http://127.0.0.1:1/v1";  // nothing listens there
  o.workload.num_users = 10;
  o.workload.num_rounds = 5;
  o.workload.qps = 2;
  o.duration_s = 100;
  o.dry_run = true;
  std::string printed;
  o.print = [&](const std::string& s) { printed += s; };
  const auto t0 = std::chrono::steady_clock::now();
  auto result = RunQaBench(o);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));  // simulated time
  // The pacing sends 2 x 5 / 4 = 2.5 requests/s.
  EXPECT_NEAR(static_cast<double>(result->dry_run_sends), 250, 25);
  EXPECT_TRUE(result->records.empty());
  EXPECT_NE(printed.find("Dry run (nothing sent)"), std::string::npos);
}

}  // namespace
}  // namespace kvtier::loadgen
