#include "probe/units.h"

#include <gtest/gtest.h>

namespace kvtier::probe {
namespace {

TEST(ParseIntList, ParsesAndChecksRange) {
  auto list = ParseIntList("1, 16,32", 1, 1024);
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(*list, (std::vector<int>{1, 16, 32}));
  EXPECT_FALSE(ParseIntList("1,,2", 1, 10).ok());
  EXPECT_FALSE(ParseIntList("0", 1, 10).ok());
  EXPECT_FALSE(ParseIntList("11", 1, 10).ok());
  EXPECT_FALSE(ParseIntList("1,x", 1, 10).ok());
  EXPECT_FALSE(ParseIntList("", 1, 10).ok());
}

TEST(FormatBytes, PicksAReadableUnit) {
  EXPECT_EQ(FormatBytes(100), "100 B");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(36u << 20), "36 MiB");
  EXPECT_EQ(FormatBytes(3ull << 29), "1.5 GiB");
}

}  // namespace
}  // namespace kvtier::probe
