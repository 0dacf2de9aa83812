// Parsing and printing of the quantities the measurement tools take on their command lines.
// Sizes are parsed by kvtier::ParseByteCount (common/units.h), the rule every tool shares.
//
// Thread-safety: free functions without shared state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::probe {

// "1,16,32" -> {1, 16, 32}. Each value must lie in [min, max]; fails on empty items or junk.
Result<std::vector<int>> ParseIntList(std::string_view text, int min, int max);

// 37748736 -> "36 MiB", 1536 -> "1.5 KiB", 100 -> "100 B".
std::string FormatBytes(uint64_t bytes);

}  // namespace kvtier::probe
