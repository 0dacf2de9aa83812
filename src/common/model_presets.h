// The models kvtier knows by name: one table for every tool (kvtier serve, bench storage, plan,
// simulate). A preset is the part of the model's published Hugging Face config.json that shapes
// its KV cache and its compute, so naming a preset and passing that config.json agree.
//
// Thread-safety: immutable data and pure functions.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier {

struct ModelPreset {
  std::string_view name;          // "qwen3-8b"
  std::string_view config_json;   // fields of the published config.json
  std::string_view weight_dtype;  // of the published weights (DeepSeek-V3 ships fp8)
};

std::span<const ModelPreset> ModelPresets();
// "qwen3-0.6b", "qwen3-8b", ...
std::vector<std::string> ModelPresetNames();

// The preset `name` names, or nullptr. Case-insensitive; an organization prefix ("Qwen/"), a
// leading "meta-" and a trailing "-instruct", "-chat" or "-base" are ignored, so
// "Qwen/Qwen3-8B" and "meta-llama/Meta-Llama-3.1-8B-Instruct" match. A name with a '/' that
// exists as a file or directory is a path, never a preset.
const ModelPreset* FindModelPreset(std::string_view name);

}  // namespace kvtier
