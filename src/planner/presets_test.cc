#include "planner/presets.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kvtier::planner {
namespace {

TEST(PresetsTest, KvBytesPerToken) {
  EXPECT_EQ(LoadModel("qwen3-8b", 1)->kv_bytes_per_token(), 147456u);      // 36 x 8 x 128 x 2 x 2
  EXPECT_EQ(LoadModel("llama-3.1-8b", 1)->kv_bytes_per_token(), 131072u);  // 32 x 8 x 128 x 2 x 2
  EXPECT_EQ(LoadModel("llama-3.1-70b", 1)->kv_bytes_per_token(), 327680u);
  // MLA: 61 layers x (512 + 64) latent x 2 bytes.
  EXPECT_EQ(LoadModel("deepseek-v3", 1)->kv_bytes_per_token(), 70272u);
  EXPECT_EQ(LoadModel("qwen3-8b", 1, "fp8")->kv_bytes_per_token(), 73728u);
}

TEST(PresetsTest, EveryModelPresetOfKvtierLoads) {
  // One table for every tool: the planner takes the models kvtier serve and bench storage take.
  for (const auto& name : ModelPresetNames()) {
    auto model = LoadModel(name, 1);
    ASSERT_TRUE(model.ok()) << name << ": " << model.status().ToString();
    EXPECT_GT(model->total_params, 0) << name;
    EXPECT_GT(model->max_context, 0u) << name;
  }
  EXPECT_EQ(LoadModel("qwen3-32b", 1)->kv_bytes_per_token(), 262144u);  // 64 x 8 x 128 x 2 x 2
  auto small = LoadModel("Qwen/Qwen3-0.6B", 1);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_EQ(small->name, "qwen3-0.6b");
  auto near = [](double got, double want, double tol) { return std::abs(got / want - 1) < tol; };
  EXPECT_TRUE(near(small->total_params, 0.6e9, 0.05)) << small->total_params;
  EXPECT_TRUE(near(LoadModel("qwen3-32b", 1)->total_params, 32.8e9, 0.03))
      << LoadModel("qwen3-32b", 1)->total_params;
}

TEST(PresetsTest, TensorParallelSplitsHeadsButNotTheTotal) {
  auto tp2 = LoadModel("qwen3-8b", 2);
  ASSERT_TRUE(tp2.ok());
  EXPECT_EQ(tp2->rank_kv_bytes_per_token, 73728u);
  EXPECT_EQ(tp2->kv_bytes_per_token(), 147456u);
  // MLA latents are replicated on every rank.
  EXPECT_EQ(LoadModel("deepseek-v3", 8)->kv_bytes_per_token(), 8u * 70272u);
  EXPECT_FALSE(LoadModel("qwen3-8b", 3).ok());
  EXPECT_FALSE(LoadModel("qwen3-8b", 0).ok());
}

TEST(PresetsTest, ParameterCountsMatchPublishedSizes) {
  auto near = [](double got, double want, double tol) { return std::abs(got / want - 1) < tol; };
  auto qwen = LoadModel("qwen3-8b", 1);
  EXPECT_TRUE(near(qwen->total_params, 8.19e9, 0.02)) << qwen->total_params;
  EXPECT_TRUE(near(qwen->active_params, 6.95e9, 0.02)) << qwen->active_params;
  EXPECT_TRUE(near(LoadModel("llama-3.1-70b", 1)->total_params, 70.6e9, 0.02));
  auto ds = LoadModel("deepseek-v3", 8);
  EXPECT_TRUE(near(ds->total_params, 671e9, 0.02)) << ds->total_params;
  EXPECT_TRUE(near(ds->active_params, 37e9, 0.10)) << ds->active_params;
  EXPECT_EQ(ds->weight_bytes_per_param, 1);  // fp8 weights
}

TEST(PresetsTest, ConfigFileMatchesPreset) {
  auto file = LoadModel(std::string(KVTIER_TESTDATA_DIR) + "/qwen3-8b.config.json", 1);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto preset = LoadModel("qwen3-8b", 1);
  EXPECT_EQ(file->kv_bytes_per_token(), preset->kv_bytes_per_token());
  EXPECT_DOUBLE_EQ(file->active_params, preset->active_params);
  EXPECT_DOUBLE_EQ(file->PrefillFlops(0, 4096), preset->PrefillFlops(0, 4096));
}

TEST(PresetsTest, UnknownNamesAreRefused) {
  auto m = LoadModel("gpt-17", 1);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("unknown model"), std::string::npos);
  EXPECT_FALSE(LoadGpu("voodoo2").ok());
  EXPECT_TRUE(LoadGpu("h200").ok());
  EXPECT_NEAR(LoadGpu("h100")->peak_flops, 989e12, 1e12);
  // The published experiment's A100-40GB, spelled as people write it.
  ASSERT_TRUE(LoadGpu("A100-40GB").ok());
  EXPECT_EQ(LoadGpu("A100-40GB")->name, "a100-40g");
  EXPECT_LT(LoadGpu("nvidia-a100-40gb")->memory_bytes, 42.5e9);
  EXPECT_EQ(LoadGpu("H200")->name, "h200");
}

TEST(PresetsTest, PrefillFlopsAreAdditive) {
  auto m = LoadModel("llama-3.1-8b", 1);
  // Prefilling [0, a+b) costs the same as [0, a) then [a, a+b).
  EXPECT_NEAR(m->PrefillFlops(0, 3000), m->PrefillFlops(0, 1000) + m->PrefillFlops(1000, 2000),
              1e3);
}

}  // namespace
}  // namespace kvtier::planner
