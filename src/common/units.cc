#include "common/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>
#include <system_error>

#include <fmt/format.h>

#include "common/strings.h"

namespace kvtier {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

constexpr const char* kUnitsHelp =
    "use B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024)";

}  // namespace

Result<double> ParseSize(std::string_view text, SizeSyntax syntax) {
  const std::string_view s = Trim(text);
  if (s.empty()) return Status::InvalidArgument("empty size");
  if (s.front() == '-') return Status::InvalidArgument(fmt::format("size \"{}\" is negative", text));
  double value = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr == s.data()) {
    return Status::InvalidArgument(fmt::format(
        "size \"{}\" does not start with a number (try 4096, 512KiB, 36MiB, 8GiB, 19GB)", text));
  }
  if (!std::isfinite(value) || value < 0) {
    return Status::InvalidArgument(fmt::format("size \"{}\" is not a finite size", text));
  }
  const std::string_view unit = Trim(std::string_view(ptr, s.data() + s.size() - ptr));
  if (unit.empty()) {
    if (syntax.strict) {
      return Status::InvalidArgument(fmt::format(
          "size \"{}\" has no unit: write e.g. 8GiB (2^30 bytes each), 19GB (10^9) or 512MiB", text));
    }
    return value;
  }
  // Prefix letter, then an optional "i" (binary), then the rest: "", b/B, byte(s), bit(s).
  size_t i = 0;
  int power = 0;
  switch (std::tolower(static_cast<unsigned char>(unit[0]))) {
    case 'k': power = 1; break;
    case 'm': power = 2; break;
    case 'g': power = 3; break;
    case 't': power = 4; break;
    case 'p': power = 5; break;
    default: power = 0;
  }
  bool binary_marked = false;
  if (power > 0) {
    i = 1;
    if (unit.size() > 1 && (unit[1] == 'i' || unit[1] == 'I')) {
      binary_marked = true;
      i = 2;
    }
  }
  const std::string_view rest = unit.substr(i);
  const std::string lower = Lower(rest);
  bool bits = false;
  bool has_b = true;
  if (rest.empty()) {
    has_b = false;
  } else if (rest == "b") {
    bits = syntax.allow_bits;
  } else if (rest == "B" || lower == "byte" || lower == "bytes") {
    bits = false;
  } else if (syntax.allow_bits && (rest == "bit" || rest == "bits")) {
    bits = true;
  } else {
    return Status::InvalidArgument(
        fmt::format("size \"{}\": unknown unit \"{}\" ({}{})", text, unit, kUnitsHelp,
                    syntax.allow_bits ? ", Gb or Gbit for bits" : ", or K/M/G for KiB/MiB/GiB"));
  }
  if (power == 0 && !has_b) {
    return Status::InvalidArgument(fmt::format("size \"{}\": unknown unit \"{}\" ({})", text, unit,
                                               kUnitsHelp));
  }
  // A prefix alone ("8G") is binary, as in dd and fio; with a B it is decimal unless marked "i".
  const bool bare_prefix = power > 0 && !binary_marked && !has_b;
  if (bare_prefix && syntax.strict) {
    return Status::InvalidArgument(fmt::format(
        "size \"{}\" is ambiguous: write {}{}iB (powers of 1024) or {}{}B (powers of 1000)", text,
        std::string_view(s.data(), ptr - s.data()), static_cast<char>(std::toupper(unit[0])),
        std::string_view(s.data(), ptr - s.data()), static_cast<char>(std::toupper(unit[0]))));
  }
  const bool binary = binary_marked || bare_prefix;
  const double scale = std::pow(binary ? 1024.0 : 1000.0, power);
  return value * scale / (bits ? 8.0 : 1.0);
}

Result<uint64_t> ParseByteCount(std::string_view text) {
  KVTIER_ASSIGN_OR_RETURN(double bytes, ParseSize(text, kLenientSize));
  if (bytes >= 9.223372036854775808e18) {  // 2^63
    return Status::InvalidArgument(fmt::format("size \"{}\" is too large", text));
  }
  if (bytes != std::floor(bytes)) {
    return Status::InvalidArgument(fmt::format("size \"{}\" is not a whole number of bytes", text));
  }
  return static_cast<uint64_t>(bytes);
}

}  // namespace kvtier
