#include "planner/units.h"

#include <gtest/gtest.h>

namespace kvtier::planner {
namespace {

TEST(UnitsTest, BytesNeedAUnit) {
  EXPECT_DOUBLE_EQ(*ParseBytes("8GiB"), 8.0 * 1024 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(*ParseBytes("19GB"), 19e9);
  EXPECT_DOUBLE_EQ(*ParseBytes("512 MiB"), 512.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(*ParseBytes("1.5TB"), 1.5e12);
  EXPECT_DOUBLE_EQ(*ParseBytes("8Gb"), 1e9);  // bits
  auto bare = ParseBytes("8");
  ASSERT_FALSE(bare.ok());
  EXPECT_NE(bare.status().message().find("no unit"), std::string::npos);
  EXPECT_FALSE(ParseBytes("-1GB").ok());
  EXPECT_FALSE(ParseBytes("8 parsecs").ok());
  EXPECT_FALSE(ParseBytes("GB").ok());
  EXPECT_FALSE(ParseBytes("").ok());
}

TEST(UnitsTest, Bandwidth) {
  EXPECT_DOUBLE_EQ(*ParseBandwidth("3.55GB/s"), 3.55e9);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("20GiB/s"), 20.0 * (1ull << 30));
  EXPECT_DOUBLE_EQ(*ParseBandwidth("25Gbit/s"), 25e9 / 8);
  EXPECT_DOUBLE_EQ(*ParseBandwidth("100Gbps"), 100e9 / 8);
  EXPECT_FALSE(ParseBandwidth("3.55GB").ok());  // not per second
  EXPECT_FALSE(ParseBandwidth("-3GB/s").ok());
  EXPECT_FALSE(ParseBandwidth("0GB/s").ok());
  EXPECT_FALSE(ParseBandwidth("inf GB/s").ok());
}

TEST(UnitsTest, DurationsTokensAndTables) {
  EXPECT_DOUBLE_EQ(*ParseDuration("20m"), 1200);
  EXPECT_DOUBLE_EQ(*ParseDuration("1200"), 1200);
  EXPECT_DOUBLE_EQ(*ParseDuration("250ms"), 0.25);
  EXPECT_DOUBLE_EQ(*ParseDuration("1.5h"), 5400);
  EXPECT_FALSE(ParseDuration("5 days").ok());
  EXPECT_EQ(*ParseTokens("24k"), 24576u);
  EXPECT_FALSE(ParseTokens("1.5").ok());
  EXPECT_EQ(*ParseTokenList("8192,16384, 24k"), (std::vector<uint64_t>{8192, 16384, 24576}));
  EXPECT_FALSE(ParseTokenList("8192,,16384").ok());
  auto table = ParseTokenSecondsTable("4096:0.135,8192:0.280");
  ASSERT_TRUE(table.ok());
  ASSERT_EQ(table->size(), 2u);
  EXPECT_EQ((*table)[1].first, 8192u);
  EXPECT_DOUBLE_EQ((*table)[1].second, 0.280);
  EXPECT_FALSE(ParseTokenSecondsTable("4096=0.135").ok());
}

TEST(UnitsTest, Formatting) {
  EXPECT_EQ(FormatBytes(3.62e9), "3.62 GB");
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBandwidth(3.55e9), "3.55 GB/s");
  EXPECT_EQ(FormatSeconds(0.0123), "12.3 ms");
  EXPECT_EQ(FormatSeconds(1.5), "1.50 s");
}

}  // namespace
}  // namespace kvtier::planner
