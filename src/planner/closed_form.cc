#include "planner/closed_form.h"

#include <algorithm>
#include <cmath>

namespace kvtier::planner {

double PeakSessionBytes(const Workload& w, uint64_t kv_bytes_per_token) {
  return static_cast<double>(w.PeakConversationTokens()) * kv_bytes_per_token;
}

double PeakWorkingSetTokens(const Workload& w) {
  const double private_peak =
      static_cast<double>(w.PeakConversationTokens() - w.system_prompt_tokens);
  return static_cast<double>(w.system_prompt_tokens) + w.users * private_peak;
}

double EvictionOnsetPeakTokens(double gpu_kv_bytes, uint64_t kv_bytes_per_token, uint32_t users) {
  return gpu_kv_bytes / (static_cast<double>(users) * kv_bytes_per_token);
}

uint64_t EvictionOnsetContext(double gpu_kv_bytes, uint64_t kv_bytes_per_token, const Workload& w) {
  const double capacity = gpu_kv_bytes / kv_bytes_per_token;
  const double growth = static_cast<double>(w.rounds) * (w.question_tokens + w.answer_tokens);
  const double per_user = (capacity - w.system_prompt_tokens) / w.users - growth;
  if (per_user < 0) return 0;
  return static_cast<uint64_t>(std::floor(per_user)) + 1;
}

double HitCost(const PrefillCost& prefill, uint64_t kv_bytes_per_token, double read_bytes_per_s,
               uint64_t prefix, uint64_t suffix) {
  return static_cast<double>(prefix) * kv_bytes_per_token / read_bytes_per_s +
         prefill.Suffix(prefix, suffix);
}

std::optional<uint64_t> PayoffTokens(const PrefillCost& prefill, uint64_t kv_bytes_per_token,
                                     double read_bytes_per_s, uint64_t max_tokens) {
  auto wins = [&](uint64_t l) {
    return static_cast<double>(l) * kv_bytes_per_token / read_bytes_per_s < prefill.Full(l);
  };
  // Coarse scan for the first win, then bisect inside the step (prefill per token only grows
  // with length, so the difference changes sign once).
  const uint64_t step = 256;
  uint64_t prev = 0;
  for (uint64_t l = 16; l <= max_tokens; l = (l < step ? l + 16 : l + step)) {
    if (wins(l)) {
      uint64_t lo = prev, hi = l;  // !wins(lo) (or 0), wins(hi)
      while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        (wins(mid) ? hi : lo) = mid;
      }
      return lo == 0 && wins(1) ? 1 : hi;
    }
    prev = l;
  }
  return std::nullopt;
}

double BreakEvenBandwidth(const PrefillCost& prefill, uint64_t kv_bytes_per_token,
                          uint64_t tokens) {
  return static_cast<double>(tokens) * kv_bytes_per_token / prefill.Full(tokens);
}

SingleRequestHit PredictSingleRequestHit(const EngineModel& engine, uint32_t layers,
                                         const std::vector<TierSpec>& tiers, uint64_t context,
                                         uint64_t suffix) {
  SingleRequestHit h;
  h.context_tokens = context;
  h.prefix_tokens = context - suffix;
  h.recompute_s = engine.step_overhead_s + engine.prefill.Full(context);
  h.suffix_s = engine.prefill.HitSuffix(h.prefix_tokens, suffix);
  const double bytes = static_cast<double>(h.prefix_tokens) * engine.kv_bytes_per_token;
  for (size_t t = 0; t < tiers.size(); ++t) {
    const double read = bytes / tiers[t].read_bytes_per_s;
    h.read_s.push_back(read);
    const double compute = h.suffix_s + layers * engine.layer_load_overhead_s;
    const double hit = t == 0 ? std::max(read, compute) + read / std::max(1u, layers)
                              : read + h.suffix_s;
    h.hit_ttft_s.push_back(engine.step_overhead_s + hit);
  }
  return h;
}

FastArm FastEstimate(const EngineModel& engine, const Workload& w,
                     const std::vector<TierSpec>& tiers, WritePolicy policy) {
  FastArm out;
  const size_t n_sources = tiers.size() + 2;
  out.hit_rate.assign(n_sources, 0);
  out.bytes_read_per_request.assign(tiers.size(), 0);
  out.bytes_written_per_request.assign(tiers.size(), 0);
  const double bpt = static_cast<double>(engine.kv_bytes_per_token);
  const double working_set = PeakWorkingSetTokens(w);
  const double gpu_tokens = engine.gpu_kv_bytes / bpt;
  // Fraction of each conversation's prefix held by each level, filled top-down.
  std::vector<double> share;  // gpu, tiers...
  double covered = std::min(1.0, gpu_tokens / working_set);
  share.push_back(covered);
  const bool writes = policy != WritePolicy::kNone;
  for (const TierSpec& t : tiers) {
    double holds = writes ? std::min(1.0, t.capacity_bytes / (working_set * bpt)) : 0;
    double extra = std::max(0.0, std::min(1.0, std::max(covered, holds)) - covered);
    share.push_back(extra);
    covered += extra;
  }
  std::vector<double> ttfts;
  for (uint32_t r = 0; r < w.rounds; ++r) {
    const uint64_t prompt = w.PromptTokens(r);
    double ttft = engine.step_overhead_s;
    if (r == 0) {
      ttft += engine.prefill.Suffix(w.system_prompt_tokens, prompt - w.system_prompt_tokens);
      out.hit_rate.back() += 1;
    } else {
      const double previous = static_cast<double>(prompt - w.question_tokens);
      std::vector<double> tokens(n_sources, 0);
      double hit = 0, transfer = 0;
      for (size_t s = 0; s < share.size(); ++s) {
        tokens[s] = share[s] * previous;
        hit += tokens[s];
        if (s > 0) {
          double bytes = tokens[s] * bpt;
          transfer = std::max(transfer, bytes / tiers[s - 1].read_bytes_per_s);
          out.bytes_read_per_request[s - 1] += bytes / w.rounds;
        }
      }
      tokens.back() = static_cast<double>(prompt) - hit;
      const uint64_t hit_tokens = static_cast<uint64_t>(hit);
      ttft += transfer + engine.prefill.Suffix(hit_tokens, prompt - hit_tokens);
      size_t best = std::max_element(tokens.begin(), tokens.end()) - tokens.begin();
      out.hit_rate[best] += 1;
    }
    if (writes && !tiers.empty()) {
      // New full chunks of this prompt go to the tiers; saving them stalls the engine.
      const double new_tokens = r == 0 ? static_cast<double>(prompt)
                                       : static_cast<double>(w.question_tokens + w.answer_tokens);
      const double bytes = new_tokens * bpt;
      ttft += engine.save_blocking * bytes / engine.save_copy_bytes_per_s;
      size_t last = policy == WritePolicy::kWriteThrough ? tiers.size() : 1;
      for (size_t t = 0; t < last; ++t) out.bytes_written_per_request[t] += bytes / w.rounds;
    }
    ttfts.push_back(ttft);
  }
  for (double& h : out.hit_rate) h /= w.rounds;
  double sum = 0;
  for (double t : ttfts) sum += t;
  out.mean_ttft_s = sum / ttfts.size();
  std::sort(ttfts.begin(), ttfts.end());
  out.median_ttft_s = Percentile(ttfts, 50);
  out.p90_ttft_s = Percentile(ttfts, 90);
  return out;
}

}  // namespace kvtier::planner
