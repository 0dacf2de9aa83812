// The planner's closed forms: the arithmetic of DESIGN.md without queueing or eviction order.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "planner/prefill.h"
#include "planner/simulator.h"

namespace kvtier::planner {

// Peak KV bytes of one conversation (its last prompt plus answer).
double PeakSessionBytes(const Workload& w, uint64_t kv_bytes_per_token);

// Working set in tokens when every user holds its whole conversation at its peak: the shared
// system prompt once plus each user's private part.
double PeakWorkingSetTokens(const Workload& w);

// Per-user peak conversation length (tokens) above which `users` conversations no longer fit:
// users x peak tokens x bytes per token > gpu_kv_bytes. This is the plain form.
double EvictionOnsetPeakTokens(double gpu_kv_bytes, uint64_t kv_bytes_per_token, uint32_t users);

// The smallest first-round context (tokens) at which the peak working set (shared system prompt
// once, each user's context plus all its rounds) exceeds the GPU KV memory. 0 when even an
// empty context does not fit.
uint64_t EvictionOnsetContext(double gpu_kv_bytes, uint64_t kv_bytes_per_token, const Workload& w);

// Seconds a hit costs: reading `prefix` tokens at `read_bytes_per_s` plus computing `suffix`
// new tokens after them.
double HitCost(const PrefillCost& prefill, uint64_t kv_bytes_per_token, double read_bytes_per_s,
               uint64_t prefix, uint64_t suffix);

// The shortest prefix (tokens) for which reading it from a tier with this read bandwidth is
// cheaper than recomputing it, i.e. prefix x bytes/token / bandwidth < prefill(prefix). nullopt
// when reading never wins up to `max_tokens`.
std::optional<uint64_t> PayoffTokens(const PrefillCost& prefill, uint64_t kv_bytes_per_token,
                                     double read_bytes_per_s, uint64_t max_tokens = 1u << 21);

// The read bandwidth at which reading `tokens` costs exactly as much as recomputing them.
double BreakEvenBandwidth(const PrefillCost& prefill, uint64_t kv_bytes_per_token, uint64_t tokens);

// The closed-form TTFT estimate (`kvtier plan --fast`) for one arm: each user's conversation
// keeps min(1, capacity / working set) of its prefix in each level (GPU, then each tier in
// order); round 0 recomputes all but the shared system prompt; a later round's request reads its
// prefix from where it lies (tiers in parallel) and computes the rest. Mean TTFT is the
// hit-rate-weighted mix over rounds, plus one engine step overhead. Queueing is ignored.
struct FastArm {
  double mean_ttft_s = 0, median_ttft_s = 0, p90_ttft_s = 0;
  std::vector<double> hit_rate;                // gpu, each tier, recompute (fractions of requests)
  std::vector<double> bytes_read_per_request;  // per tier
  std::vector<double> bytes_written_per_request;
};
FastArm FastEstimate(const EngineModel& engine, const Workload& w,
                     const std::vector<TierSpec>& tiers, WritePolicy policy);

}  // namespace kvtier::planner
