#include "planner/traffic.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>

#include "testing/temp_dir.h"

namespace kvtier::planner {
namespace {

// bench qa's pacing: `users` conversations at once, each of `rounds` questions `gap` seconds
// apart, a new one joining every (rounds - 1) x gap / users seconds; each round's prompt grows by
// the answer and the next question.
struct Synthetic {
  int users = 8, rounds = 5;
  double gap = 10;
  uint64_t first_prompt = 3000, question = 50, answer = 100;
  double start = 1735689600;
  // Calls emit(record) in time order for `conversations` conversations.
  template <typename F>
  void Run(int conversations, F emit) const {
    const double join = (rounds - 1) * gap / users;
    // Conversations overlap: emit request by request in time order with a small merge.
    std::vector<std::pair<double, RequestRecord>> pending;
    for (int c = 0; c < conversations; ++c) {
      const double t0 = start + c * join;
      for (int r = 0; r < rounds; ++r) {
        RequestRecord rec;
        rec.time_s = t0 + r * gap;
        rec.prompt_tokens = first_prompt + r * (question + answer) + (c % 3);
        rec.completion_tokens = answer;
        rec.has_completion = true;
        rec.conversation = "user-" + std::to_string(c);
        rec.round = r + 1;
        pending.emplace_back(rec.time_s, std::move(rec));
      }
    }
    std::stable_sort(pending.begin(), pending.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [t, rec] : pending) emit(rec);
  }
};

TEST(TrafficTest, RecoversUsersRoundsGrowthAndContext) {
  Synthetic s;
  TrafficAccumulator acc;
  s.Run(200, [&](const RequestRecord& r) { acc.Add(r); });
  TrafficSummary sum = acc.Finish();
  EXPECT_EQ(sum.records, 1000u);
  EXPECT_EQ(sum.conversations, 200u);
  EXPECT_EQ(sum.rounds.median, 5u);
  EXPECT_EQ(sum.growth_per_round.median, 150u);
  EXPECT_NEAR(static_cast<double>(sum.first_prompt.median), 3001, 1);
  EXPECT_EQ(sum.completion.median, 100u);
  ASSERT_TRUE(sum.timed);
  // Steady state holds 8 conversations (ramp-up and ramp-down are a small share of the log).
  EXPECT_NEAR(sum.active_busiest, 8, 0.5);
  // 5 requests every 5 s.
  EXPECT_NEAR(sum.busiest_rate_rps, 1.0, 0.05);
  DerivedWorkload w = DeriveWorkload(sum, 0, 100);
  EXPECT_EQ(w.users, 8u);
  EXPECT_EQ(w.rounds, 5u);
  EXPECT_EQ(w.answer_tokens, 100u);
  EXPECT_EQ(w.question_tokens, 50u);
  // qps as the planner and bench qa mean it: sends x (rounds - 1) / rounds.
  EXPECT_NEAR(w.qps, 0.8, 0.05);
  // The peak is the last prompt plus its answer; context = peak - rounds x (question + answer).
  EXPECT_NEAR(static_cast<double>(w.context_median), 3000 + 4 * 150 + 100 - 5 * 150 + 1, 2);
  // With a known system prompt, the context is what is left of the first prompt.
  EXPECT_EQ(DeriveWorkload(sum, 1000, 100).context_median + 1000, w.context_median);
}

TEST(TrafficTest, ConversationsCutByTheLogsEndDoNotCountAsShort) {
  Synthetic s;
  s.users = 4;
  TrafficAccumulator acc;
  int kept = 0;
  // Drop the last requests after a time: the conversations then in progress are cut.
  const double cut = s.start + 30 * (s.rounds - 1) * s.gap / s.users;
  s.Run(40, [&](const RequestRecord& r) {
    if (r.time_s < cut) {
      acc.Add(r);
      ++kept;
    }
  });
  TrafficSummary sum = acc.Finish();
  EXPECT_LT(sum.complete_conversations, sum.conversations);
  EXPECT_EQ(sum.rounds.median, 5u);
  EXPECT_EQ(sum.rounds.max, 5u);
}

TEST(TrafficTest, AConversationPastTheContextWindowIsFlagged) {
  TrafficOptions o;
  o.context_window = 4096;
  TrafficAccumulator acc(o);
  for (int r = 1; r <= 12; ++r) {
    RequestRecord rec;
    rec.conversation = "long-one";
    rec.round = r;
    rec.prompt_tokens = 400u * r;
    rec.completion_tokens = 100;
    rec.has_completion = true;
    rec.time_s = 1000 + 10 * r;
    acc.Add(rec);
  }
  RequestRecord short_one;
  short_one.conversation = "short";
  short_one.prompt_tokens = 500;
  short_one.time_s = 1005;
  acc.Add(short_one);
  TrafficSummary sum = acc.Finish();
  EXPECT_EQ(sum.window_overflows, 1u);
  ASSERT_EQ(sum.overflow_examples.size(), 1u);
  EXPECT_EQ(sum.overflow_examples[0].conversation, "long-one");
  EXPECT_EQ(sum.overflow_examples[0].peak_tokens, 4900u);
  EXPECT_EQ(sum.overflow_examples[0].round, 12);
  const std::string text = FormatTraffic(sum);
  EXPECT_NE(text.find("WARNING: 1 conversations exceed the context window of 4,096"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("'long-one' 4,900 tokens at round 12"), std::string::npos) << text;
}

TEST(TrafficTest, LoneRequestsGiveQuantilesAndOneRoundConversations) {
  TrafficAccumulator acc;
  for (uint64_t i = 1; i <= 1000; ++i) {
    RequestRecord r;
    r.prompt_tokens = i;
    acc.Add(r);
  }
  TrafficSummary sum = acc.Finish();
  EXPECT_EQ(sum.prompt.median, 500u);
  EXPECT_EQ(sum.prompt.p90, 900u);
  EXPECT_EQ(sum.prompt.p99, 990u);
  EXPECT_EQ(sum.prompt.max, 1000u);
  EXPECT_FALSE(sum.timed);
  DerivedWorkload w = DeriveWorkload(sum, 0, 100);
  EXPECT_EQ(w.rounds, 1u);
  EXPECT_EQ(w.qps, 0);
  EXPECT_FALSE(w.notes.empty());
  EXPECT_LT(w.context_median, w.context_p90);
  EXPECT_LT(w.context_p90, w.context_peak);
  const std::string plot = ContextPlot(sum, 700, 300, "cpu");
  EXPECT_NE(plot.find("<E"), std::string::npos) << plot;
  EXPECT_NE(plot.find("<P"), std::string::npos) << plot;
}

TEST(TrafficTest, BusiestAndTypicalHours) {
  TrafficAccumulator acc;
  // Ten hours at 1 request every 10 s, one of them at 1 every 2 s.
  const double t0 = 1735689600;
  for (int h = 0; h < 10; ++h) {
    const double step = h == 6 ? 2 : 10;
    for (double t = 0; t < 3600; t += step) {
      RequestRecord r;
      r.prompt_tokens = 100;
      r.time_s = t0 + h * 3600 + t;
      acc.Add(r);
    }
  }
  TrafficSummary sum = acc.Finish();
  ASSERT_TRUE(sum.timed);
  EXPECT_DOUBLE_EQ(sum.window_s, 3600);
  EXPECT_NEAR(sum.busiest_rate_rps, 0.5, 0.01);
  EXPECT_NEAR(sum.busiest_start_s, t0 + 6 * 3600, 5);
  EXPECT_NEAR(sum.typical_rate_rps, 0.1, 0.005);
}

long MaxRssKiB() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// A week of a busy server is millions of lines: 2 million records stream through in bounded
// memory. The bound: the process's peak RSS grows by less than 64 MiB while it reads a file of
// about 110 MB, and the accumulator never holds more than 16 MiB. Under AddressSanitizer the RSS
// bound is not checked: its quarantine keeps up to 256 MiB of freed blocks resident, and every
// parsed line frees some.
TEST(TrafficTest, TwoMillionRecordsStreamInBoundedMemory) {
  testing::TempDir dir;
  const std::string path = dir.Sub("big.csv");
  constexpr int kConversations = 400000, kRounds = 5;
  {
    FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("prompt_tokens,generation_tokens,ttft,generation_time,user_id,question_id,"
               "launch_time,finish_time\n",
               f);
    Synthetic s;  // 8 users, 5 rounds 10 s apart: 1 request a second for 23 days
    const double join = (s.rounds - 1) * s.gap / s.users;
    // Emitted in time order without holding them: request r of conversation c is at
    // c x join + r x gap, and gap is a whole number of joins.
    const int per_gap = static_cast<int>(s.gap / join);
    for (long slot = 0; slot < static_cast<long>(kConversations) + per_gap * kRounds; ++slot) {
      for (int r = kRounds - 1; r >= 0; --r) {
        const long c = slot - static_cast<long>(r) * per_gap;
        if (c < 0 || c >= kConversations) continue;
        const double t = s.start + static_cast<double>(slot) * join;
        std::fprintf(f, "%llu,100,0.1,0.5,%ld,%d,%.3f,%.3f\n",
                     static_cast<unsigned long long>(s.first_prompt + r * 150 + c % 7), c, r + 1,
                     t, t + 0.6);
      }
    }
    std::fclose(f);
  }
  const long rss_before = MaxRssKiB();
  TrafficAccumulator acc;
  size_t most_held = 0;
  uint64_t n = 0;
  const auto start = std::chrono::steady_clock::now();
  auto counts = ReadRequestLog(path, LogFormat::kAuto, {}, [&](const RequestRecord& r) {
    acc.Add(r);
    if ((++n & 0x3FFF) == 0) most_held = std::max(most_held, acc.MemoryBytes());
  });
  ASSERT_TRUE(counts.ok()) << counts.status().message();
  TrafficSummary sum = acc.Finish();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const long rss_growth_kib = MaxRssKiB() - rss_before;
  std::printf("2M records: %.2f s, peak RSS +%ld KiB, accumulator at most %zu bytes\n", secs,
              rss_growth_kib, most_held);
  EXPECT_EQ(counts->records, static_cast<uint64_t>(kConversations) * kRounds);
  EXPECT_EQ(counts->malformed, 0u);
  EXPECT_EQ(sum.conversations, static_cast<uint64_t>(kConversations));
  EXPECT_EQ(sum.rounds.median, 5u);
  EXPECT_EQ(sum.growth_per_round.median, 150u);
  EXPECT_NEAR(sum.active_busiest, 8, 0.5);
  EXPECT_LT(most_held, 16u << 20);
#if !defined(__SANITIZE_ADDRESS__)
  EXPECT_LT(rss_growth_kib, 64 * 1024);
#endif
}

}  // namespace
}  // namespace kvtier::planner
