#include "planner/units.h"

#include "common/units.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <system_error>

namespace kvtier::planner {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Splits "3.55GB/s" into the number and the rest. Fails when no number leads.
Result<std::pair<double, std::string_view>> SplitNumber(std::string_view text,
                                                        std::string_view what) {
  std::string_view s = Trim(text);
  if (s.empty()) return Status::InvalidArgument(fmt::format("empty {}", what));
  double value = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr == s.data()) {
    return Status::InvalidArgument(fmt::format("{} '{}' does not start with a number", what, text));
  }
  if (!std::isfinite(value)) {
    return Status::InvalidArgument(fmt::format("{} '{}' is not finite", what, text));
  }
  if (value < 0) return Status::InvalidArgument(fmt::format("{} '{}' is negative", what, text));
  return std::make_pair(value, Trim(std::string_view(ptr, s.data() + s.size() - ptr)));
}

}  // namespace

Result<double> ParseBytes(std::string_view text) { return ParseSize(text, kStrictSize); }

Result<double> ParseBandwidth(std::string_view text) {
  std::string_view size = Trim(text);
  if (size.ends_with("/s")) {
    size.remove_suffix(2);
  } else if (size.ends_with("ps")) {  // Gbps, MBps
    size.remove_suffix(2);
  } else {
    return Status::InvalidArgument(fmt::format(
        "bandwidth '{}' needs a unit per second, e.g. 3.55GB/s, 20GiB/s, 25Gbit/s", text));
  }
  auto value = ParseSize(size, kStrictSize);
  if (!value.ok()) return value.status().WithContext(fmt::format("bandwidth '{}'", text));
  if (*value <= 0) return Status::InvalidArgument(fmt::format("bandwidth '{}' must be > 0", text));
  return *value;
}

Result<double> ParseDuration(std::string_view text) {
  KVTIER_ASSIGN_OR_RETURN(auto parsed, SplitNumber(text, "duration"));
  std::string_view unit = parsed.second;
  if (unit.empty() || unit == "s" || unit == "sec") return parsed.first;
  if (unit == "ms") return parsed.first / 1e3;
  if (unit == "m" || unit == "min") return parsed.first * 60;
  if (unit == "h") return parsed.first * 3600;
  return Status::InvalidArgument(
      fmt::format("duration '{}': unknown unit '{}' (use ms, s, m or h)", text, unit));
}

Result<uint64_t> ParseTokens(std::string_view text) {
  KVTIER_ASSIGN_OR_RETURN(auto parsed, SplitNumber(text, "token count"));
  double value = parsed.first;
  if (parsed.second == "k" || parsed.second == "K") {
    value *= 1024;
  } else if (!parsed.second.empty()) {
    return Status::InvalidArgument(
        fmt::format("token count '{}': expected a whole number, optionally with k (x1024)", text));
  }
  if (value != std::floor(value) || value > 1e12) {
    return Status::InvalidArgument(fmt::format("token count '{}' is not a whole number", text));
  }
  return static_cast<uint64_t>(value);
}

Result<std::vector<uint64_t>> ParseTokenList(std::string_view text) {
  std::vector<uint64_t> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = Trim(text.substr(start, comma - start));
    if (item.empty()) {
      return Status::InvalidArgument(fmt::format("empty entry in token list '{}'", text));
    }
    KVTIER_ASSIGN_OR_RETURN(uint64_t v, ParseTokens(item));
    out.push_back(v);
    start = comma + 1;
  }
  return out;
}

Result<std::vector<std::pair<uint64_t, double>>> ParseTokenTable(
    std::string_view text, std::string_view value_name, std::string_view example,
    const std::function<Result<double>(std::string_view)>& parse_value) {
  std::vector<std::pair<uint64_t, double>> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = Trim(text.substr(start, comma - start));
    size_t colon = item.find(':');
    if (colon == std::string_view::npos) {
      return Status::InvalidArgument(
          fmt::format("table entry '{}' is not TOKENS:{} (e.g. {})", item, value_name, example));
    }
    KVTIER_ASSIGN_OR_RETURN(uint64_t tokens, ParseTokens(item.substr(0, colon)));
    KVTIER_ASSIGN_OR_RETURN(double value, parse_value(item.substr(colon + 1)));
    out.emplace_back(tokens, value);
    start = comma + 1;
  }
  return out;
}

Result<std::vector<std::pair<uint64_t, double>>> ParseTokenSecondsTable(std::string_view text) {
  return ParseTokenTable(text, "SECONDS", "4096:0.135", ParseDuration);
}

Result<double> ParseNumber(std::string_view text, std::string_view what) {
  KVTIER_ASSIGN_OR_RETURN(auto parsed, SplitNumber(text, what));
  if (!parsed.second.empty()) {
    return Status::InvalidArgument(fmt::format("{} '{}' is not a plain number", what, text));
  }
  return parsed.first;
}

std::string FormatBytes(double bytes) {
  static constexpr const char* kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB"};
  int i = 0;
  while (bytes >= 1000 && i < 5) {
    bytes /= 1000;
    ++i;
  }
  if (i == 0) return fmt::format("{:.0f} B", bytes);
  return fmt::format("{:.{}f} {}", bytes, bytes < 10 ? 2 : (bytes < 100 ? 1 : 0), kUnits[i]);
}

std::string FormatBandwidth(double bytes_per_second) {
  return FormatBytes(bytes_per_second) + "/s";
}

std::string FormatSeconds(double seconds) {
  if (seconds < 1e-3) return fmt::format("{:.0f} us", seconds * 1e6);
  if (seconds < 1) return fmt::format("{:.{}f} ms", seconds * 1e3, seconds < 0.1 ? 1 : 0);
  return fmt::format("{:.2f} s", seconds);
}

}  // namespace kvtier::planner
