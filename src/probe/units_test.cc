#include "probe/units.h"

#include <gtest/gtest.h>

namespace kvtier::probe {
namespace {

TEST(ParseByteSize, AcceptsBinaryAndDecimalUnits) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("512K"), 512u * 1024);
  EXPECT_EQ(*ParseByteSize("36MiB"), 36u << 20);
  EXPECT_EQ(*ParseByteSize("36 mib"), 36u << 20);
  EXPECT_EQ(*ParseByteSize("1G"), 1ull << 30);
  EXPECT_EQ(*ParseByteSize("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*ParseByteSize("100MB"), 100'000'000u);
  EXPECT_EQ(*ParseByteSize("7B"), 7u);
}

TEST(ParseByteSize, RejectsJunk) {
  for (const char* bad : {"", "MiB", "-1", "12Q", "1.5", "0.3K", "1e999G", "1..2M"}) {
    EXPECT_FALSE(ParseByteSize(bad).ok()) << bad;
  }
}

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
