// Parsing and printing of the quantities the planner takes on its command line: sizes ("8GiB",
// "19GB"), bandwidths ("3.55GB/s", "20GiB/s", "25Gbit/s"), durations ("20m", "1200s"), token
// counts ("24576", "24k") and token:seconds tables.
//
// Sizes and bandwidths follow the one rule of common/units.h, with kStrictSize: decimal units
// (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024; "B" is
// bytes, "b"/"bit" bits. A size without a unit, or with a bare prefix ("8G"), is refused: it
// could mean bytes, GB or GiB, and a planner must not guess. All functions are pure and
// thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::planner {

// "8GiB" -> 8589934592. Fails on a missing or ambiguous unit, a negative or non-finite value.
Result<double> ParseBytes(std::string_view text);
// "3.55GB/s" -> 3.55e9 bytes per second; also "GiB/s", "Gbit/s", "Gbps", "MB/s". Must be > 0.
Result<double> ParseBandwidth(std::string_view text);
// "1200", "1200s", "20m", "1.5h", "250ms" -> seconds. A bare number is seconds. Must be >= 0.
Result<double> ParseDuration(std::string_view text);
// "24576" or "24k" (k = 1024 tokens, the way context lengths are usually quoted). Must be >= 0.
Result<uint64_t> ParseTokens(std::string_view text);
// "8192,16384,24k" -> {8192, 16384, 24576}; empty entries are refused.
Result<std::vector<uint64_t>> ParseTokenList(std::string_view text);
// "TOKENS:VALUE,..." -> {{tokens, value}, ...}, each value read by `parse_value`; an entry
// without a colon is refused as not TOKENS:`value_name` (e.g. `example`).
Result<std::vector<std::pair<uint64_t, double>>> ParseTokenTable(
    std::string_view text, std::string_view value_name, std::string_view example,
    const std::function<Result<double>(std::string_view)>& parse_value);
// "4096:0.135,8192:0.280" -> {{4096, 0.135}, {8192, 0.280}}.
Result<std::vector<std::pair<uint64_t, double>>> ParseTokenSecondsTable(std::string_view text);
// A plain non-negative number ("0.65", "1e-3").
Result<double> ParseNumber(std::string_view text, std::string_view what);

// 3.62e9 -> "3.62 GB"; 0 -> "0 B".
std::string FormatBytes(double bytes);
// 3.55e9 -> "3.55 GB/s".
std::string FormatBandwidth(double bytes_per_second);
// 0.0123 -> "12.3 ms"; 1.5 -> "1.50 s".
std::string FormatSeconds(double seconds);

}  // namespace kvtier::planner
