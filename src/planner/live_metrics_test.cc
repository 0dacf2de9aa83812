#include "planner/live_metrics.h"

#include <cpp-httplib/httplib.h>
#include <gtest/gtest.h>

#include <thread>

namespace kvtier::planner {
namespace {

// The series a vLLM 0.x server with a KV connector publishes (names as vLLM's V1 metrics).
constexpr const char* kVllmText = R"(# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 10000.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 30.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 10.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 10000.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 6000.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny"} 4000.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 2000.0
vllm:num_preemptions_total{engine="0",model_name="tiny"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:request_prompt_tokens_bucket{engine="0",le="100.0",model_name="tiny"} 0.0
vllm:request_prompt_tokens_bucket{engine="0",le="200.0",model_name="tiny"} 20.0
vllm:request_prompt_tokens_bucket{engine="0",le="500.0",model_name="tiny"} 40.0
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="tiny"} 40.0
vllm:request_prompt_tokens_count{engine="0",model_name="tiny"} 40.0
vllm:request_prompt_tokens_sum{engine="0",model_name="tiny"} 10000.0
)";

TEST(LiveMetricsTest, ParsesSeriesAndSumsByLabels) {
  auto m = MetricScrape::Parse(kVllmText);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->Sum("vllm:request_success_total"), 40);
  EXPECT_EQ(m->Sum("vllm:request_success_total", {{"finished_reason", "stop"}}), 30);
  EXPECT_EQ(m->Sum("absent"), 0);
  auto escaped = MetricScrape::Parse("x{a=\"q\\\"uote, }\"} 1 1700000000000\ny 2e3\n");
  ASSERT_TRUE(escaped.ok());
  EXPECT_EQ(escaped->Sum("x", {{"a", "q\"uote, }"}}), 1);
  EXPECT_EQ(escaped->Sum("y"), 2000);
}

TEST(LiveMetricsTest, AnswersThatAreNotPrometheusAreRefused) {
  EXPECT_FALSE(MetricScrape::Parse("<!DOCTYPE html>\n<html><body>Not here</body></html>\n").ok());
  EXPECT_FALSE(MetricScrape::Parse("{\"detail\": \"Not Found\"}").ok());
  EXPECT_FALSE(MetricScrape::Parse("").ok());
  auto other = MetricScrape::Parse("process_cpu_seconds_total 3\n");
  ASSERT_TRUE(other.ok());
  auto v = ReadVllmState(*other);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("not a vLLM metrics endpoint"), std::string::npos);
  EXPECT_FALSE(ReadKvtierState(*other).ok());
}

TEST(LiveMetricsTest, VllmStateSharesAndRegime) {
  auto m = MetricScrape::Parse(kVllmText);
  ASSERT_TRUE(m.ok());
  auto v = ReadVllmState(*m);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->requests, 40);
  EXPECT_DOUBLE_EQ(v->MeanPrompt(), 250);
  EXPECT_NEAR(v->PromptQuantile(0.5), 200, 1e-9);
  EXPECT_NEAR(v->PromptQuantile(0.75), 350, 1e-9);
  EXPECT_TRUE(v->has_external);
  // 2,000 tokens from kvtier: 800 (in bytes, 10 per token) read from files, 1,200 from memory.
  KvtierState k{20000, 8000, 0, 0};
  HitShares h = ComputeHitShares(*v, k, 10);
  EXPECT_NEAR(h.gpu, 0.6, 1e-9);
  EXPECT_NEAR(h.memory, 0.12, 1e-9);
  EXPECT_NEAR(h.file, 0.08, 1e-9);
  EXPECT_NEAR(h.external_other, 0, 1e-9);
  EXPECT_NEAR(h.recompute, 0.2, 1e-9);
  HitShares without = ComputeHitShares(*v, std::nullopt, 10);
  EXPECT_NEAR(without.external_other, 0.2, 1e-9);
  // The connector serves 20 %: the GPU evicts; the mean prompt (250) against the payoff.
  EXPECT_EQ(ClassifyMeasuredRegime(*v, 100).regime, 3);
  EXPECT_EQ(ClassifyMeasuredRegime(*v, 1000).regime, 2);
  EXPECT_EQ(ClassifyMeasuredRegime(*v, std::nullopt).regime, 2);
  VllmState quiet = *v;
  quiet.external_hits = 10;  // 0.1 %
  EXPECT_EQ(ClassifyMeasuredRegime(quiet, 100).regime, 1);
  quiet.preemptions = 2;
  EXPECT_EQ(ClassifyMeasuredRegime(quiet, 100).regime, 3);
}

TEST(LiveMetricsTest, AWindowIsTheDifferenceOfTwoScrapes) {
  auto m = MetricScrape::Parse(kVllmText);
  auto v = ReadVllmState(*m);
  ASSERT_TRUE(v.ok());
  VllmState later = *v;
  later.prompt_tokens += 500;
  later.requests += 5;
  later.prompt_hist_sum += 500;
  later.prompt_hist_count += 5;
  VllmState d = Difference(later, *v, 10);
  EXPECT_EQ(d.prompt_tokens, 500);
  EXPECT_EQ(d.requests, 5);
  EXPECT_DOUBLE_EQ(d.MeanPrompt(), 100);
  EXPECT_EQ(d.window_s, 10);
  EXPECT_EQ(d.kv_cache_usage, 0.5);  // a gauge: the last value
}

TEST(LiveMetricsTest, HttpGetAgainstARealServer) {
  httplib::Server server;
  server.Get("/metrics", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(kVllmText, "text/plain; version=0.0.4");
  });
  const int port = server.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread t([&] { server.listen_after_bind(); });
  server.wait_until_ready();
  const std::string base = "http://127.0.0.1:" + std::to_string(port);
  auto body = HttpGet(base, 5);  // no path: /metrics
  ASSERT_TRUE(body.ok()) << body.status().message();
  EXPECT_NE(body->find("vllm:prompt_tokens_total"), std::string::npos);
  auto missing = HttpGet(base + "/nothing", 5);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("HTTP 404"), std::string::npos);
  server.stop();
  t.join();
  // Nobody listens there now.
  auto closed = HttpGet(base + "/metrics", 2);
  ASSERT_FALSE(closed.ok());
  EXPECT_NE(closed.status().message().find("did not answer"), std::string::npos);
  EXPECT_FALSE(HttpGet("https://example.invalid/metrics", 1).ok());
  EXPECT_FALSE(HttpGet("ftp://x/metrics", 1).ok());
}

}  // namespace
}  // namespace kvtier::planner
