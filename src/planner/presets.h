// Model and GPU descriptions the planner needs beyond the KV layout: parameter counts (for the
// prefill FLOPs and the weights that share GPU memory with the KV cache), the attention width
// (for the quadratic part of prefill), and per-GPU memory, peak bf16 FLOP/s and HBM bandwidth.
//
// Models come from a preset name or a Hugging Face config.json; GPUs only from presets (their
// numbers can be overridden on the command line). Values; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/layout.h"
#include "kvtier/status.h"

namespace kvtier::planner {

struct ModelSpec {
  std::string name;
  std::string layout;  // one tensor-parallel rank's KV layout, as Layout::ToString
  uint64_t rank_kv_bytes_per_token = 0;
  DType kv_dtype = DType::kBFloat16;
  uint32_t tensor_parallel = 1;  // ranks the model is split over
  double total_params = 0;       // all weights (memory)
  double active_params = 0;      // weights one token passes through (FLOPs, decode reads)
  double weight_bytes_per_param = 2;
  uint32_t num_layers = 0;
  uint32_t attention_heads = 0;  // query heads, all ranks
  uint32_t qk_head_dim = 0;      // per query head, for Q.K^T
  uint32_t v_head_dim = 0;       // per head, for P.V
  uint64_t max_context = 0;      // max_position_embeddings, 0 = unknown

  // KV bytes per token summed over all tensor-parallel ranks (what the GPUs hold together and
  // what offload moves). For MLA the latent is replicated on every rank, as vLLM does.
  uint64_t kv_bytes_per_token() const { return rank_kv_bytes_per_token * tensor_parallel; }
  double weight_bytes() const { return total_params * weight_bytes_per_param; }
  // FLOPs of prefilling tokens [m, m+n) with m tokens already cached: 2 x active params per
  // token plus causal attention of each new token over everything before it.
  double PrefillFlops(uint64_t cached, uint64_t new_tokens) const;
};

// `name_or_path`: a preset of common/model_presets.h ("qwen3-8b", "llama-3.1-70b",
// "deepseek-v3", ...; "Qwen/Qwen3-8B" style names too) or a path to a config.json. `kv_dtype`
// (empty = the model's) overrides the KV cache dtype; `weight_dtype` (empty = the preset's, bf16
// for config files) the weights'. Fails on an unknown name, an
// unreadable or incomplete config, or a TP size the model cannot be split over.
Result<ModelSpec> LoadModel(std::string_view name_or_path, uint32_t tensor_parallel,
                            std::string_view kv_dtype = "", std::string_view weight_dtype = "");
// From the text of a config.json (what LoadModel does after reading the file).
Result<ModelSpec> ModelFromConfigJson(std::string_view json_text, std::string name,
                                      uint32_t tensor_parallel, std::string_view kv_dtype,
                                      std::string_view weight_dtype);
std::vector<std::string> ModelPresetNames();

struct GpuSpec {
  std::string name;
  double memory_bytes = 0;     // per GPU, as the driver reports it
  double peak_flops = 0;       // dense bf16 tensor-core FLOP/s per GPU
  double hbm_bytes_per_s = 0;  // per GPU
};

// "h200", "h100", "a100-80g", "a100-40g", "l40s" (also "h100-sxm", "a100", any case, an "nvidia-"
// prefix, "gb" for "g"). Fails on an unknown name.
Result<GpuSpec> LoadGpu(std::string_view name);
std::vector<std::string> GpuPresetNames();

}  // namespace kvtier::planner
