#include "common/units.h"

#include <gtest/gtest.h>

#include "common/strings.h"

namespace kvtier {
namespace {

constexpr double kKi = 1024.0, kMi = kKi * 1024, kGi = kMi * 1024;

TEST(ParseByteCount, TakesStorageToolSizes) {
  EXPECT_EQ(*ParseByteCount("4096"), 4096u);
  EXPECT_EQ(*ParseByteCount("512K"), 512u * 1024);
  EXPECT_EQ(*ParseByteCount("36MiB"), 36u << 20);
  EXPECT_EQ(*ParseByteCount("36 mib"), 36u << 20);
  EXPECT_EQ(*ParseByteCount("1G"), 1ull << 30);
  EXPECT_EQ(*ParseByteCount("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*ParseByteCount("100MB"), 100'000'000u);
  EXPECT_EQ(*ParseByteCount("4kb"), 4000u);  // "b" is bytes where bits are not allowed
  EXPECT_EQ(*ParseByteCount("7B"), 7u);
  EXPECT_EQ(*ParseByteCount("2Ki"), 2048u);
}

TEST(ParseByteCount, RejectsJunk) {
  for (const char* bad : {"", "MiB", "-1", "12Q", "1.5", "0.3K", "1e999G", "1..2M", "8Gbit",
                          "nan", "inf", "1e19", "8 parsecs"}) {
    EXPECT_FALSE(ParseByteCount(bad).ok()) << bad;
  }
}

TEST(ParseSize, OneRuleForDecimalAndBinaryUnits) {
  // The same text means the same number of bytes under both syntaxes, where both accept it.
  for (const auto syntax : {kLenientSize, kStrictSize}) {
    EXPECT_DOUBLE_EQ(*ParseSize("19GB", syntax), 19e9);
    EXPECT_DOUBLE_EQ(*ParseSize("19 gB", syntax), 19e9);
    EXPECT_DOUBLE_EQ(*ParseSize("8GiB", syntax), 8 * kGi);
    EXPECT_DOUBLE_EQ(*ParseSize("512 MiB", syntax), 512 * kMi);
    EXPECT_DOUBLE_EQ(*ParseSize("1.5TB", syntax), 1.5e12);
    EXPECT_DOUBLE_EQ(*ParseSize("3kB", syntax), 3000);
    EXPECT_DOUBLE_EQ(*ParseSize("3KiB", syntax), 3 * kKi);
    EXPECT_DOUBLE_EQ(*ParseSize("2 bytes", syntax), 2);
  }
}

TEST(ParseSize, StrictRefusesTheAmbiguousForms) {
  auto bare = ParseSize("8", kStrictSize);
  ASSERT_FALSE(bare.ok());
  EXPECT_NE(bare.status().message().find("no unit"), std::string::npos);
  auto prefix = ParseSize("8G", kStrictSize);
  ASSERT_FALSE(prefix.ok());
  EXPECT_NE(prefix.status().message().find("8GiB"), std::string::npos) << prefix.status().message();
  EXPECT_NE(prefix.status().message().find("8GB"), std::string::npos);
  // The lenient syntax takes both, as bytes and as binary.
  EXPECT_DOUBLE_EQ(*ParseSize("8", kLenientSize), 8);
  EXPECT_DOUBLE_EQ(*ParseSize("8G", kLenientSize), 8 * kGi);
}

TEST(ParseSize, BitsWhereAllowed) {
  EXPECT_DOUBLE_EQ(*ParseSize("8Gb", kStrictSize), 1e9);
  EXPECT_DOUBLE_EQ(*ParseSize("25Gbit", kStrictSize), 25e9 / 8);
  EXPECT_DOUBLE_EQ(*ParseSize("8Gb", kLenientSize), 8e9);  // no bits here: bytes
  EXPECT_FALSE(ParseSize("8Gbit", kLenientSize).ok());
}

TEST(Lower, LowersAsciiOnly) {
  EXPECT_EQ(Lower("BF16-Qwen3"), "bf16-qwen3");
  EXPECT_EQ(Lower(""), "");
}

}  // namespace
}  // namespace kvtier
