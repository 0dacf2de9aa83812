#include "planner/request_log.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>
#include <fstream>

#include "testing/temp_dir.h"

namespace kvtier::planner {
namespace {

using Outcome = LineParser::Outcome;

LineParser Parser(LogFormat f = LogFormat::kAuto, FieldMapping m = {}) {
  auto p = LineParser::Create(f, std::move(m));
  EXPECT_TRUE(p.ok());
  return std::move(p).value();
}

void Write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

struct Read {
  LogFileCounts counts;
  std::vector<RequestRecord> records;
};

Read ReadAll(const std::string& path, LogFormat f = LogFormat::kAuto, FieldMapping m = {}) {
  Read r;
  auto counts = ReadRequestLog(path, f, m, [&](const RequestRecord& rec) { r.records.push_back(rec); });
  EXPECT_TRUE(counts.ok()) << counts.status().message();
  if (counts.ok()) r.counts = *counts;
  return r;
}

TEST(RequestLogTest, OpenAiResponsesAndUsageObjects) {
  LineParser p = Parser();
  RequestRecord r;
  std::string why;
  // A chat completion as the API returns it, with the request's user added by a proxy.
  ASSERT_EQ(p.Parse(R"({"id":"chatcmpl-1","object":"chat.completion","created":1735689600,)"
                    R"("model":"m","user":"alice","usage":{"prompt_tokens":1200,)"
                    R"("completion_tokens":80,"total_tokens":1280}})",
                    &r, &why),
            Outcome::kRecord);
  EXPECT_EQ(p.format(), LogFormat::kJsonLines);
  EXPECT_EQ(r.prompt_tokens, 1200u);
  EXPECT_TRUE(r.has_completion);
  EXPECT_EQ(r.completion_tokens, 80u);
  EXPECT_EQ(r.conversation, "alice");
  EXPECT_DOUBLE_EQ(r.time_s, 1735689600);
  // A bare usage object.
  ASSERT_EQ(p.Parse(R"({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12})", &r, &why),
            Outcome::kRecord);
  EXPECT_EQ(r.prompt_tokens, 10u);
  EXPECT_TRUE(r.conversation.empty());
  EXPECT_TRUE(std::isnan(r.time_s));
  // The Responses API's names, and a time in milliseconds.
  ASSERT_EQ(p.Parse(R"({"usage":{"input_tokens":33,"output_tokens":4},"timestamp":1735689600500})",
                    &r, &why),
            Outcome::kRecord);
  EXPECT_EQ(r.prompt_tokens, 33u);
  EXPECT_EQ(r.completion_tokens, 4u);
  EXPECT_DOUBLE_EQ(r.time_s, 1735689600.5);
  // An OpenAI batch output line.
  ASSERT_EQ(p.Parse(R"({"custom_id":"x","response":{"status_code":200,"body":{"created":5,)"
                    R"("usage":{"prompt_tokens":7,"completion_tokens":1}}}})",
                    &r, &why),
            Outcome::kRecord);
  EXPECT_EQ(r.prompt_tokens, 7u);
  EXPECT_DOUBLE_EQ(r.time_s, 5);
}

TEST(RequestLogTest, AProxyLogByAMapping) {
  auto m = ParseFieldMapping("prompt=tokens.in, user=meta.session ,time=startTime,round=turn_no");
  ASSERT_TRUE(m.ok());
  LineParser p = Parser(LogFormat::kJsonLines, *m);
  RequestRecord r;
  std::string why;
  ASSERT_EQ(p.Parse(R"({"tokens":{"in":"512"},"meta":{"session":42},)"
                    R"("startTime":"2025-01-01T00:00:10.25+01:00","turn_no":3})",
                    &r, &why),
            Outcome::kRecord)
      << why;
  EXPECT_EQ(r.prompt_tokens, 512u);
  EXPECT_EQ(r.conversation, "42");
  EXPECT_DOUBLE_EQ(r.time_s, 1735689600 + 10.25 - 3600);
  EXPECT_EQ(r.round, 3);
  // The mapped field missing: malformed, and says which.
  EXPECT_EQ(p.Parse(R"({"usage":{"prompt_tokens":5}})", &r, &why), Outcome::kMalformed);
  EXPECT_NE(why.find("tokens.in"), std::string::npos);
  EXPECT_FALSE(ParseFieldMapping("tokens").ok());
  EXPECT_FALSE(ParseFieldMapping("colour=x").ok());
}

TEST(RequestLogTest, TimeStamps) {
  EXPECT_DOUBLE_EQ(ParseTimestamp("2025-01-01T00:00:00Z"), 1735689600);
  EXPECT_DOUBLE_EQ(ParseTimestamp("2025-01-01 00:00:01.5"), 1735689601.5);
  EXPECT_DOUBLE_EQ(ParseTimestamp("2025-01-01T02:00:00+0200"), 1735689600);
  EXPECT_DOUBLE_EQ(ParseTimestamp("1735689600123456"), 1735689600.123456);
  EXPECT_TRUE(std::isnan(ParseTimestamp("yesterday")));
  EXPECT_TRUE(std::isnan(ParseTimestamp("2025-13-01T00:00:00")));
}

TEST(RequestLogTest, VllmRequestLogs) {
  LineParser p = Parser();
  RequestRecord r;
  std::string why;
  // Other lines of the server's log are not requests.
  EXPECT_EQ(p.Parse("INFO 03-01 10:00:00 [api_server.py:1] vLLM API server version 0.9", &r, &why),
            Outcome::kIgnored);
  EXPECT_EQ(p.format(), LogFormat::kVllm);
  // vLLM up to 0.10: the INFO line carries the ids (the prompt text may hold anything).
  ASSERT_EQ(p.Parse("INFO 03-01 10:00:01 [logger.py:43] Received request chatcmpl-a: prompt: "
                    "'say prompt_token_ids: [9]', params: SamplingParams(n=1), prompt_token_ids: "
                    "[1, 2, 3, 4], prompt_embeds shape: None, lora_request: None.",
                    &r, &why),
            Outcome::kRecord)
      << why;
  EXPECT_EQ(r.prompt_tokens, 4u);
  EXPECT_EQ(r.round, 1);
  const std::string first = r.conversation;
  EXPECT_FALSE(first.empty());
  // Newer vLLM: at DEBUG, "Request ... details"; its next round extends the prompt.
  ASSERT_EQ(p.Parse("(APIServer pid=7) DEBUG 03-01 10:00:05.250 [logger.py:50] Request "
                    "chatcmpl-b details: prompt: 'x', prompt_token_ids: [1, 2, 3, 4, 5, 6], "
                    "prompt_embeds shape: None.",
                    &r, &why),
            Outcome::kRecord)
      << why;
  EXPECT_EQ(r.prompt_tokens, 6u);
  EXPECT_EQ(r.conversation, first);
  EXPECT_EQ(r.round, 2);
  EXPECT_DOUBLE_EQ(r.time_s - std::floor(r.time_s), 0.25);
  // Another conversation: a different start.
  ASSERT_EQ(p.Parse("DEBUG 03-01 10:00:06 [logger.py:50] Request c details: prompt: 'y', "
                    "prompt_token_ids: [1, 2, 7], prompt_embeds shape: None.",
                    &r, &why),
            Outcome::kRecord);
  EXPECT_NE(r.conversation, first);
  EXPECT_EQ(r.round, 1);
  // Newer INFO lines have no token count: counted, not records.
  EXPECT_EQ(p.Parse("INFO 03-01 10:00:06 [logger.py:60] Received request d: params: "
                    "SamplingParams(n=1), lora_request: None.",
                    &r, &why),
            Outcome::kIgnored);
  EXPECT_EQ(p.requests_without_tokens(), 1u);
  ASSERT_EQ(p.Parse("DEBUG 03-01 10:00:07 [logger.py:50] Request e details: prompt_len: 40, "
                    "prompt_token_ids_len: 12, prompt_embeds shape: None.",
                    &r, &why),
            Outcome::kRecord);
  EXPECT_EQ(r.prompt_tokens, 12u);
  // Cut short mid-list.
  EXPECT_EQ(p.Parse("DEBUG 03-01 10:00:08 [logger.py:50] Request f details: prompt: 'z', "
                    "prompt_token_ids: [1, 2, 3",
                    &r, &why),
            Outcome::kMalformed);
}

TEST(RequestLogTest, BenchQaAndLmcacheCsvByColumnName) {
  testing::TempDir dir;
  // kvtier bench qa's columns.
  Write(dir.Sub("qa.csv"),
        "prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,launch_time,"
        "finish_time\n"
        "1000,100,0.2,1.0,1,1,1735689600.0,1735689601.2\n"
        "1230,100,0.1,1.0,1,2,1735689610.0,1735689611.1\n");
  Read a = ReadAll(dir.Sub("qa.csv"));
  EXPECT_EQ(a.counts.format, LogFormat::kCsv);
  ASSERT_EQ(a.records.size(), 2u);
  EXPECT_EQ(a.records[1].prompt_tokens, 1230u);
  EXPECT_EQ(a.records[1].completion_tokens, 100u);
  EXPECT_EQ(a.records[1].conversation, "1");
  EXPECT_EQ(a.records[1].round, 2);
  EXPECT_DOUBLE_EQ(a.records[1].time_s, 1735689610.0);
  EXPECT_EQ(a.counts.ignored, 1u);  // the header
  // LMCache's multi-round QA script writes the same names in its own order, Windows line ends.
  Write(dir.Sub("lmcache.csv"),
        "user_id,question_id,prompt_tokens,generation_tokens,ttft,generation_time,launch_time,"
        "finish_time\r\n"
        "7,3,2000,50,0.3,0.5,100.5,101.3\r\n");
  Read b = ReadAll(dir.Sub("lmcache.csv"));
  ASSERT_EQ(b.records.size(), 1u);
  EXPECT_EQ(b.records[0].prompt_tokens, 2000u);
  EXPECT_EQ(b.records[0].conversation, "7");
  EXPECT_EQ(b.records[0].round, 3);
  // Any CSV by a mapping, with quoted fields.
  Write(dir.Sub("other.csv"), "when,who,\"in, tokens\",out\n\"2025-01-01 00:00:00\",\"bob\",77,3\n");
  auto m = ParseFieldMapping("prompt=in, tokens");
  EXPECT_FALSE(m.ok());  // a comma inside a name cannot be mapped...
  m = ParseFieldMapping("time=when,user=who,completion=out");
  ASSERT_TRUE(m.ok());
  m->prompt = "in, tokens";  // ...but the mapping itself can hold one
  Read c = ReadAll(dir.Sub("other.csv"), LogFormat::kCsv, *m);
  ASSERT_EQ(c.records.size(), 1u);
  EXPECT_EQ(c.records[0].prompt_tokens, 77u);
  EXPECT_EQ(c.records[0].conversation, "bob");
  EXPECT_DOUBLE_EQ(c.records[0].time_s, 1735689600);
}

TEST(RequestLogTest, ACsvWithoutAPromptColumnIsRefusedWithTheFix) {
  testing::TempDir dir;
  Write(dir.Sub("x.csv"), "a,b,c\n1,2,3\n");
  auto r = ReadRequestLog(dir.Sub("x.csv"), LogFormat::kCsv, {}, [](const RequestRecord&) {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--log-fields prompt="), std::string::npos);
}

TEST(RequestLogTest, MalformedLinesAreCountedNeverFatal) {
  testing::TempDir dir;
  Write(dir.Sub("mixed.jsonl"),
        "{\"usage\":{\"prompt_tokens\":10}}\n"
        "not json at all\n"
        "\n"
        "{\"usage\":{\"prompt_tokens\":-3}}\n"
        "[1,2]\n"
        "{\"model\":\"m\"}\n"
        "{\"usage\":{\"prompt_tokens\":20}}\n"
        "{\"usage\":{\"prompt_tok");  // cut mid-line: the last line of a log being written
  Read r = ReadAll(dir.Sub("mixed.jsonl"));
  EXPECT_EQ(r.records.size(), 2u);
  EXPECT_EQ(r.counts.malformed, 5u);
  EXPECT_EQ(r.counts.ignored, 1u);
  EXPECT_TRUE(r.counts.truncated);
  ASSERT_FALSE(r.counts.malformed_examples.empty());
  EXPECT_NE(r.counts.malformed_examples[0].find("mixed.jsonl:2: not JSON"), std::string::npos);
  // CSV rows with the wrong number of fields or a non-number.
  Write(dir.Sub("bad.csv"), "prompt_tokens,user_id\n5,a\n6\nsix,b\n\"7,c\n8,d\n");
  Read c = ReadAll(dir.Sub("bad.csv"));
  EXPECT_EQ(c.records.size(), 2u);
  EXPECT_EQ(c.counts.malformed, 3u);
}

TEST(RequestLogTest, GzipIsReadAsIsAndACutStreamKeepsWhatItHad) {
  testing::TempDir dir;
  std::string text = "prompt_tokens,user_id\n";
  // Pseudo-random values, so that half the compressed bytes hold about half the lines.
  uint64_t x = 12345;
  for (int i = 0; i < 20000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    text += std::to_string(100 + (x >> 33) % 100000) + ",u" + std::to_string((x >> 20) % 1000) + "\n";
  }
  // Named .log, not .gz: the magic bytes decide.
  gzFile gz = gzopen(dir.Sub("qa.log").c_str(), "wb");
  ASSERT_NE(gz, nullptr);
  ASSERT_EQ(gzwrite(gz, text.data(), static_cast<unsigned>(text.size())), static_cast<int>(text.size()));
  gzclose(gz);
  Read r = ReadAll(dir.Sub("qa.log"));
  EXPECT_TRUE(r.counts.gzip);
  EXPECT_EQ(r.records.size(), 20000u);
  EXPECT_FALSE(r.counts.truncated);
  // Cut the compressed file in half.
  std::ifstream in(dir.Sub("qa.log"), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Write(dir.Sub("cut.gz"), bytes.substr(0, bytes.size() / 2));
  Read c = ReadAll(dir.Sub("cut.gz"));
  EXPECT_TRUE(c.counts.truncated);
  EXPECT_GT(c.records.size(), 1000u);
  EXPECT_LT(c.records.size(), 20000u);
}

TEST(RequestLogTest, MissingOrUnreadableFilesAreErrors) {
  testing::TempDir dir;
  auto missing = ReadRequestLog(dir.Sub("nope.jsonl"), LogFormat::kAuto, {},
                                [](const RequestRecord&) {});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope.jsonl"), std::string::npos);
  auto directory = ReadRequestLog(dir.path(), LogFormat::kAuto, {}, [](const RequestRecord&) {});
  ASSERT_FALSE(directory.ok());
  EXPECT_NE(directory.status().message().find("directory"), std::string::npos);
  EXPECT_FALSE(ParseLogFormat("xml").ok());
}

}  // namespace
}  // namespace kvtier::planner
