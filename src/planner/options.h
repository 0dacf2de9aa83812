// The command-line (and JSON file) inputs shared by `kvtier plan` and `kvtier simulate`, and
// their translation into PlanInputs. Every value is kept as text until BuildPlanInputs parses it,
// so a flag and the same key in a --config JSON file are checked by the same code.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "kvtier/status.h"
#include "planner/plan.h"

namespace kvtier::planner {

struct PlannerFlags {
  std::string config;
  std::string model = "qwen3-8b";
  std::string dtype;
  std::string weight_dtype;
  std::string tp = "1";
  std::string gpu = "h200";
  std::string gpu_kv_gb;
  std::string gpu_memory_utilization = "0.9";
  std::string reserve_gb = "3";
  std::string prefill_table;
  std::string efficiency = "0.5";
  std::string users = "8";
  std::string rounds = "5";
  std::string qps;
  std::string load = "0.65";
  std::string capacity_method = "paced";
  std::string capacity_stage_time = "60s";
  std::string capacity_start_qps;
  std::string system_prompt = "1000";
  std::string context = "4096,8192,16384,24576,32768";
  std::string question_tokens = "128";
  std::string answer_tokens = "100";
  std::string duration = "20m";
  std::vector<std::string> tiers;
  std::string write_policy = "write_through";
  std::string eviction_policy = "prefix-aware";
  std::string step_overhead_ms = "4";
  std::string request_overhead_ms = "0";
  std::string decode_step_ms;
  std::string calibrate;
  std::string max_batched_tokens = "8192";
  std::string block_tokens = "16";
  std::string chunk_tokens = "256";
  std::string save_copy_bw = "50GB/s";
  std::string save_blocking = "1";
  std::string load_blocking = "0";
  std::string hit_suffix = "256";
  std::string layer_load_overhead_us = "0";
  bool no_sensitivity = false;
  bool no_cost_aware = false;
  bool prefetch = false;
  std::string prefetch_fraction = "0.5";
  bool json = false;
  std::string plot;
};

// The default offload tier when no --tier is given.
inline constexpr const char* kDefaultTier = "cpu:64GiB:50GB/s";

// Adds every input flag to `cmd`, bound to `flags`.
void AddPlannerFlags(CLI::App* cmd, PlannerFlags* flags);

// Fills flags the command line left unset from the JSON object in flags->config (keys are the
// flag names without dashes; '-' or '_' both work; lists as arrays or comma strings).
Status MergeConfigFile(const CLI::App& cmd, PlannerFlags* flags);

// A measured decode step as `--decode-step-ms` gives it: "MS" (one figure, no growth with the
// KV), or "TOKENS:MS,..." (one request decoding after prompts of those lengths): the least-squares
// line base + per_kv_token x tokens, its slope never below 0. Fails on a value <= 0, a malformed
// entry, or a table whose lengths are all the same.
struct DecodeStepFit {
  double base_s = 0;
  double per_kv_token_s = 0;
};
Result<DecodeStepFit> FitDecodeSteps(std::string_view text);

// Parses and checks everything; `fast` selects the closed forms only.
Result<PlanInputs> BuildPlanInputs(const CLI::App& cmd, const PlannerFlags& flags, bool fast);

}  // namespace kvtier::planner
