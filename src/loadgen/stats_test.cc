#include "loadgen/stats.h"

#include <filesystem>
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

TEST(SummarizeRun, CountsTheDrainedRequestsInTheLatenciesButNotTheRates) {
  std::vector<RequestRecord> records = {
      Rec(100.0, 0.1, 0.9, 1000, 10),  // finishes at 101
      Rec(104.0, 0.2, 0.8, 1000, 10),  // finishes at 105
      Rec(109.0, 4.0, 1.0, 1000, 10),  // sent in the window, drained: finishes at 114
  };
  std::vector<double> launches = {100.0, 104.0, 109.0, 109.5};
  std::vector<FailureRecord> failures = {{103, "connect"}, {112, "early_close"}};
  std::vector<UnfinishedRecord> unfinished = {{7, 2, 109.5, 20.5, -1}};
  Summary s = SummarizeRun(records, launches, failures, unfinished, 100, 110, 0.5);
  EXPECT_EQ(s.sent, 4);
  EXPECT_EQ(s.finished, 2);  // finished in the window: the rates
  EXPECT_DOUBLE_EQ(s.processing_speed, 0.2);
  EXPECT_EQ(s.drained, 1);
  EXPECT_NEAR(s.mean_ttft, (0.1 + 0.2 + 4.0) / 3, 1e-12);  // the drained one counts
  EXPECT_DOUBLE_EQ(s.median_ttft, 0.2);
  EXPECT_EQ(s.failed, 2);  // the one during the drain too
  EXPECT_EQ(s.unfinished, 1);
  EXPECT_EQ(s.unfinished_without_first_token, 1);
  EXPECT_DOUBLE_EQ(s.unfinished_longest_wait, 20.5);
  const std::string text = FormatSummary(s, "t");
  EXPECT_NE(text.find("drained"), std::string::npos) << text;
  EXPECT_NE(text.find("Unfinished"), std::string::npos) << text;
}

TEST(ReadCsv, ReadsWhatWriteCsvWroteAndLmcachesColumnOrder) {
  kvtier::testing::TempDir dir("csv");
  std::vector<RequestRecord> records = {Rec(100.0, 0.1, 0.9, 1000, 10), Rec(101.0, 0.3, 1.7, 2000, 20)};
  records[1].user_id = 7;
  records[1].question_id = 3;
  ASSERT_TRUE(WriteCsv(dir.Sub("a.csv"), records).ok());
  auto back = ReadCsv(dir.Sub("a.csv"));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ((*back)[1].user_id, 7);
  EXPECT_EQ((*back)[1].question_id, 3);
  EXPECT_EQ((*back)[1].prompt_tokens, 2000);
  EXPECT_NEAR((*back)[1].finish_time, 103.0, 1e-6);

  // Columns in another order, with CRLF line ends, as pandas may write them.
  std::ofstream(dir.Sub("b.csv")) << "user_id,question_id,prompt_tokens,generation_tokens,ttft,"
                                     "generation_time,launch_time,finish_time\r\n"
                                     "1,1,500,10,0.5,1.5,10.0,12.0\r\n"
                                     "2,1,700,10,1.5,0.5,11.0,13.0\r\n";
  auto lm = ReadCsv(dir.Sub("b.csv"));
  ASSERT_TRUE(lm.ok()) << lm.status().ToString();
  auto s = SummarizeCsv(*lm);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->finished, 2);
  EXPECT_DOUBLE_EQ(s->seconds, 3.0);  // first launch to last finish
  EXPECT_DOUBLE_EQ(s->mean_ttft, 1.0);
  EXPECT_DOUBLE_EQ(s->input_tokens_per_s, 400.0);

  std::ofstream(dir.Sub("bad.csv")) << CsvHeader() << "\n1,2,x,4,5,6,7,8\n";
  auto bad = ReadCsv(dir.Sub("bad.csv"));
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("line 2"), std::string::npos) << bad.status().message();
  std::ofstream(dir.Sub("cols.csv")) << "ttft,user_id\n0.1,1\n";
  EXPECT_EQ(ReadCsv(dir.Sub("cols.csv")).status().code(), StatusCode::kInvalidArgument);
  std::ofstream(dir.Sub("empty.csv")) << CsvHeader() << "\n";
  auto none = ReadCsv(dir.Sub("empty.csv"));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(SummarizeCsv(*none).ok());
  EXPECT_FALSE(ReadCsv(dir.Sub("missing.csv")).ok());
}

TEST(CheckWritable, RefusesAMissingDirectoryAndADirectory) {
  kvtier::testing::TempDir dir("w");
  EXPECT_TRUE(CheckWritable(dir.Sub("x.csv"), "--output").ok());
  EXPECT_FALSE(std::filesystem::exists(dir.Sub("x.csv.tmp")));
  EXPECT_FALSE(std::filesystem::exists(dir.Sub("x.csv")));
  Status s = CheckWritable(dir.Sub("no/such/x.csv"), "--output");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--output"), std::string::npos);
  EXPECT_FALSE(CheckWritable(dir.path(), "--output").ok());
}

}  // namespace
}  // namespace kvtier::loadgen
