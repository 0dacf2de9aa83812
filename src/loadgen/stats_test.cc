#include "loadgen/stats.h"

#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/temp_dir.h"

namespace kvtier::loadgen {
namespace {

TEST(Quantile, InterpolatesLikeNumpy) {
  EXPECT_DOUBLE_EQ(Quantile({4, 1, 3, 2}, 0.5), 2.5);
  EXPECT_DOUBLE_EQ(Quantile({1, 2, 3, 4}, 0.9), 3.7);
  EXPECT_DOUBLE_EQ(Quantile({5}, 0.9), 5);
  EXPECT_DOUBLE_EQ(Quantile({}, 0.5), 0);
}

RequestRecord Rec(double launch, double ttft, double gen_time, int64_t prompt, int64_t gen) {
  RequestRecord r;
  r.launch_time = launch;
  r.ttft = ttft;
  r.generation_time = gen_time;
  r.finish_time = launch + ttft + gen_time;
  r.prompt_tokens = prompt;
  r.generation_tokens = gen;
  return r;
}

TEST(Summarize, DoesTheArithmeticOverTheWindow) {
  std::vector<RequestRecord> records = {
      Rec(100.0, 0.1, 0.9, 1000, 10),   // finishes at 101
      Rec(101.0, 0.3, 1.7, 2000, 20),   // finishes at 103
      Rec(102.0, 0.2, 1.8, 3000, 30),   // finishes at 104
      Rec(108.0, 0.5, 2.5, 9000, 90),   // finishes at 111: outside the window
  };
  std::vector<double> launches = {100.0, 101.0, 102.0, 103.0, 108.0, 109.5, 110.5};
  std::vector<FailureRecord> failures = {{103.5, "early_close"}, {104.5, "http_status"},
                                         {120, "http_status"}};
  Summary s = Summarize(records, launches, failures, 100.0, 110.0, 2, 0.5);
  EXPECT_DOUBLE_EQ(s.seconds, 10.0);
  EXPECT_EQ(s.sent, 6);  // launches in [100, 110]
  EXPECT_DOUBLE_EQ(s.actual_qps, 0.6);
  EXPECT_EQ(s.finished, 3);
  EXPECT_DOUBLE_EQ(s.processing_speed, 0.3);
  EXPECT_EQ(s.on_the_fly, 2);
  EXPECT_DOUBLE_EQ(s.config_qps, 0.5);
  EXPECT_DOUBLE_EQ(s.input_tokens_per_s, 600.0);
  EXPECT_DOUBLE_EQ(s.output_tokens_per_s, 6.0);
  // mean of 10/0.9, 20/1.7, 30/1.8
  EXPECT_NEAR(s.generation_tokens_per_request_s, (10 / 0.9 + 20 / 1.7 + 30 / 1.8) / 3, 1e-9);
  EXPECT_NEAR(s.mean_ttft, 0.2, 1e-12);
  EXPECT_NEAR(s.median_ttft, 0.2, 1e-12);
  EXPECT_NEAR(s.p90_ttft, 0.28, 1e-12);
  EXPECT_EQ(s.failed, 2);
  EXPECT_EQ(s.failures["early_close"], 1);
  EXPECT_EQ(s.failures["http_status"], 1);
  const std::string text = FormatSummary(s, "Performance summary");
  for (const char* label : {"Config QPS", "Actual QPS", "Processing speed", "Requests on-the-fly",
                            "Input tokens per second", "Output tokens per second",
                            "Average generation throughput", "Average TTFT", "Median TTFT",
                            "P90 TTFT", "Failed requests"}) {
    EXPECT_NE(text.find(label), std::string::npos) << label;
  }
  auto j = nlohmann::json::parse(SummaryToJson(s));
  EXPECT_DOUBLE_EQ(j["processing_speed_rps"].get<double>(), 0.3);
  EXPECT_DOUBLE_EQ(j["p90_ttft_s"].get<double>(), s.p90_ttft);
}

TEST(Csv, HasExactlyTheBenchmarkColumns) {
  EXPECT_EQ(CsvHeader(),
            "prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,launch_time,"
            "finish_time");
  RequestRecord r = Rec(1700000000.25, 0.125, 1.5, 1234, 56);
  r.user_id = 7;
  r.question_id = 3;
  EXPECT_EQ(CsvRow(r), "1234,56,0.125000,1.500000,7,3,1700000000.250000,1700000001.875000");

  testing::TempDir dir("csv");
  const std::string path = dir.Sub("summary.csv");
  ASSERT_TRUE(WriteCsv(path, {r, r}).ok());
  std::ifstream in(path);
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(in, line)) lines.push_back(line);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], CsvHeader());
  EXPECT_EQ(lines[2], CsvRow(r));
  EXPECT_FALSE(WriteCsv(dir.Sub("no/such/dir/x.csv"), {r}).ok());
}

}  // namespace
}  // namespace kvtier::loadgen
