#include "kvtier/layout.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

std::string DataFile(const char* name) { return std::string(KVTIER_TESTDATA_DIR) + "/" + name; }

TEST(LayoutTest, Qwen3_8BFromConfig) {
  auto l = Layout::FromHfConfigFile(DataFile("qwen3-8b.config.json"));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->kind(), LayoutKind::kKeyValue);
  EXPECT_EQ(l->num_layers(), 36u);
  EXPECT_EQ(l->num_kv_heads(), 8u);
  EXPECT_EQ(l->head_dim(), 128u);
  EXPECT_EQ(l->dtype(), DType::kBFloat16);
  EXPECT_EQ(l->bytes_per_token(), 147456u);
  EXPECT_EQ(l->bytes_per_chunk(256), 37748736u);  // 36 MiB
}

TEST(LayoutTest, LlamaHeadDimDefaultsFromHiddenSize) {
  auto l = Layout::FromHfConfigFile(DataFile("llama-3.1-8b.config.json"));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->head_dim(), 128u);
  EXPECT_EQ(l->bytes_per_token(), 32u * 2 * 8 * 128 * 2);  // 131072
}

TEST(LayoutTest, DeepSeekV3IsLatent) {
  auto l = Layout::FromHfConfigFile(DataFile("deepseek-v3.config.json"));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->kind(), LayoutKind::kLatent);
  EXPECT_EQ(l->head_dim(), 576u);
  EXPECT_EQ(l->bytes_per_token(), 61u * 576 * 2);  // 70272
  // MLA latents are replicated, not split, across tensor-parallel ranks.
  auto tp8 = Layout::FromHfConfigFile(DataFile("deepseek-v3.config.json"), 8);
  ASSERT_TRUE(tp8.ok());
  EXPECT_EQ(tp8->bytes_per_token(), l->bytes_per_token());
}

TEST(LayoutTest, TensorParallelSplitsKvHeads) {
  auto tp2 = Layout::FromHfConfigFile(DataFile("qwen3-8b.config.json"), 2);
  ASSERT_TRUE(tp2.ok());
  EXPECT_EQ(tp2->num_kv_heads(), 4u);
  auto tp16 = Layout::FromHfConfigFile(DataFile("qwen3-8b.config.json"), 16);
  ASSERT_TRUE(tp16.ok());
  EXPECT_EQ(tp16->num_kv_heads(), 1u);  // replicated when ranks outnumber heads
  EXPECT_FALSE(Layout::FromHfConfigFile(DataFile("qwen3-8b.config.json"), 3).ok());
  EXPECT_FALSE(Layout::FromHfConfigFile(DataFile("qwen3-8b.config.json"), 0).ok());
}

TEST(LayoutTest, DtypeOverrideAndUnknownDtype) {
  auto fp8 = Layout::FromHfConfigFile(DataFile("qwen3-8b.config.json"), 1, "fp8");
  ASSERT_TRUE(fp8.ok());
  EXPECT_EQ(fp8->bytes_per_token(), 147456u / 2);
  auto bad = Layout::FromHfConfigFile(DataFile("qwen3-8b.config.json"), 1, "int3");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("int3"), std::string::npos);
  EXPECT_FALSE(Layout::FromHfConfigJson(
                   R"({"num_hidden_layers":2,"num_attention_heads":2,"head_dim":8,"torch_dtype":"complex64"})")
                   .ok());
}

TEST(LayoutTest, MalformedConfigsAreClearErrors) {
  EXPECT_EQ(Layout::FromHfConfigJson("{not json").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Layout::FromHfConfigJson("[1,2]").status().code(), StatusCode::kInvalidArgument);
  auto missing = Layout::FromHfConfigJson(R"({"num_attention_heads": 8})");
  EXPECT_NE(missing.status().message().find("num_hidden_layers"), std::string::npos);
  EXPECT_FALSE(Layout::FromHfConfigJson(
                   R"({"num_hidden_layers": -3, "num_attention_heads": 8, "head_dim": 64})")
                   .ok());
  EXPECT_FALSE(Layout::FromHfConfigJson(
                   R"({"num_hidden_layers": "many", "num_attention_heads": 8, "head_dim": 64})")
                   .ok());
  EXPECT_EQ(Layout::FromHfConfigFile("/nonexistent/config.json").status().code(),
            StatusCode::kNotFound);
}

TEST(LayoutTest, ExplicitValuesAndBadSizes) {
  EXPECT_FALSE(Layout::KeyValue(0, 8, 128, DType::kBFloat16).ok());
  EXPECT_FALSE(Layout::KeyValue(36, 8, 0, DType::kBFloat16).ok());
  EXPECT_FALSE(Layout::Latent(61, 0, DType::kBFloat16).ok());
  EXPECT_FALSE(Layout::KeyValue(1 << 20, 1 << 10, 1 << 10, DType::kFloat32).ok());
  auto multimodal = Layout::FromHfConfigJson(
      R"({"text_config": {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}, "torch_dtype": "float16"})");
  ASSERT_TRUE(multimodal.ok()) << multimodal.status().ToString();
  EXPECT_EQ(multimodal->bytes_per_token(), 4u * 2 * 2 * 64 * 2);
}

TEST(LayoutTest, FingerprintIsStableAndDistinguishesShapes) {
  auto a = *Layout::KeyValue(36, 8, 128, DType::kBFloat16);
  auto b = *Layout::KeyValue(36, 8, 128, DType::kFloat16);
  auto c = *Layout::Latent(36, 2048, DType::kBFloat16);  // same bytes per token as a
  EXPECT_EQ(a.bytes_per_token(), c.bytes_per_token());
  EXPECT_NE(a.Fingerprint(), b.Fingerprint());
  EXPECT_NE(a.Fingerprint(), c.Fingerprint());
  // Golden: pinned so that every build and host agrees.
  EXPECT_EQ(a.ToString(), "kv(layers=36, kv_heads=8, head_dim=128, bfloat16)");
  EXPECT_EQ(a.Fingerprint(), 0xda8492f52ef4b5a6ull);
}

}  // namespace
}  // namespace kvtier
