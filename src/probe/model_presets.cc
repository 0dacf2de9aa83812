#include "probe/model_presets.h"

#include <algorithm>
#include <cctype>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace kvtier::probe {
namespace {

struct Preset {
  const char* name;
  const char* config_json;  // the fields of the model's published config.json that shape its KV
};

// Shapes from the models' published config.json files.
constexpr Preset kPresets[] = {
    {"qwen3-8b",
     R"({"num_hidden_layers":36,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,"hidden_size":4096,"torch_dtype":"bfloat16"})"},
    {"qwen3-32b",
     R"({"num_hidden_layers":64,"num_attention_heads":64,"num_key_value_heads":8,"head_dim":128,"hidden_size":5120,"torch_dtype":"bfloat16"})"},
    {"llama-3.1-8b",
     R"({"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"hidden_size":4096,"torch_dtype":"bfloat16"})"},
    {"llama-3.1-70b",
     R"({"num_hidden_layers":80,"num_attention_heads":64,"num_key_value_heads":8,"hidden_size":8192,"torch_dtype":"bfloat16"})"},
    {"deepseek-v3",
     R"({"num_hidden_layers":61,"num_attention_heads":128,"kv_lora_rank":512,"qk_rope_head_dim":64,"hidden_size":7168,"torch_dtype":"bfloat16"})"},
};

std::string Normalize(std::string_view name) {
  // "Qwen/Qwen3-8B" -> "qwen3-8b"; "Meta-Llama-3.1-8B-Instruct" -> "llama-3.1-8b-instruct".
  auto slash = name.rfind('/');
  if (slash != std::string_view::npos) name = name.substr(slash + 1);
  std::string out;
  for (char c : name) out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (out.rfind("meta-", 0) == 0) out = out.substr(5);
  for (const char* suffix : {"-instruct", "-chat", "-base"}) {
    std::string_view s(suffix);
    if (out.size() > s.size() && out.compare(out.size() - s.size(), s.size(), s) == 0) {
      out.resize(out.size() - s.size());
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> KnownModelNames() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

Result<Layout> ResolveModelLayout(std::string_view name_or_path) {
  std::error_code ec;
  std::filesystem::path path(name_or_path);
  if (std::filesystem::is_directory(path, ec)) path /= "config.json";
  if (std::filesystem::is_regular_file(path, ec)) {
    auto layout = Layout::FromHfConfigFile(path.string());
    if (!layout.ok()) return layout.status().WithContext(fmt::format("model {}", path.string()));
    return layout;
  }
  const std::string wanted = Normalize(name_or_path);
  for (const auto& p : kPresets) {
    if (wanted == p.name) return Layout::FromHfConfigJson(p.config_json);
  }
  return Status::InvalidArgument(fmt::format(
      "unknown model \"{}\": give a path to a config.json or one of {}", name_or_path,
      fmt::join(KnownModelNames(), ", ")));
}

}  // namespace kvtier::probe
