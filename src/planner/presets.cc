#include "planner/presets.h"

#include <fmt/format.h>

#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/model_presets.h"

namespace kvtier::planner {
namespace {

constexpr GpuSpec kGpus[] = {
    // memory: what the driver reports; FLOP/s: dense bf16; HBM: datasheet.
    {"h200", 143771.0 * 1048576, 989e12, 4.8e12},
    {"h100", 81559.0 * 1048576, 989e12, 3.35e12},
    {"a100-80g", 81251.0 * 1048576, 312e12, 2.039e12},
    // The published multi-round experiment's GPU (SXM4, HBM2); memory as PyTorch reports an
    // A100-SXM4-40GB (42,314,825,728 bytes), not measured on one of ours.
    {"a100-40g", 40354.0 * 1048576, 312e12, 1.555e12},
    {"l40s", 46068.0 * 1048576, 362e12, 0.864e12},
};

uint64_t GetU64(const nlohmann::json& j, const char* key, uint64_t fallback) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return fallback;
  return it->get<uint64_t>();
}

}  // namespace

double ModelSpec::PrefillFlops(uint64_t cached, uint64_t new_tokens) const {
  double m = static_cast<double>(cached);
  double n = static_cast<double>(new_tokens);
  // Token i (0-based) attends to i+1 keys: sum over [m, m+n) = n*m + n*(n+1)/2 query-key pairs,
  // each costing 2*qk_dim for Q.K^T and 2*v_dim for P.V per head per layer.
  double pairs = n * m + n * (n + 1) / 2;
  double attention = 2.0 * pairs * attention_heads * (qk_head_dim + v_head_dim) * num_layers;
  return 2.0 * active_params * n + attention;
}

Result<ModelSpec> ModelFromConfigJson(std::string_view json_text, std::string name,
                                      uint32_t tensor_parallel, std::string_view kv_dtype,
                                      std::string_view weight_dtype) {
  if (tensor_parallel == 0) return Status::InvalidArgument("tensor-parallel size must be >= 1");
  KVTIER_ASSIGN_OR_RETURN(Layout layout,
                          Layout::FromHfConfigJson(json_text, tensor_parallel, kv_dtype));
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument(fmt::format("{}: not a JSON object", name));
  }
  if (j.contains("text_config") && j["text_config"].is_object()) j = j["text_config"];

  ModelSpec m;
  m.name = std::move(name);
  m.layout = layout.ToString();
  m.rank_kv_bytes_per_token = layout.bytes_per_token();
  m.kv_dtype = layout.dtype();
  m.tensor_parallel = tensor_parallel;
  const uint64_t hidden = GetU64(j, "hidden_size", 0);
  const uint64_t layers = GetU64(j, "num_hidden_layers", 0);
  const uint64_t heads = GetU64(j, "num_attention_heads", 0);
  const uint64_t kv_heads = GetU64(j, "num_key_value_heads", heads);
  const uint64_t inter = GetU64(j, "intermediate_size", 0);
  const uint64_t vocab = GetU64(j, "vocab_size", 0);
  if (hidden == 0 || layers == 0 || heads == 0 || inter == 0) {
    return Status::InvalidArgument(
        fmt::format("{}: config needs hidden_size, num_hidden_layers, num_attention_heads and "
                    "intermediate_size to estimate prefill cost",
                    m.name));
  }
  const uint64_t head_dim = GetU64(j, "head_dim", hidden / heads);
  m.num_layers = static_cast<uint32_t>(layers);
  m.attention_heads = static_cast<uint32_t>(heads);
  m.max_context = GetU64(j, "max_position_embeddings", 0);

  double attn_params = 0;
  const uint64_t kv_lora = GetU64(j, "kv_lora_rank", 0);
  if (kv_lora > 0) {  // MLA
    const uint64_t q_lora = GetU64(j, "q_lora_rank", 0);
    const uint64_t nope = GetU64(j, "qk_nope_head_dim", head_dim);
    const uint64_t rope = GetU64(j, "qk_rope_head_dim", 0);
    const uint64_t v_dim = GetU64(j, "v_head_dim", head_dim);
    const double q_proj = q_lora > 0
                              ? double(hidden) * q_lora + double(q_lora) * heads * (nope + rope)
                              : double(hidden) * heads * (nope + rope);
    attn_params = q_proj + double(hidden) * (kv_lora + rope) +
                  double(kv_lora) * heads * (nope + v_dim) + double(heads) * v_dim * hidden;
    m.qk_head_dim = static_cast<uint32_t>(nope + rope);
    m.v_head_dim = static_cast<uint32_t>(v_dim);
  } else {
    attn_params = double(hidden) * heads * head_dim * 2 + double(hidden) * kv_heads * head_dim * 2;
    m.qk_head_dim = m.v_head_dim = static_cast<uint32_t>(head_dim);
  }

  const uint64_t experts = GetU64(j, "n_routed_experts", GetU64(j, "num_local_experts", 0));
  double total_mlp = 0, active_mlp = 0;
  if (experts > 0) {
    const uint64_t moe_inter = GetU64(j, "moe_intermediate_size", inter);
    const uint64_t shared = GetU64(j, "n_shared_experts", 0);
    const uint64_t per_tok = GetU64(j, "num_experts_per_tok", 1);
    const uint64_t dense_layers = std::min<uint64_t>(GetU64(j, "first_k_dense_replace", 0), layers);
    const double expert = 3.0 * hidden * moe_inter;
    const double dense = 3.0 * hidden * inter;
    const double router = double(hidden) * experts;
    total_mlp =
        dense_layers * dense + (layers - dense_layers) * ((experts + shared) * expert + router);
    active_mlp =
        dense_layers * dense + (layers - dense_layers) * ((per_tok + shared) * expert + router);
  } else {
    total_mlp = active_mlp = layers * 3.0 * hidden * inter;
  }
  const bool tied = j.value("tie_word_embeddings", false);
  const double embeddings = double(vocab) * hidden * (tied ? 1 : 2);
  m.total_params = layers * attn_params + total_mlp + embeddings;
  // Prefill FLOPs: the input embedding is a lookup and only the last token goes through the
  // LM head, so neither counts per token.
  m.active_params = layers * attn_params + active_mlp;

  std::string_view wdt = weight_dtype;
  std::string config_dtype = j.value("torch_dtype", j.value("dtype", std::string("bfloat16")));
  if (wdt.empty()) wdt = config_dtype;
  KVTIER_ASSIGN_OR_RETURN(DType weight_type, ParseDType(wdt));
  m.weight_bytes_per_param = DTypeSize(weight_type);

  if (kv_lora == 0 && (kv_heads % tensor_parallel != 0 && tensor_parallel % kv_heads != 0)) {
    return Status::InvalidArgument(
        fmt::format("{}: {} KV heads cannot be split evenly over tensor-parallel size {}", m.name,
                    kv_heads, tensor_parallel));
  }
  return m;
}

Result<ModelSpec> LoadModel(std::string_view name_or_path, uint32_t tensor_parallel,
                            std::string_view kv_dtype, std::string_view weight_dtype) {
  if (const ModelPreset* p = FindModelPreset(name_or_path)) {
    return ModelFromConfigJson(p->config_json, std::string(p->name), tensor_parallel, kv_dtype,
                               weight_dtype.empty() ? p->weight_dtype : weight_dtype);
  }
  std::string path(name_or_path);
  std::ifstream in(path);
  if (!in) {
    std::string names;
    for (const auto& n : ModelPresetNames()) names += (names.empty() ? "" : ", ") + n;
    return Status::InvalidArgument(fmt::format(
        "unknown model '{}': not a preset ({}) and no readable config.json at that path", path,
        names));
  }
  std::stringstream text;
  text << in.rdbuf();
  auto model = ModelFromConfigJson(text.str(), path, tensor_parallel, kv_dtype, weight_dtype);
  if (!model.ok()) return model.status().WithContext(path);
  return model;
}

std::vector<std::string> ModelPresetNames() { return kvtier::ModelPresetNames(); }

Result<GpuSpec> LoadGpu(std::string_view name) {
  // Names as people write them: "H100", "A100-40GB", "nvidia-h200".
  std::string n(name);
  for (char& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n.starts_with("nvidia-")) n.erase(0, 7);
  if (n.ends_with("gb")) n.pop_back();
  if (n == "h100-sxm") n = "h100";
  if (n == "a100") n = "a100-80g";
  for (const GpuSpec& g : kGpus) {
    if (g.name == n) return g;
  }
  std::string names;
  for (const auto& g : GpuPresetNames()) names += (names.empty() ? "" : ", ") + g;
  return Status::InvalidArgument(fmt::format("unknown GPU '{}' (known: {})", name, names));
}

std::vector<std::string> GpuPresetNames() {
  std::vector<std::string> out;
  for (const GpuSpec& g : kGpus) out.emplace_back(g.name);
  return out;
}

}  // namespace kvtier::planner
