#include "probe/model_presets.h"

#include <gtest/gtest.h>

namespace kvtier::probe {
namespace {

TEST(ResolveModelLayout, KnowsQwen3_8B) {
  auto layout = ResolveModelLayout("qwen3-8b");
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_EQ(layout->bytes_per_token(), 147456u);
  EXPECT_EQ(layout->bytes_per_chunk(256), 36u << 20);
  // Hub-style names resolve to the same preset.
  auto hub = ResolveModelLayout("Qwen/Qwen3-8B");
  ASSERT_TRUE(hub.ok());
  EXPECT_EQ(*hub, *layout);
  auto llama = ResolveModelLayout("meta-llama/Meta-Llama-3.1-8B-Instruct");
  ASSERT_TRUE(llama.ok());
  EXPECT_EQ(llama->bytes_per_token(), 32u * 2 * 8 * 128 * 2);
}

TEST(ResolveModelLayout, ReadsAConfigFileOrDirectory) {
  const std::string file = std::string(KVTIER_TESTDATA_DIR) + "/qwen3-8b.config.json";
  auto layout = ResolveModelLayout(file);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_EQ(layout->bytes_per_token(), 147456u);
}

TEST(ResolveModelLayout, UnknownNameListsThePresets) {
  auto layout = ResolveModelLayout("no-such-model");
  ASSERT_FALSE(layout.ok());
  EXPECT_NE(layout.status().message().find("qwen3-8b"), std::string::npos);
}

}  // namespace
}  // namespace kvtier::probe
