// The planner: for each context length, the closed forms and (unless fast) two simulations, one
// without offload and one with the tiers; classifies the regime, measures sensitivity near the
// eviction threshold and formats the answer as a table, JSON or a gnuplot plot.
// Thread-compatible: RunPlan uses no shared state.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kvtier/status.h"
#include "planner/closed_form.h"
#include "planner/presets.h"
#include "planner/simulator.h"

namespace kvtier::planner {

enum class CapacityMethod { kPaced, kClosedLoop };

struct PlanInputs {
  ModelSpec model;
  std::string gpu_description;  // e.g. "h200, 19 GB KV" for titles
  EngineModel engine;           // gpu_kv_bytes, prefill, step model
  Workload workload;            // context_tokens is replaced by each entry of `contexts`
  std::vector<uint64_t> contexts;
  // Exactly one of qps (> 0) and load (fraction of each arm's own capacity, at each point).
  double qps = 0;
  double load = 0.65;
  // How capacity is measured for --load, as `kvtier bench qa --find-capacity` does it: kPaced
  // runs the paced workload in stages of capacity_stage_s, qps doubling from capacity_start_qps
  // (0: derived from the prefill cost), until the engine falls behind; kClosedLoop keeps `users`
  // users asking back to back.
  CapacityMethod capacity_method = CapacityMethod::kPaced;
  double capacity_stage_s = 60;
  double capacity_start_qps = 0;
  std::vector<TierSpec> tiers;
  WritePolicy write_policy = WritePolicy::kWriteThrough;
  EvictionPolicyKind l1_eviction = EvictionPolicyKind::kPrefixAware;  // the first tier's
  bool cost_aware = true;  // the connector's kvtier.cost_aware
  bool prefetch = false;   // the connector's kvtier.prefetch, with its prefetch_fraction
  double prefetch_fraction = 0.5;
  bool fast = false;         // closed forms only
  bool sensitivity = true;   // re-simulate at 0.9x and 1.1x GPU KV memory
  bool service_rate = true;  // capacity probes for both arms
  // One measured point (context tokens, mean TTFT of the no-offload arm) to calibrate the
  // engine's per-step overhead.
  std::optional<std::pair<uint64_t, double>> calibrate;
  // The single-request table: each context's last `hit_suffix_tokens` computed after a hit.
  uint64_t hit_suffix_tokens = 256;
};

struct ArmReport {
  double qps = 0;  // the --qps this arm ran at (with --load: from its own capacity)
  double mean_ttft_s = 0, median_ttft_s = 0, p90_ttft_s = 0;
  std::vector<double> hit_rate;       // gpu, each tier, recompute (requests, by majority)
  std::vector<double> token_share;    // gpu, each tier, recompute (prompt tokens)
  std::vector<double> bytes_written;  // per tier, whole run
  std::vector<double> bytes_read;
  double service_rate_rps = 0;  // capacity probe; 0 when not measured
  uint64_t requests = 0;
  double evicted_recompute_fraction = 0;  // of prompt tokens
  double sim_wall_s = 0;
};

struct PointReport {
  uint64_t context_tokens = 0;
  int regime = 0;
  double qps = 0;  // the no-offload arm's (ArmReport::qps has each arm's)
  double peak_working_set_bytes = 0;
  ArmReport baseline, offload;
  // Sensitivity: the same point with 0.9x and 1.1x the GPU KV memory.
  bool has_sensitivity = false;
  double baseline_gpu_hit_low = 0, baseline_gpu_hit_high = 0;
  double offload_mean_low = 0, offload_mean_high = 0;
  double baseline_mean_low = 0, baseline_mean_high = 0;
  bool near_threshold = false;
};

struct PlanReport {
  std::string model_name;
  std::string gpu_description;
  std::string prefill_description;
  uint64_t kv_bytes_per_token = 0;
  double gpu_kv_bytes = 0;
  double peak_session_bytes_at_first_context = 0;
  double eviction_onset_peak_tokens = 0;
  uint64_t eviction_onset_tokens = 0;  // first-round context
  std::vector<std::string> tier_names;
  std::vector<std::optional<uint64_t>> payoff_tokens;  // per tier
  std::vector<double> tier_read_bytes_per_s;
  Workload workload;
  WritePolicy write_policy = WritePolicy::kWriteThrough;
  double load_blocking = 0;  // EngineModel::load_blocking
  bool fast = false;
  double step_overhead_s = 0;
  bool calibrated = false;
  std::vector<PointReport> points;
  uint64_t hit_suffix_tokens = 0;
  std::vector<SingleRequestHit> single_hits;  // contexts longer than the suffix
  std::string recommendation;
  double total_sim_wall_s = 0;
};

using ProgressFn = std::function<void(const std::string&)>;

// Fails on inputs the model cannot run (see Simulate) or an impossible calibration.
Result<PlanReport> RunPlan(const PlanInputs& inputs, const ProgressFn& progress = {});

// Each arm's --qps at one context: inputs.qps for both, or with --load that fraction of each
// arm's own capacity, measured as RunPlan measures it (`kvtier simulate` runs at these).
struct ArmQps {
  double baseline = 0, offload = 0;
};
Result<ArmQps> QpsForEachArm(const PlanInputs& inputs, uint64_t context);

// The simulator's options for `in` (its engine, workload, and connector settings); with
// `offload`, its tiers too.
SimOptions SimOptionsFor(const PlanInputs& in, bool offload);

// Regime of a point: 1 when the no-offload arm recomputes less than 1% of its prompt tokens
// because of eviction; otherwise 3 when reading the mean prompt from the slowest tier is cheaper
// than recomputing it, else 2.
int ClassifyRegime(double baseline_evicted_recompute_fraction, double mean_prompt_tokens,
                   const std::vector<std::optional<uint64_t>>& payoff_tokens);

std::string FormatReport(const PlanReport& report);
// Exactly the fields of the issue: kv_bytes_per_token, thresholds, points.
nlohmann::json ReportToJson(const PlanReport& report);
// The gnuplot script that draws TTFT against context for both arms with the thresholds marked.
// REQUIRES: path ends in .svg or .png.
std::string PlotScript(const PlanReport& report, const std::string& path);
// Runs gnuplot on PlotScript. Fails on another extension, a missing gnuplot or its error.
Status WritePlot(const PlanReport& report, const std::string& path);

}  // namespace kvtier::planner
