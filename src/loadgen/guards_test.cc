#include "loadgen/guards.h"

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "testing/temp_dir.h"

namespace kvtier::loadgen {
namespace {

TEST(CacheDirGuard, RefusesAWarmDirectoryUnlessAllowed) {
  testing::TempDir dir("cache");
  std::vector<std::string> warnings;
  EXPECT_TRUE(CheckCacheDirIsCold(dir.path(), false, &warnings).ok());
  EXPECT_EQ(CheckCacheDirIsCold(dir.Sub("missing"), false, &warnings).code(),
            StatusCode::kInvalidArgument);

  // What a kvtier file tier writes when it opens an empty directory is no warm cache.
  std::filesystem::create_directories(dir.Sub("ns/ab/cd"));
  std::ofstream(dir.Sub("kvtier-cache.json")) << "{}";
  std::ofstream(dir.Sub("ns/namespace.json")) << "{}";
  EXPECT_TRUE(CheckCacheDirIsCold(dir.path(), false, &warnings).ok());
  std::ofstream(dir.Sub("ns/ab/cd/0123abcd")) << std::string(4096, 'k');
  Status refused = CheckCacheDirIsCold(dir.path(), false, &warnings);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("1 files"), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find("--allow-warm-cache"), std::string::npos);
  EXPECT_TRUE(warnings.empty());

  EXPECT_TRUE(CheckCacheDirIsCold(dir.path(), true, &warnings).ok());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("allowed"), std::string::npos);
}

TEST(ContextWindowGuard, ChecksTheLastRoundNotTheAverage) {
  WorkloadConfig c;
  c.num_rounds = 10;
  c.system_prompt_len = 1000;
  c.user_history_len = 2000;
  c.answer_len = 100;
  const int64_t peak = EstimatePeakPromptTokens(c);
  EXPECT_GT(peak, 3000 + 9 * 100);
  EXPECT_TRUE(CheckContextWindow(c, 0, 1.0).ok());  // unknown window: nothing to check
  const int64_t with_margin = static_cast<int64_t>(static_cast<double>(peak) * 1.05);
  EXPECT_TRUE(CheckContextWindow(c, with_margin + c.answer_len, 1.0).ok());
  // The first round fits, the last does not.
  const int64_t window = with_margin + c.answer_len - 1;
  EXPECT_LT(EstimatePromptTokens(c, 1), window);
  Status s = CheckContextWindow(c, window, 1.0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("context window"), std::string::npos);
  // A tokenizer that counts more tokens than estimated tips it over too.
  EXPECT_FALSE(CheckContextWindow(c, with_margin + c.answer_len, 1.2).ok());
}

TEST(SaturationWarning, FiresWhenTheServerCannotKeepUp) {
  WorkloadConfig c;
  c.num_users = 4;
  c.num_rounds = 5;
  c.qps = 2;  // a user asks every 2 s; the pacing sends 2 x 5 / 4 = 2.5 requests/s
  Summary s;
  s.config_qps = 2;
  s.actual_qps = 2.4;
  s.sent = 100;
  EXPECT_EQ(SaturationWarning(s, c), "");
  s.actual_qps = 2.2;  // above config QPS, but under 90 % of what the pacing sends
  EXPECT_NE(SaturationWarning(s, c).find("saturated"), std::string::npos);
  s.actual_qps = 2.4;
  s.held_back = 20;
  s.median_latency = 3.5;
  const std::string held = SaturationWarning(s, c);
  EXPECT_NE(held.find("20 of 100 sends held back"), std::string::npos) << held;
  EXPECT_NE(held.find("longer than a user's gap of 2.000 s"), std::string::npos) << held;
}

TEST(SaturationWarning, DoesNotJudgeARunTooShortToTell) {
  WorkloadConfig c;  // 10 users, 5 rounds, 0.5 qps: a user asks every 20 s, 0.625 requests/s
  Summary s;
  s.config_qps = 0.5;
  s.seconds = 3;
  s.sent = 1;  // 1 instead of 1.9: rounding, not saturation
  s.actual_qps = 1.0 / 3;
  EXPECT_EQ(SaturationWarning(s, c), "");
  const std::string note = ShortRunNote(s, c);
  EXPECT_NE(note.find("too few to check the pacing"), std::string::npos) << note;
  EXPECT_NE(note.find("--time 16"), std::string::npos) << note;
  // Long enough, and as slow: judged.
  s.seconds = 60;
  s.sent = 20;
  s.actual_qps = 20.0 / 60;
  EXPECT_NE(SaturationWarning(s, c).find("saturated"), std::string::npos);
  EXPECT_EQ(ShortRunNote(s, c), "");
}

}  // namespace
}  // namespace kvtier::loadgen
