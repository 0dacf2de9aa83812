#include "probe/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace kvtier::probe {

Result<std::vector<int>> ParseIntList(std::string_view text, int min, int max) {
  std::vector<int> out;
  size_t pos = 0;
  while (true) {
    size_t comma = text.find(',', pos);
    std::string_view item =
        text.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.remove_suffix(1);
    int value = 0;
    auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size()) {
      return Status::InvalidArgument(
          fmt::format("\"{}\" is not a comma-separated list of integers", text));
    }
    if (value < min || value > max) {
      return Status::InvalidArgument(
          fmt::format("{} in \"{}\" is out of range [{}, {}]", value, text, min, max));
    }
    out.push_back(value);
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  if (value == std::floor(value)) return fmt::format("{:.0f} {}", value, kUnits[unit]);
  return fmt::format("{:.3g} {}", value, kUnits[unit]);
}

}  // namespace kvtier::probe
