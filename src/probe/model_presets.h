// Model names the measurement tools accept in --model, mapped to KV layouts (the presets of
// common/model_presets.h).
//
// Thread-safety: free functions without shared state.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kvtier/layout.h"
#include "kvtier/status.h"

namespace kvtier::probe {

// `name_or_path` is either a path to a Hugging Face config.json (or a directory holding one) or
// one of KnownModelNames() (case-insensitive; "Qwen/Qwen3-8B" style names also match).
// Fails with InvalidArgument naming the known presets when it is neither.
Result<Layout> ResolveModelLayout(std::string_view name_or_path);

// The built-in preset names, e.g. "qwen3-8b".
std::vector<std::string> KnownModelNames();

}  // namespace kvtier::probe
