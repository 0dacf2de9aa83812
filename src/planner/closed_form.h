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

// One request alone on an idle engine: the time to first token when its first `context - suffix`
// tokens come from a tier, against recomputing the whole prompt. The first tier is host memory
// (kvtier's L1): its copy to the GPU goes layer by layer, each layer's copy overlapped with the
// previous layer's compute, so a hit costs max(copy, suffix compute) plus one layer's copy that
// nothing hides. A later tier (storage) reads into host memory first, then the suffix is computed:
// read + suffix compute. Every figure includes one engine step overhead. Issuing the host tier's
// layer loads costs the launching thread layers x engine.layer_load_overhead_s, added to the
// compute leg (it matters when the suffix's compute is launch-bound).
struct SingleRequestHit {
  uint64_t context_tokens = 0, prefix_tokens = 0;
  double recompute_s = 0;
  double suffix_s = 0;             // the suffix's compute after the hit (HitSuffix)
  std::vector<double> read_s;      // per tier: prefix bytes / read bandwidth
  std::vector<double> hit_ttft_s;  // per tier
};
// REQUIRES: suffix < context, layers >= 1, every tier's read bandwidth > 0.
SingleRequestHit PredictSingleRequestHit(const EngineModel& engine, uint32_t layers,
                                         const std::vector<TierSpec>& tiers, uint64_t context,
                                         uint64_t suffix);

// The closed-form TTFT estimate (`kvtier plan --fast`) for one arm: each user's conversation
// keeps min(1, capacity / working set) of its prefix in each level (GPU, then each tier in
// order); round 0 recomputes all but the shared system prompt; a later round's request reads its
// prefix from where it lies (tiers in parallel) and computes the rest. Mean TTFT is the
// hit-rate-weighted mix over rounds, plus one engine step overhead. Queueing is ignored, and
// with it engine.load_blocking: a request's own read is in its TTFT either way, and the wait a
// blocking load puts on the other requests of its step is queueing.
struct FastArm {
  double mean_ttft_s = 0, median_ttft_s = 0, p90_ttft_s = 0;
  std::vector<double> hit_rate;                // gpu, each tier, recompute (fractions of requests)
  std::vector<double> bytes_read_per_request;  // per tier
  std::vector<double> bytes_written_per_request;
};
FastArm FastEstimate(const EngineModel& engine, const Workload& w,
                     const std::vector<TierSpec>& tiers, WritePolicy policy);

}  // namespace kvtier::planner
