// PrefillCost: how long the GPU takes to prefill n new tokens when m tokens of the same sequence
// are already cached.
//
// Two sources:
//  * A measured table of full prefills from an empty cache, (tokens, seconds). Between points the
//    cumulative cost F(L) is interpolated linearly through (0, 0); beyond the last point it grows
//    like the least-squares fit b*L + c*L^2 of the table (linear = weights, quadratic = causal
//    attention), joined continuously to the last point.
//  * FLOPs: 2 x active params per token plus causal attention, divided by the GPUs' peak FLOP/s
//    times an efficiency (the fraction of peak a real prefill reaches; ~0.5 on an H200).
// Either way the cost of n new tokens after m cached is F(m+n) - F(m): the new tokens do the same
// work as the tail of a full prefill of m+n tokens. Fixed per-call overheads (framework, kernel
// launches) are not in F; the simulator's per-step overhead carries them.
// Immutable after creation; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/status.h"
#include "planner/presets.h"

namespace kvtier::planner {

class PrefillCost {
 public:
  // REQUIRES: at least one point; tokens strictly increasing after sorting, seconds > 0 and
  // non-decreasing with tokens. Fails otherwise.
  static Result<PrefillCost> FromTable(std::vector<std::pair<uint64_t, double>> points);
  // REQUIRES: 0 < efficiency <= 1, peak_flops > 0.
  static Result<PrefillCost> FromFlops(const ModelSpec& model, double peak_flops_per_gpu,
                                       double efficiency);

  // Seconds to prefill `tokens` from an empty cache.
  double Full(uint64_t tokens) const { return Cumulative(tokens); }
  // Seconds to prefill `new_tokens` more when `cached` are already in the KV cache.
  double Suffix(uint64_t cached, uint64_t new_tokens) const {
    return Cumulative(cached + new_tokens) - Cumulative(cached);
  }
  // Seconds the attention of `new_tokens` over `cached` earlier tokens adds to a prefill (the
  // quadratic term's cross part: the table's fit, or the FLOP model's query-key pairs).
  double CachedAttention(uint64_t cached, uint64_t new_tokens) const;
  // Seconds to prefill `new_tokens` in a call of their own after a prefix hit of `cached`
  // tokens: a full prefill of new_tokens (so a table point near that length brings the fixed
  // cost of one forward pass with it) plus CachedAttention. Suffix() differences the cumulative
  // cost instead, which is right inside a long prefill but leaves out that fixed cost.
  double HitSuffix(uint64_t cached, uint64_t new_tokens) const {
    return Full(new_tokens) + CachedAttention(cached, new_tokens);
  }
  // "table (5 points, measured)" or "FLOPs at 50% of 989 TFLOP/s".
  const std::string& description() const { return description_; }
  const std::vector<std::pair<uint64_t, double>>& table() const { return table_; }

 private:
  double Cumulative(uint64_t tokens) const;

  std::vector<std::pair<uint64_t, double>> table_;  // empty for the FLOP model
  double fit_linear_ = 0;                           // seconds per token
  double fit_quadratic_ = 0;                        // seconds per token^2
  // FLOP model
  double flops_linear_ = 0;     // FLOPs per token
  double flops_quadratic_ = 0;  // FLOPs per query-key pair
  double flops_per_s_ = 0;
  std::string description_;
};

}  // namespace kvtier::planner
