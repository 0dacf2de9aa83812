#include "probe/model_presets.h"

#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/model_presets.h"

namespace kvtier::probe {

std::vector<std::string> KnownModelNames() { return ModelPresetNames(); }

Result<Layout> ResolveModelLayout(std::string_view name_or_path) {
  std::error_code ec;
  std::filesystem::path path(name_or_path);
  if (std::filesystem::is_directory(path, ec)) path /= "config.json";
  if (std::filesystem::is_regular_file(path, ec)) {
    auto layout = Layout::FromHfConfigFile(path.string());
    if (!layout.ok()) return layout.status().WithContext(fmt::format("model {}", path.string()));
    return layout;
  }
  if (const ModelPreset* preset = FindModelPreset(name_or_path)) {
    return Layout::FromHfConfigJson(preset->config_json);
  }
  return Status::InvalidArgument(fmt::format(
      "unknown model \"{}\": give a path to a config.json or one of {}", name_or_path,
      fmt::join(KnownModelNames(), ", ")));
}

}  // namespace kvtier::probe
