#include "common/model_presets.h"

#include <fstream>

#include <gtest/gtest.h>

#include "kvtier/layout.h"
#include "testing/temp_dir.h"

namespace kvtier {
namespace {

TEST(ModelPresets, ShapesMatchThePublishedConfigs) {
  struct Shape {
    const char* name;
    const char* layout;
  };
  // Per layer and token: 2 x KV heads x head_dim values, or the MLA latent.
  const Shape kShapes[] = {
      {"qwen3-0.6b", "kv(layers=28, kv_heads=8, head_dim=128, bfloat16)"},
      {"qwen3-8b", "kv(layers=36, kv_heads=8, head_dim=128, bfloat16)"},
      {"qwen3-32b", "kv(layers=64, kv_heads=8, head_dim=128, bfloat16)"},
      {"llama-3.1-8b", "kv(layers=32, kv_heads=8, head_dim=128, bfloat16)"},
      {"llama-3.1-70b", "kv(layers=80, kv_heads=8, head_dim=128, bfloat16)"},
      {"deepseek-v3", "latent(layers=61, latent_dim=576, bfloat16)"},
  };
  ASSERT_EQ(ModelPresets().size(), std::size(kShapes));
  for (const auto& shape : kShapes) {
    const ModelPreset* p = FindModelPreset(shape.name);
    ASSERT_NE(p, nullptr) << shape.name;
    auto layout = Layout::FromHfConfigJson(p->config_json);
    ASSERT_TRUE(layout.ok()) << shape.name << ": " << layout.status().ToString();
    EXPECT_EQ(layout->ToString(), shape.layout);
  }
}

TEST(ModelPresets, FindsPublishedNames) {
  EXPECT_EQ(FindModelPreset("Qwen/Qwen3-8B")->name, "qwen3-8b");
  EXPECT_EQ(FindModelPreset("QWEN3-32B")->name, "qwen3-32b");
  EXPECT_EQ(FindModelPreset("meta-llama/Meta-Llama-3.1-8B-Instruct")->name, "llama-3.1-8b");
  EXPECT_EQ(FindModelPreset("deepseek-ai/DeepSeek-V3")->name, "deepseek-v3");
  EXPECT_EQ(FindModelPreset("qwen3-9b"), nullptr);
  EXPECT_EQ(FindModelPreset(""), nullptr);
}

TEST(ModelPresets, AnExistingPathIsNeverAPreset) {
  kvtier::testing::TempDir dir("presets");
  std::ofstream(dir.Sub("qwen3-8b")) << "{}";
  EXPECT_EQ(FindModelPreset(dir.Sub("qwen3-8b")), nullptr);
  EXPECT_NE(FindModelPreset(dir.Sub("no/qwen3-8b")), nullptr);  // not a path: the name counts
}

}  // namespace
}  // namespace kvtier
