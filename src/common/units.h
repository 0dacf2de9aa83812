// Sizes as people write them on command lines and in configuration, with one rule everywhere:
//
//   B, byte, bytes                  bytes
//   kB/KB, MB, GB, TB, PB           powers of 1000 (decimal, SI): 1 GB = 10^9 bytes
//   KiB, MiB, GiB, TiB, PiB         powers of 1024 (binary, IEC): 1 GiB = 2^30 bytes
//   Ki, Mi, Gi, Ti, Pi              the same binary units without the B
//   K, M, G, T, P (no B)            binary, as in dd and fio: 1G = 2^30 bytes (kStrict refuses)
//   a bare number                   bytes (kStrict refuses it: "8" may mean bytes, GB or GiB)
//   b, bit, bits (with allow_bits)  bits: 25Gb = 25 x 10^9 bits
//
// Letters are case-insensitive, except that where bits are allowed a lowercase "b" means bits
// and "B" bytes. Blanks around the number and the unit are ignored ("512 MiB").
//
// Flags that take a bare number in a fixed unit name it in their names and help: --l1-size-gb
// and "max_size_gb" are in GiB (2^30 bytes).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>

#include "kvtier/status.h"

namespace kvtier {

struct SizeSyntax {
  // Refuse the ambiguous forms: a bare number and a prefix without B ("8", "8G").
  bool strict = false;
  // A lowercase "b", "bit" or "bits" means bits (bandwidths on networks). Otherwise "b" is bytes
  // and "bit" is refused.
  bool allow_bits = false;
};
inline constexpr SizeSyntax kLenientSize{false, false};  // storage tools: "4096", "512K"
inline constexpr SizeSyntax kStrictSize{true, true};     // the planner: "8GiB", "19GB", "25Gb"

// Bytes, as a double (may be fractional when bits or decimals are involved). InvalidArgument,
// naming the text, on an empty, negative, non-finite or malformed size or an unknown unit.
Result<double> ParseSize(std::string_view text, SizeSyntax syntax);

// A whole number of bytes with kLenientSize ("4096", "512K", "36MiB", "1.5G", "100MB").
// InvalidArgument also on a fraction of a byte ("1.5", "0.3K") and on sizes of 2^63 or more.
Result<uint64_t> ParseByteCount(std::string_view text);

}  // namespace kvtier
