#include "kvtier/layout.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/sha256.h"
#include "common/strings.h"

namespace kvtier {
namespace {

constexpr uint64_t kMaxBytesPerToken = 1ull << 30;

// Reads an unsigned integer field; absent -> fallback (0 = "required").
Result<uint32_t> GetUint(const nlohmann::json& j, const char* name, uint64_t fallback) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) {
    if (fallback == 0) {
      return Status::InvalidArgument(fmt::format("config.json has no \"{}\"", name));
    }
    return static_cast<uint32_t>(fallback);
  }
  if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > (1 << 24)) {
    return Status::InvalidArgument(
        fmt::format("config.json field \"{}\" must be a positive integer, got {}", name, it->dump()));
  }
  return static_cast<uint32_t>(it->get<int64_t>());
}

}  // namespace

uint32_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32: return 4;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2: return 1;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
  }
  return "unknown";
}

Result<DType> ParseDType(std::string_view name) {
  std::string n = Lower(name);
  if (n.starts_with("torch.")) n = n.substr(6);
  if (n == "bfloat16" || n == "bf16") return DType::kBFloat16;
  if (n == "float16" || n == "fp16" || n == "half") return DType::kFloat16;
  if (n == "float32" || n == "fp32" || n == "float") return DType::kFloat32;
  if (n == "float8_e4m3fn" || n == "float8_e4m3" || n == "fp8" || n == "fp8_e4m3") {
    return DType::kFloat8E4M3;
  }
  if (n == "float8_e5m2" || n == "fp8_e5m2") return DType::kFloat8E5M2;
  return Status::InvalidArgument(fmt::format(
      "unknown dtype \"{}\" (expected bfloat16, float16, float32, float8_e4m3fn or float8_e5m2)",
      name));
}

Result<Layout> Layout::KeyValue(uint32_t num_layers, uint32_t num_kv_heads, uint32_t head_dim,
                                DType dtype) {
  if (num_layers == 0 || num_kv_heads == 0 || head_dim == 0) {
    return Status::InvalidArgument(
        fmt::format("layout sizes must be positive (layers={}, kv_heads={}, head_dim={})",
                    num_layers, num_kv_heads, head_dim));
  }
  Layout l;
  l.kind_ = LayoutKind::kKeyValue;
  l.num_layers_ = num_layers;
  l.num_kv_heads_ = num_kv_heads;
  l.head_dim_ = head_dim;
  l.dtype_ = dtype;
  if (l.bytes_per_token() > kMaxBytesPerToken) {
    return Status::InvalidArgument(
        fmt::format("layout of {} bytes per token is implausibly large", l.bytes_per_token()));
  }
  return l;
}

Result<Layout> Layout::Latent(uint32_t num_layers, uint32_t latent_dim, DType dtype) {
  if (num_layers == 0 || latent_dim == 0) {
    return Status::InvalidArgument(fmt::format(
        "layout sizes must be positive (layers={}, latent_dim={})", num_layers, latent_dim));
  }
  Layout l;
  l.kind_ = LayoutKind::kLatent;
  l.num_layers_ = num_layers;
  l.num_kv_heads_ = 1;
  l.head_dim_ = latent_dim;
  l.dtype_ = dtype;
  if (l.bytes_per_token() > kMaxBytesPerToken) {
    return Status::InvalidArgument(
        fmt::format("layout of {} bytes per token is implausibly large", l.bytes_per_token()));
  }
  return l;
}

uint64_t Layout::bytes_per_token_per_layer() const {
  uint64_t elems = kind_ == LayoutKind::kKeyValue ? 2ull * num_kv_heads_ * head_dim_ : head_dim_;
  return elems * DTypeSize(dtype_);
}

uint64_t Layout::Fingerprint() const {
  // SHA-256 of a canonical text, truncated: stable across compilers and hosts (std::hash is not).
  std::string canon = ToString();
  Sha256 h;
  h.Update(canon.data(), canon.size());
  auto digest = h.Final();
  uint64_t fp = 0;
  for (int i = 0; i < 8; ++i) fp = (fp << 8) | digest[i];
  return fp;
}

std::string Layout::ToString() const {
  if (kind_ == LayoutKind::kLatent) {
    return fmt::format("latent(layers={}, latent_dim={}, {})", num_layers_, head_dim_,
                       DTypeName(dtype_));
  }
  return fmt::format("kv(layers={}, kv_heads={}, head_dim={}, {})", num_layers_, num_kv_heads_,
                     head_dim_, DTypeName(dtype_));
}

Result<Layout> Layout::FromHfConfigJson(std::string_view json_text,
                                        uint32_t tensor_parallel_size,
                                        std::string_view dtype_override) {
  if (tensor_parallel_size == 0) {
    return Status::InvalidArgument("tensor_parallel_size must be at least 1");
  }
  nlohmann::json root = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return Status::InvalidArgument("config.json is not a valid JSON object");
  }
  const nlohmann::json* cfg = &root;
  if (!root.contains("num_hidden_layers") && root.contains("text_config") &&
      root["text_config"].is_object()) {
    cfg = &root["text_config"];
  }
  const nlohmann::json& j = *cfg;

  auto config_dtype = [&]() -> std::string {
    for (const char* field : {"torch_dtype", "dtype"}) {
      for (const nlohmann::json* obj : std::array<const nlohmann::json*, 2>{cfg, &root}) {
        auto it = obj->find(field);
        if (it != obj->end() && it->is_string()) return it->get<std::string>();
      }
    }
    return "bfloat16";
  };
  std::string dtype_name = dtype_override.empty() ? config_dtype() : std::string(dtype_override);
  KVTIER_ASSIGN_OR_RETURN(DType dtype, ParseDType(dtype_name));
  KVTIER_ASSIGN_OR_RETURN(uint32_t layers, GetUint(j, "num_hidden_layers", 0));

  if (j.contains("kv_lora_rank") && !j["kv_lora_rank"].is_null()) {
    KVTIER_ASSIGN_OR_RETURN(uint32_t rank, GetUint(j, "kv_lora_rank", 0));
    KVTIER_ASSIGN_OR_RETURN(uint32_t rope, GetUint(j, "qk_rope_head_dim", 0));
    return Latent(layers, rank + rope, dtype);
  }

  KVTIER_ASSIGN_OR_RETURN(uint32_t heads, GetUint(j, "num_attention_heads", 0));
  KVTIER_ASSIGN_OR_RETURN(uint32_t kv_heads, GetUint(j, "num_key_value_heads", heads));
  uint64_t default_head_dim = 0;
  if (j.contains("hidden_size") && j["hidden_size"].is_number_integer()) {
    default_head_dim = j["hidden_size"].get<uint64_t>() / heads;
  }
  KVTIER_ASSIGN_OR_RETURN(uint32_t head_dim, GetUint(j, "head_dim", default_head_dim));
  // Each rank holds kv_heads / tp heads; with more ranks than heads, heads are replicated.
  uint32_t per_rank = std::max<uint32_t>(1, kv_heads / tensor_parallel_size);
  if (kv_heads >= tensor_parallel_size && kv_heads % tensor_parallel_size != 0) {
    return Status::InvalidArgument(fmt::format(
        "{} KV heads cannot be split evenly over tensor-parallel size {}", kv_heads,
        tensor_parallel_size));
  }
  return KeyValue(layers, per_rank, head_dim, dtype);
}

Result<Layout> Layout::FromHfConfigFile(const std::string& path, uint32_t tensor_parallel_size,
                                        std::string_view dtype_override) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(fmt::format("cannot open config file {}", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto layout = FromHfConfigJson(ss.str(), tensor_parallel_size, dtype_override);
  if (!layout.ok()) return layout.status().WithContext(path);
  return layout;
}

}  // namespace kvtier
