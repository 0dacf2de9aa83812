#include "common/model_presets.h"

#include <filesystem>

#include "common/strings.h"

namespace kvtier {
namespace {

// From the models' published config.json files (the fields kvtier reads).
constexpr std::string_view kQwen3_0_6B = R"({
  "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 151936, "tie_word_embeddings": true, "max_position_embeddings": 40960,
  "torch_dtype": "bfloat16"})";
constexpr std::string_view kQwen3_8B = R"({
  "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 151936, "tie_word_embeddings": false, "max_position_embeddings": 40960,
  "torch_dtype": "bfloat16"})";
constexpr std::string_view kQwen3_32B = R"({
  "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 151936, "tie_word_embeddings": false, "max_position_embeddings": 40960,
  "torch_dtype": "bfloat16"})";
constexpr std::string_view kLlama31_8B = R"({
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
  "tie_word_embeddings": false, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"})";
constexpr std::string_view kLlama31_70B = R"({
  "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
  "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
  "tie_word_embeddings": false, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"})";
constexpr std::string_view kDeepSeekV3 = R"({
  "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
  "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
  "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
  "num_experts_per_tok": 8, "first_k_dense_replace": 3, "vocab_size": 129280,
  "max_position_embeddings": 163840, "torch_dtype": "bfloat16"})";

constexpr ModelPreset kPresets[] = {
    {"qwen3-0.6b", kQwen3_0_6B, "bfloat16"},
    {"qwen3-8b", kQwen3_8B, "bfloat16"},
    {"qwen3-32b", kQwen3_32B, "bfloat16"},
    {"llama-3.1-8b", kLlama31_8B, "bfloat16"},
    {"llama-3.1-70b", kLlama31_70B, "bfloat16"},
    {"deepseek-v3", kDeepSeekV3, "float8_e4m3fn"},
};

}  // namespace

std::span<const ModelPreset> ModelPresets() { return kPresets; }

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

const ModelPreset* FindModelPreset(std::string_view name) {
  const auto slash = name.rfind('/');
  if (slash != std::string_view::npos) {
    std::error_code ec;
    if (std::filesystem::exists(std::filesystem::path(name), ec)) return nullptr;
    name = name.substr(slash + 1);
  }
  std::string n = Lower(name);
  if (n.starts_with("meta-")) n = n.substr(5);
  for (std::string_view suffix : {"-instruct", "-chat", "-base"}) {
    if (n.size() > suffix.size() && n.ends_with(suffix)) n.resize(n.size() - suffix.size());
  }
  for (const auto& p : kPresets) {
    if (p.name == n) return &p;
  }
  return nullptr;
}

}  // namespace kvtier
