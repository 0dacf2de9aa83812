// Small string helpers shared by every component.
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <string_view>

namespace kvtier {

// ASCII lowercase ("BF16" -> "bf16"); other bytes unchanged.
inline std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

}  // namespace kvtier
