#include "planner/prefill.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kvtier::planner {
namespace {

// The Qwen3-8B prefill measured on the H200 (docs/limits.md).
const std::vector<std::pair<uint64_t, double>> kMeasured = {
    {4096, 0.135}, {8192, 0.280}, {16384, 0.652}, {24576, 1.049}, {32768, 1.530}};

TEST(PrefillTest, TableReproducesItsPointsAndSuffixIsADifference) {
  auto c = PrefillCost::FromTable(kMeasured);
  ASSERT_TRUE(c.ok());
  for (const auto& [tokens, seconds] : kMeasured) EXPECT_NEAR(c->Full(tokens), seconds, 1e-12);
  EXPECT_DOUBLE_EQ(c->Full(0), 0);
  EXPECT_NEAR(c->Suffix(16384, 8192), 1.049 - 0.652, 1e-12);
  EXPECT_NEAR(c->Full(12288), (0.280 + 0.652) / 2, 1e-12);
  // Extrapolation is continuous and keeps the per-token cost growing.
  EXPECT_NEAR(c->Full(32769), 1.530, 1e-3);
  EXPECT_GT(c->Suffix(40000, 256), c->Suffix(24576, 256));
  EXPECT_GT(c->Full(65536), 2 * 1.530);
}

TEST(PrefillTest, LeaveOneOutInterpolationIsWithinTenPercent) {
  // Validation against the measurement: predict each interior point from the others.
  for (size_t skip = 1; skip + 1 < kMeasured.size(); ++skip) {
    auto rest = kMeasured;
    rest.erase(rest.begin() + skip);
    auto c = PrefillCost::FromTable(rest);
    ASSERT_TRUE(c.ok());
    double predicted = c->Full(kMeasured[skip].first);
    EXPECT_NEAR(predicted / kMeasured[skip].second, 1.0, 0.10) << kMeasured[skip].first;
  }
  // And the longest from the four shorter ones (extrapolation).
  auto shorter = kMeasured;
  shorter.pop_back();
  EXPECT_NEAR(PrefillCost::FromTable(shorter)->Full(32768) / 1.530, 1.0, 0.10);
}

TEST(PrefillTest, FlopModelAtHalfPeakMatchesTheMeasuredTable) {
  auto model = LoadModel("qwen3-8b", 1);
  auto c = PrefillCost::FromFlops(*model, 989e12, 0.5);
  ASSERT_TRUE(c.ok());
  for (const auto& [tokens, seconds] : kMeasured) {
    EXPECT_NEAR(c->Full(tokens) / seconds, 1.0, 0.15) << tokens << " tokens";
  }
  EXPECT_NEAR(c->Suffix(1000, 500), c->Full(1500) - c->Full(1000), 1e-12);
}

TEST(PrefillTest, BadTablesAreRefused) {
  EXPECT_FALSE(PrefillCost::FromTable({}).ok());
  EXPECT_FALSE(PrefillCost::FromTable({{4096, 0.2}, {8192, 0.1}}).ok());  // not monotone
  EXPECT_FALSE(PrefillCost::FromTable({{4096, 0.2}, {4096, 0.3}}).ok());
  EXPECT_FALSE(PrefillCost::FromTable({{0, 0.2}}).ok());
  EXPECT_FALSE(PrefillCost::FromTable({{4096, 0}}).ok());
  auto model = LoadModel("qwen3-8b", 1);
  EXPECT_FALSE(PrefillCost::FromFlops(*model, 989e12, 0).ok());
  EXPECT_FALSE(PrefillCost::FromFlops(*model, 989e12, 1.5).ok());
  EXPECT_TRUE(PrefillCost::FromTable({{4096, 0.135}}).ok());  // one point: linear
}

}  // namespace
}  // namespace kvtier::planner
