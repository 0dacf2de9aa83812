#include "probe/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace kvtier::probe {
namespace {

std::string Lower(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c))) {
      out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    }
  }
  return out;
}

}  // namespace

Result<uint64_t> ParseByteSize(std::string_view text) {
  const std::string s = Lower(text);
  size_t digits = 0;
  while (digits < s.size() && (std::isdigit(static_cast<unsigned char>(s[digits])) || s[digits] == '.')) {
    ++digits;
  }
  if (digits == 0) {
    return Status::InvalidArgument(fmt::format("not a size: \"{}\" (try 4096, 512K, 36MiB, 1G)", text));
  }
  double number = 0;
  const std::string num_text = s.substr(0, digits);
  auto [ptr, ec] = std::from_chars(num_text.data(), num_text.data() + num_text.size(), number);
  if (ec != std::errc() || ptr != num_text.data() + num_text.size()) {
    return Status::InvalidArgument(fmt::format("not a size: \"{}\"", text));
  }
  const std::string unit = s.substr(digits);
  double scale = 0;
  if (unit.empty() || unit == "b") {
    scale = 1;
  } else if (unit == "k" || unit == "kib" || unit == "ki") {
    scale = 1024.0;
  } else if (unit == "m" || unit == "mib" || unit == "mi") {
    scale = 1024.0 * 1024;
  } else if (unit == "g" || unit == "gib" || unit == "gi") {
    scale = 1024.0 * 1024 * 1024;
  } else if (unit == "t" || unit == "tib" || unit == "ti") {
    scale = 1024.0 * 1024 * 1024 * 1024;
  } else if (unit == "kb") {
    scale = 1e3;
  } else if (unit == "mb") {
    scale = 1e6;
  } else if (unit == "gb") {
    scale = 1e9;
  } else if (unit == "tb") {
    scale = 1e12;
  } else {
    return Status::InvalidArgument(
        fmt::format("unknown size unit \"{}\" in \"{}\" (use B, K/KiB, M/MiB, G/GiB, KB, MB, GB)",
                    unit, text));
  }
  const double bytes = number * scale;
  if (bytes >= static_cast<double>(std::numeric_limits<uint64_t>::max() / 2)) {
    return Status::InvalidArgument(fmt::format("size \"{}\" is too large", text));
  }
  if (bytes != std::floor(bytes)) {
    return Status::InvalidArgument(fmt::format("size \"{}\" is not a whole number of bytes", text));
  }
  return static_cast<uint64_t>(bytes);
}

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
