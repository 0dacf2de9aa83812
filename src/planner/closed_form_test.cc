#include "planner/closed_form.h"

#include <gtest/gtest.h>

namespace kvtier::planner {
namespace {

constexpr uint64_t kQwenBytes = 147456;

PrefillCost Measured() {
  return *PrefillCost::FromTable(
      {{4096, 0.135}, {8192, 0.280}, {16384, 0.652}, {24576, 1.049}, {32768, 1.530}});
}

TEST(ClosedFormTest, EvictionOnsetForEightUsersIn19GB) {
  // 19e9 / (8 x 147456) = 16,106.5 tokens of peak conversation per user.
  EXPECT_NEAR(EvictionOnsetPeakTokens(19e9, kQwenBytes, 8), 16106.5, 0.01);
  Workload w;
  w.users = 8;
  w.rounds = 1;
  w.system_prompt_tokens = 0;
  w.question_tokens = 1;
  w.answer_tokens = 1;
  // Context c fits while 8 x (c + 2) x 147456 <= 19e9, i.e. c <= 16104.
  EXPECT_EQ(EvictionOnsetContext(19e9, kQwenBytes, w), 16105u);
  // A shared system prompt is held once, growth per round by every user.
  w.system_prompt_tokens = 1000;
  w.rounds = 5;
  w.question_tokens = 128;
  w.answer_tokens = 100;
  const uint64_t onset = EvictionOnsetContext(19e9, kQwenBytes, w);
  w.context_tokens = onset - 1;
  EXPECT_LE(PeakWorkingSetTokens(w) * kQwenBytes, 19e9);
  w.context_tokens = onset;
  EXPECT_GT(PeakWorkingSetTokens(w) * kQwenBytes, 19e9);
  EXPECT_EQ(EvictionOnsetContext(1e6, kQwenBytes, w), 0u);  // nothing fits
}

TEST(ClosedFormTest, SingleRequestHitOverlapsTheHostTierLayerByLayer) {
  EngineModel e;
  e.kv_bytes_per_token = kQwenBytes;
  e.step_overhead_s = 0;
  // A table with a point at the suffix's length: its fixed cost of one forward pass is in it.
  e.prefill = *PrefillCost::FromTable({{256, 0.026},
                                       {4096, 0.137},
                                       {8192, 0.284},
                                       {16384, 0.660},
                                       {24576, 1.069},
                                       {32768, 1.569}});
  const std::vector<TierSpec> tiers = {{"cpu", 1e12, 55e9, 55e9}, {"disk", 1e12, 2e9, 2e9}};
  const SingleRequestHit h = PredictSingleRequestHit(e, 36, tiers, 24576, 256);
  EXPECT_EQ(h.prefix_tokens, 24320u);
  EXPECT_DOUBLE_EQ(h.recompute_s, 1.069);
  // The suffix: the 256-token prefill plus its attention over the cached 24,320 tokens.
  EXPECT_GT(h.suffix_s, 0.026);
  EXPECT_NEAR(h.suffix_s, 0.026 + e.prefill.CachedAttention(24320, 256), 1e-12);
  EXPECT_NEAR(e.prefill.CachedAttention(24320, 256), 0.006, 0.003);  // ~2cmn of the fit
  const double bytes = 24320.0 * kQwenBytes;
  ASSERT_EQ(h.hit_ttft_s.size(), 2u);
  // Host tier: the copy (65 ms) hides the suffix; one layer's copy is exposed.
  EXPECT_NEAR(h.read_s[0], bytes / 55e9, 1e-12);
  EXPECT_NEAR(h.hit_ttft_s[0], bytes / 55e9 * (1 + 1.0 / 36), 1e-12);
  // Storage: read, then compute.
  EXPECT_NEAR(h.hit_ttft_s[1], bytes / 2e9 + h.suffix_s, 1e-12);
  // A short prefix: the suffix's compute is the longer leg.
  const SingleRequestHit s = PredictSingleRequestHit(e, 36, tiers, 4096, 256);
  EXPECT_NEAR(s.hit_ttft_s[0], s.suffix_s + s.read_s[0] / 36, 1e-12);
  // Issuing 36 layer loads at 200 us each lengthens a launch-bound suffix by 7.2 ms.
  EngineModel issued = e;
  issued.layer_load_overhead_s = 200e-6;
  const SingleRequestHit i = PredictSingleRequestHit(issued, 36, tiers, 4096, 256);
  EXPECT_NEAR(i.hit_ttft_s[0], s.suffix_s + 36 * 200e-6 + s.read_s[0] / 36, 1e-12);
  EXPECT_NEAR(i.hit_ttft_s[1], s.hit_ttft_s[1], 1e-12);  // storage: not layer by layer
  // The step overhead is paid once by every arm.
  e.step_overhead_s = 0.004;
  const SingleRequestHit o = PredictSingleRequestHit(e, 36, tiers, 24576, 256);
  EXPECT_NEAR(o.recompute_s - h.recompute_s, 0.004, 1e-12);
  EXPECT_NEAR(o.hit_ttft_s[1] - h.hit_ttft_s[1], 0.004, 1e-12);
}

TEST(ClosedFormTest, CachedAttentionOfTheFlopModel) {
  ModelSpec m = *LoadModel("qwen3-8b", 1);
  auto c = *PrefillCost::FromFlops(m, 989e12, 0.5);
  // The cross term is exactly what the new tokens' pairs with the cached ones cost.
  const double direct = (m.PrefillFlops(1000, 100) - m.PrefillFlops(0, 100)) / (989e12 * 0.5);
  EXPECT_NEAR(c.CachedAttention(1000, 100), direct, 1e-12);
  EXPECT_NEAR(c.HitSuffix(1000, 100), c.Suffix(1000, 100), 1e-12);
}

TEST(ClosedFormTest, PeakSession) {
  Workload w;
  w.system_prompt_tokens = 1000;
  w.context_tokens = 24576;
  w.rounds = 5;
  w.question_tokens = 128;
  w.answer_tokens = 100;
  EXPECT_EQ(w.PeakConversationTokens(), 1000u + 24576 + 5 * 228);
  EXPECT_DOUBLE_EQ(PeakSessionBytes(w, kQwenBytes), (1000.0 + 24576 + 1140) * kQwenBytes);
  EXPECT_EQ(w.PromptTokens(0), 1000u + 24576 + 128);
  EXPECT_EQ(w.PromptTokens(4), 1000u + 24576 + 4 * 228 + 128);
}

TEST(ClosedFormTest, PayoffMatchesTheMeasuredBreakEven) {
  const PrefillCost prefill = Measured();
  // docs/limits.md: break-even storage bandwidth at 24k is 147456 x 24576 / 1.049 s = 3.45 GB/s.
  const double bw = BreakEvenBandwidth(prefill, kQwenBytes, 24576);
  EXPECT_NEAR(bw, 3.4546e9, 0.001e9);
  auto payoff = PayoffTokens(prefill, kQwenBytes, bw * 1.0001);
  ASSERT_TRUE(payoff.has_value());
  EXPECT_LE(*payoff, 24576u);
  EXPECT_GE(*payoff, 24576u - 64);
  // Pinned host memory at 55 GB/s wins from the first token; the local disk (1.5 GB/s) loses
  // to recompute at every measured length.
  EXPECT_LE(*PayoffTokens(prefill, kQwenBytes, 55e9), 16u);
  auto disk = PayoffTokens(prefill, kQwenBytes, 1.5e9);
  EXPECT_TRUE(!disk.has_value() || *disk > 32768);
  // Faster tiers pay off sooner.
  EXPECT_LT(*PayoffTokens(prefill, kQwenBytes, 5e9), *PayoffTokens(prefill, kQwenBytes, 3.55e9));
  // A flat (linear) prefill cost can never be beaten by a tier slower than its per-token rate.
  auto linear = *PrefillCost::FromTable({{1000, 0.001}});
  EXPECT_FALSE(PayoffTokens(linear, kQwenBytes, 1e9, 1 << 16).has_value());
}

TEST(ClosedFormTest, HitCostIsTransferPlusSuffix) {
  const PrefillCost prefill = Measured();
  // docs/limits.md: 3.62 GB from pinned memory at 55 GB/s takes 0.066 s.
  EXPECT_NEAR(HitCost(prefill, kQwenBytes, 55e9, 24576, 0), 0.066, 0.001);
  EXPECT_NEAR(HitCost(prefill, kQwenBytes, 55e9, 24320, 256),
              24320.0 * kQwenBytes / 55e9 + prefill.Suffix(24320, 256), 1e-12);
}

TEST(ClosedFormTest, FastEstimateMixesHitsAndMisses) {
  EngineModel e;
  e.prefill = Measured();
  e.kv_bytes_per_token = kQwenBytes;
  e.gpu_kv_bytes = 1e12;  // everything fits
  e.step_overhead_s = 0;
  Workload w;
  w.context_tokens = 16384;
  FastArm fits = FastEstimate(e, w, {}, WritePolicy::kNone);
  EXPECT_NEAR(fits.hit_rate[0], 0.8, 1e-9);  // rounds 2..5 hit the GPU
  EXPECT_NEAR(fits.hit_rate[1], 0.2, 1e-9);  // round 1 recomputes
  e.gpu_kv_bytes = 19e9;
  FastArm evicting = FastEstimate(e, w, {}, WritePolicy::kNone);
  EXPECT_GT(evicting.mean_ttft_s, fits.mean_ttft_s);
  TierSpec cpu{"cpu", 200e9, 50e9, 50e9};
  FastArm offload = FastEstimate(e, w, {cpu}, WritePolicy::kWriteThrough);
  EXPECT_LT(offload.mean_ttft_s, evicting.mean_ttft_s);
  EXPECT_GT(offload.bytes_read_per_request[0], 0);
  double sum = 0;
  for (double h : offload.hit_rate) sum += h;
  EXPECT_NEAR(sum, 1.0, 1e-9);
}

}  // namespace
}  // namespace kvtier::planner
