// Parsing and printing of the quantities the measurement tools take on their command lines.
//
// Thread-safety: free functions without shared state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::probe {

// "4096", "512K", "36MiB", "1GiB", "1.5G", "100MB". Binary units (K, M, G, T, with or without
// "iB") are powers of 1024; decimal ones (KB, MB, GB, TB) powers of 1000; a trailing "B" alone
// means bytes. Fails on empty, negative, fractional-byte or overflowing input.
Result<uint64_t> ParseByteSize(std::string_view text);

// "1,16,32" -> {1, 16, 32}. Each value must lie in [min, max]; fails on empty items or junk.
Result<std::vector<int>> ParseIntList(std::string_view text, int min, int max);

// 37748736 -> "36 MiB", 1536 -> "1.5 KiB", 100 -> "100 B".
std::string FormatBytes(uint64_t bytes);

}  // namespace kvtier::probe
