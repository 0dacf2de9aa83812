// Layout: what one token's KV cache looks like for one model on one tensor-parallel rank.
//
// Two shapes are covered:
//  * kKeyValue: every layer keeps a K and a V vector per KV head (MHA, GQA, MQA);
//    bytes per token = layers x 2 x kv_heads x head_dim x dtype size.
//  * kLatent: every layer keeps one compressed latent per token (DeepSeek's MLA);
//    bytes per token = layers x latent_dim x dtype size, with latent_dim = kv_lora_rank +
//    qk_rope_head_dim.
// A Layout is an immutable value, safe to share between threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvtier/status.h"

namespace kvtier {

enum class DType : uint8_t { kFloat16, kBFloat16, kFloat32, kFloat8E4M3, kFloat8E5M2 };

// Size of one element in bytes.
uint32_t DTypeSize(DType dtype);
std::string_view DTypeName(DType dtype);
// Accepts the names used by PyTorch and Hugging Face ("bfloat16", "bf16", "float16", "fp16",
// "half", "float32", "fp32", "float", "float8_e4m3fn", "fp8", "float8_e5m2").
Result<DType> ParseDType(std::string_view name);

enum class LayoutKind : uint8_t { kKeyValue, kLatent };

class Layout {
 public:
  // Dense attention with separate K and V (MHA/GQA/MQA). Fails on zero sizes or absurdly large
  // ones (more than 1 GiB per token).
  static Result<Layout> KeyValue(uint32_t num_layers, uint32_t num_kv_heads, uint32_t head_dim,
                                 DType dtype);
  // MLA-style: one latent vector of latent_dim elements per token and layer.
  static Result<Layout> Latent(uint32_t num_layers, uint32_t latent_dim, DType dtype);

  // From the text of a Hugging Face config.json. Reads num_hidden_layers, num_key_value_heads
  // (default num_attention_heads), head_dim (default hidden_size / num_attention_heads),
  // torch_dtype or dtype (default bfloat16), and for MLA models kv_lora_rank and
  // qk_rope_head_dim. Multimodal configs with a "text_config" object use that object.
  // `dtype_override` (empty = none) replaces the config's dtype, e.g. for an fp8 KV cache.
  // `tensor_parallel_size` splits KV heads across ranks (at least one head per rank; MLA latents
  // are replicated on every rank, as vLLM does).
  static Result<Layout> FromHfConfigJson(std::string_view json_text, uint32_t tensor_parallel_size = 1,
                                         std::string_view dtype_override = "");
  // Same, reading the file at `path`.
  static Result<Layout> FromHfConfigFile(const std::string& path, uint32_t tensor_parallel_size = 1,
                                         std::string_view dtype_override = "");

  LayoutKind kind() const { return kind_; }
  uint32_t num_layers() const { return num_layers_; }
  uint32_t num_kv_heads() const { return num_kv_heads_; }  // 1 for kLatent
  uint32_t head_dim() const { return head_dim_; }          // latent_dim for kLatent
  DType dtype() const { return dtype_; }

  // Bytes of one token on one layer (K and V together for kKeyValue).
  uint64_t bytes_per_token_per_layer() const;
  // Bytes of one token across all layers.
  uint64_t bytes_per_token() const { return bytes_per_token_per_layer() * num_layers_; }
  uint64_t bytes_per_chunk(uint32_t chunk_tokens) const {
    return bytes_per_token() * chunk_tokens;
  }

  // A stable 64-bit fingerprint of the shape (kind, layers, heads, head_dim, dtype). Identical
  // across processes, hosts and versions; two layouts with the same fingerprint have the same
  // bytes per token and element order.
  uint64_t Fingerprint() const;
  // e.g. "kv(layers=36, kv_heads=8, head_dim=128, bfloat16)".
  std::string ToString() const;

  bool operator==(const Layout&) const = default;

 private:
  Layout() = default;
  LayoutKind kind_ = LayoutKind::kKeyValue;
  uint32_t num_layers_ = 0;
  uint32_t num_kv_heads_ = 0;
  uint32_t head_dim_ = 0;
  DType dtype_ = DType::kBFloat16;
};

}  // namespace kvtier
