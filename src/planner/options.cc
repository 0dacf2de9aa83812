#include "planner/options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "planner/units.h"

namespace kvtier::planner {
namespace {

// The prefill of Qwen3-8B on one H200 measured for the project (bf16, transformers, SDPA).
constexpr const char* kQwen3H200Table = "4096:0.135,8192:0.280,16384:0.652,24576:1.049,32768:1.530";

struct FlagInfo {
  const char* name;  // without dashes
  std::string help;  // the presets' lists from their tables, so they cannot drift
  std::string PlannerFlags::*text = nullptr;
  std::vector<std::string> PlannerFlags::*list = nullptr;
  bool PlannerFlags::*flag = nullptr;
};

const std::vector<FlagInfo>& Flags() {
  using F = PlannerFlags;
  static const std::vector<FlagInfo> flags = {
      {"model",
       fmt::format("Model: {}, or a path to a Hugging Face config.json",
                   fmt::join(ModelPresetNames(), ", ")),
       &F::model},
      {"dtype", "KV cache dtype (bfloat16, float16, fp8, ...); default: the model's", &F::dtype},
      {"weight-dtype", "Weights dtype, for the memory they take; default: the model's",
       &F::weight_dtype},
      {"tp", "Tensor-parallel size (GPUs per engine instance)", &F::tp},
      {"gpu",
       fmt::format("GPU preset: {} (memory, peak bf16 FLOP/s, HBM bandwidth)",
                   fmt::join(GpuPresetNames(), ", ")),
       &F::gpu},
      {"gpu-kv-gb",
       "GPU memory free for KV after weights, per GPU, in GB (1e9 bytes) or with a unit "
       "(e.g. 19GiB); default: GPU memory x utilization - weights/TP - reserve",
       &F::gpu_kv_gb},
      {"gpu-memory-utilization", "Fraction of GPU memory the engine may use (as vLLM's flag)",
       &F::gpu_memory_utilization},
      {"reserve-gb", "Per-GPU memory for activations and CUDA graphs, in GB", &F::reserve_gb},
      {"prefill-table",
       "Measured full prefills from an empty cache, \"TOKENS:SECONDS,...\" (e.g. "
       "4096:0.135,8192:0.280); default: the measured Qwen3-8B/H200 table for that pair, FLOPs "
       "otherwise",
       &F::prefill_table},
      {"efficiency", "Fraction of peak FLOP/s a prefill reaches, when costed from FLOPs",
       &F::efficiency},
      {"users", "Concurrent users (about this many conversations are active)", &F::users},
      {"rounds", "Questions per user conversation", &F::rounds},
      {"qps",
       "Requests per second over all users; each user asks every users/qps seconds (never "
       "before its last answer is done)",
       &F::qps},
      {"load",
       "Instead of --qps: fraction of each arm's own capacity at each context, measured as "
       "--capacity-method says; the --qps chosen sends this fraction (0.65 = the "
       "honest-measurement rule, as `kvtier bench qa --find-capacity` recommends)",
       &F::load},
      {"capacity-method",
       "How --load's capacity is measured: paced (the published method, as bench qa's default: "
       "the paced workload overloaded in stages, --qps doubling, until the engine falls behind) "
       "or closed-loop (users asking back to back)",
       &F::capacity_method},
      {"capacity-stage-time",
       "Length of each paced capacity stage (bench qa's --capacity-stage-time; give both the same "
       "value; a stage shorter than a few question gaps measures its own start)",
       &F::capacity_stage_time},
      {"capacity-start-qps",
       "The --qps of the first paced capacity stage (as bench qa's --qps with --find-capacity); "
       "default: a fifth of what an idle engine finishes back to back",
       &F::capacity_start_qps},
      {"system-prompt", "Tokens of system prompt shared by all users", &F::system_prompt},
      {"context",
       "Per-user context at the first round, tokens; a comma list is a sweep (k = x1024, e.g. "
       "8k,16k,24k)",
       &F::context},
      {"question-tokens", "Tokens per question", &F::question_tokens},
      {"answer-tokens", "Tokens per answer (each answer joins the next prompt)", &F::answer_tokens},
      {"duration", "How long users keep sending (e.g. 1200, 1200s, 20m, 1h)", &F::duration},
      {"tier",
       "Offload tier NAME:CAPACITY:READ_BW[:WRITE_BW], repeatable, fastest first (e.g. "
       "cpu:8GiB:20GB/s, nfs:200GiB:3.55GB/s); capacity needs a unit; default: "
       "cpu:64GiB:50GB/s",
       nullptr, &F::tiers},
      {"write-policy",
       "write_through (every tier on save), write_back (first tier; lower ones on eviction) or "
       "none",
       &F::write_policy},
      {"eviction-policy",
       "The first tier's eviction, as kvtier serve's --eviction-policy (that tier is kvtier's L1): "
       "prefix-aware or lru",
       &F::eviction_policy},
      {"step-overhead-ms",
       "Fixed cost of every engine step (scheduling, launches, sampling), milliseconds",
       &F::step_overhead_ms},
      {"request-overhead-ms",
       "Time every request spends outside the engine's steps before its first token arrives "
       "(HTTP, tokenization, scheduling, streaming), milliseconds; measure it as the idle TTFT of "
       "a prompt the engine holds entirely in its prefix cache. It is already inside measured "
       "--prefill-table TTFTs, so it is taken out of them",
       &F::request_overhead_ms},
      {"decode-step-ms",
       "Measured duration of one decode step (the idle time between answer tokens), "
       "milliseconds: MS, or TOKENS:MS,... measured with one request decoding after prompts of "
       "those lengths (the line through them gives the step's growth with the KV it reads, "
       "summed over a batch); default: weights and KV read at the GPU's HBM bandwidth plus "
       "--step-overhead-ms",
       &F::decode_step_ms},
      {"calibrate",
       "CONTEXT:SECONDS: a measured mean TTFT without offload at that context, for this "
       "workload; fits --step-overhead-ms to it",
       &F::calibrate},
      {"max-batched-tokens", "Tokens per engine step (decode + chunked prefill)",
       &F::max_batched_tokens},
      {"block-tokens", "GPU prefix-cache block size, tokens", &F::block_tokens},
      {"chunk-tokens", "Offload chunk size, tokens (only full chunks are stored)",
       &F::chunk_tokens},
      {"save-copy-bw", "GPU->host copy bandwidth per GPU for KV being saved (e.g. 50GB/s)",
       &F::save_copy_bw},
      {"save-blocking",
       "Fraction of that copy the engine step waits for: 1 = synchronous save, 0 = fully "
       "overlapped",
       &F::save_blocking},
      {"load-blocking",
       "Fraction of a load's read from the tiers that the engine step running the loaded request "
       "waits for, so that every request in that step waits with it: 0 = asynchronous loads, as "
       "kvtier's connector makes them; 1 = synchronous, as LMCache's default retrieval (before "
       "the forward pass, async_loading off)",
       &F::load_blocking},
      {"hit-suffix",
       "Tokens computed after a hit in the single-request table (each context's prefix, all but "
       "these, comes from a tier)",
       &F::hit_suffix},
      {"layer-load-overhead-us",
       "Host time to start one layer's load from the first tier (copy calls, events) on the "
       "thread that launches the model, microseconds (single-request table)",
       &F::layer_load_overhead_us},
      {"no-sensitivity", "Skip the 0.9x/1.1x GPU-memory re-runs", nullptr, nullptr,
       &F::no_sensitivity},
      {"no-cost-aware",
       "Model a connector with kvtier.cost_aware = false: every hit is loaded, also where "
       "reading it is slower than recomputing it (default: only what pays is loaded)",
       nullptr, nullptr, &F::no_cost_aware},
      {"prefetch",
       "Model a connector with kvtier.prefetch on: finished conversations, expected back in "
       "the order they finished, are promoted into the first tier and pinned there "
       "(docs/prefetch.md)",
       nullptr, nullptr, &F::prefetch},
      {"prefetch-fraction",
       "With --prefetch: the share of the first tier that expected conversations may hold "
       "(kvtier.prefetch_fraction)",
       &F::prefetch_fraction},
      {"json", "Print one JSON object instead of the table", nullptr, nullptr, &F::json},
      {"plot", "Also draw TTFT against context to FILE.svg or FILE.png (gnuplot)", &F::plot},
  };
  return flags;
}

Result<uint64_t> ParseCount(const std::string& text, const char* what, uint64_t min) {
  auto parsed = ParseTokens(text);
  if (!parsed.ok()) return parsed.status().WithContext(fmt::format("--{}", what));
  uint64_t v = *parsed;
  if (v < min) return Status::InvalidArgument(fmt::format("--{} must be >= {}", what, min));
  return v;
}

Result<double> ParseGb(const std::string& text) {
  auto plain = ParseNumber(text, "--gpu-kv-gb");
  if (plain.ok()) return *plain * 1e9;
  return ParseBytes(text);
}

}  // namespace

Result<DecodeStepFit> FitDecodeSteps(std::string_view text) {
  constexpr std::string_view kWhat = "--decode-step-ms";
  std::vector<std::pair<uint64_t, double>> points;  // (tokens, milliseconds)
  auto parse_ms = [&](std::string_view ms) { return ParseNumber(ms, kWhat); };
  if (text.find(':') == std::string_view::npos) {
    KVTIER_ASSIGN_OR_RETURN(double ms, parse_ms(text));
    points.emplace_back(0, ms);
  } else {
    auto table = ParseTokenTable(text, "MS", "4096:12.5", parse_ms);
    if (!table.ok()) return table.status().WithContext(kWhat);
    points = std::move(*table);
  }
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [tokens, ms] : points) {
    if (!(ms > 0)) return Status::InvalidArgument(fmt::format("{} must be > 0", kWhat));
    const double x = static_cast<double>(tokens), y = ms / 1e3;
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double n = static_cast<double>(points.size());
  DecodeStepFit fit{sy / n, 0};
  if (points.size() > 1) {
    const double var = sxx - sx * sx / n;
    if (!(var > 0)) {
      return Status::InvalidArgument(
          fmt::format("{}: a table needs two prompt lengths or more", kWhat));
    }
    // A step cannot get cheaper with more KV to read: a falling line is noise, taken as flat.
    const double slope = (sxy - sx * sy / n) / var;
    if (slope > 0) fit = {(sy - slope * sx) / n, slope};
  }
  return fit;
}

const char* TypeName(std::string_view flag) {
  static const std::pair<std::string_view, const char*> kTypes[] = {
      {"model", "NAME|PATH"},
      {"dtype", "DTYPE"},
      {"weight-dtype", "DTYPE"},
      {"tp", "N"},
      {"gpu", "NAME"},
      {"gpu-kv-gb", "GB"},
      {"gpu-memory-utilization", "FRACTION"},
      {"reserve-gb", "GB"},
      {"prefill-table", "TOKENS:S,..."},
      {"efficiency", "FRACTION"},
      {"users", "N"},
      {"rounds", "N"},
      {"qps", "REQ/S"},
      {"load", "FRACTION"},
      {"system-prompt", "TOKENS"},
      {"context", "TOKENS,..."},
      {"question-tokens", "TOKENS"},
      {"answer-tokens", "TOKENS"},
      {"duration", "TIME"},
      {"tier", "NAME:SIZE:BW[:BW]"},
      {"write-policy", "POLICY"},
      {"step-overhead-ms", "MS"},
      {"request-overhead-ms", "MS"},
      {"decode-step-ms", "MS|TOKENS:MS,..."},
      {"capacity-method", "METHOD"},
      {"capacity-stage-time", "TIME"},
      {"capacity-start-qps", "REQ/S"},
      {"calibrate", "TOKENS:S"},
      {"max-batched-tokens", "TOKENS"},
      {"block-tokens", "TOKENS"},
      {"chunk-tokens", "TOKENS"},
      {"save-copy-bw", "BW"},
      {"save-blocking", "FRACTION"},
      {"load-blocking", "FRACTION"},
      {"plot", "FILE"}};
  for (const auto& [name, type] : kTypes) {
    if (name == flag) return type;
  }
  return "TEXT";
}

void AddPlannerFlags(CLI::App* cmd, PlannerFlags* flags) {
  cmd->add_option("--config", flags->config,
                  "JSON file with any of these inputs, keyed by flag name without dashes "
                  "(e.g. {\"users\": 8, \"tier\": [\"cpu:8GiB:20GB/s\"]}); flags override it")
      ->type_name("FILE");
  for (const FlagInfo& f : Flags()) {
    std::string name = std::string("--") + f.name;
    if (f.text) {
      cmd->add_option(name, flags->*(f.text), f.help)
          ->capture_default_str()
          ->type_name(TypeName(f.name));
    } else if (f.list) {
      cmd->add_option(name, flags->*(f.list), f.help)
          ->allow_extra_args(false)
          ->type_name(TypeName(f.name));
    } else {
      cmd->add_flag(name, flags->*(f.flag), f.help);
    }
  }
}

Status MergeConfigFile(const CLI::App& cmd, PlannerFlags* flags) {
  if (flags->config.empty()) return Status::Ok();
  std::ifstream in(flags->config);
  if (!in) return Status::InvalidArgument(fmt::format("--config: cannot read '{}'", flags->config));
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument(
        fmt::format("--config '{}' is not a JSON object", flags->config));
  }
  auto scalar = [](const nlohmann::json& v) -> std::string {
    return v.is_string() ? v.get<std::string>() : v.dump();
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string key = it.key();
    for (char& c : key) c = c == '_' ? '-' : c;
    if (key == "tiers") key = "tier";
    const FlagInfo* info = nullptr;
    for (const FlagInfo& f : Flags()) {
      if (key == f.name) info = &f;
    }
    if (info == nullptr) {
      return Status::InvalidArgument(
          fmt::format("--config '{}': unknown key '{}'", flags->config, it.key()));
    }
    if (cmd.count(std::string("--") + info->name) > 0) continue;  // the command line wins
    const nlohmann::json& v = it.value();
    if (info->text) {
      std::string s;
      if (v.is_array()) {
        for (const auto& e : v) s += (s.empty() ? "" : ",") + scalar(e);
      } else {
        s = scalar(v);
      }
      flags->*(info->text) = s;
    } else if (info->list) {
      auto& list = flags->*(info->list);
      list.clear();
      if (v.is_array()) {
        for (const auto& e : v) list.push_back(scalar(e));
      } else {
        list.push_back(scalar(v));
      }
    } else {
      if (!v.is_boolean()) {
        return Status::InvalidArgument(fmt::format("--config: '{}' must be true or false", key));
      }
      flags->*(info->flag) = v.get<bool>();
    }
  }
  return Status::Ok();
}

Result<PlanInputs> BuildPlanInputs(const CLI::App& cmd, const PlannerFlags& f, bool fast) {
  PlanInputs in;
  in.fast = fast;
  KVTIER_ASSIGN_OR_RETURN(uint64_t tp, ParseCount(f.tp, "tp", 1));
  if (tp > 1024) return Status::InvalidArgument("--tp is larger than 1024");
  KVTIER_ASSIGN_OR_RETURN(in.model,
                          LoadModel(f.model, static_cast<uint32_t>(tp), f.dtype, f.weight_dtype));
  KVTIER_ASSIGN_OR_RETURN(GpuSpec gpu, LoadGpu(f.gpu));

  double kv_per_gpu = 0;
  if (!f.gpu_kv_gb.empty()) {
    KVTIER_ASSIGN_OR_RETURN(kv_per_gpu, ParseGb(f.gpu_kv_gb));
    if (!(kv_per_gpu > 0)) return Status::InvalidArgument("--gpu-kv-gb must be > 0");
    in.gpu_description = fmt::format("{}{}", gpu.name, tp > 1 ? fmt::format(" x{}", tp) : "");
  } else {
    KVTIER_ASSIGN_OR_RETURN(double util,
                            ParseNumber(f.gpu_memory_utilization, "--gpu-memory-utilization"));
    if (!(util > 0) || util > 1) {
      return Status::InvalidArgument("--gpu-memory-utilization must be in (0, 1]");
    }
    KVTIER_ASSIGN_OR_RETURN(double reserve, ParseNumber(f.reserve_gb, "--reserve-gb"));
    const double weights = in.model.weight_bytes() / tp;
    kv_per_gpu = gpu.memory_bytes * util - weights - reserve * 1e9;
    if (kv_per_gpu <= 0) {
      return Status::InvalidArgument(fmt::format(
          "{} does not fit: {} of weights per GPU at TP {} leave no KV memory in {} x {:.2f} of "
          "{}; raise --tp or give --gpu-kv-gb",
          in.model.name, FormatBytes(weights), tp, FormatBytes(gpu.memory_bytes), util, gpu.name));
    }
    in.gpu_description = fmt::format("{}{}", gpu.name, tp > 1 ? fmt::format(" x{}", tp) : "");
  }

  EngineModel& e = in.engine;
  e.gpu_kv_bytes = kv_per_gpu * tp;
  e.kv_bytes_per_token = in.model.kv_bytes_per_token();
  const bool measured_pair = in.model.name == "qwen3-8b" && gpu.name == "h200" && tp == 1 &&
                             in.model.kv_dtype == DType::kBFloat16;
  KVTIER_ASSIGN_OR_RETURN(double request_ms,
                          ParseNumber(f.request_overhead_ms, "--request-overhead-ms"));
  if (!(request_ms >= 0)) return Status::InvalidArgument("--request-overhead-ms must be >= 0");
  e.request_overhead_s = request_ms / 1e3;
  if (!f.prefill_table.empty()) {
    KVTIER_ASSIGN_OR_RETURN(auto table, ParseTokenSecondsTable(f.prefill_table));
    // Measured TTFTs hold the per-request overhead once; the engine's share is the rest.
    for (auto& [tokens, seconds] : table) {
      if (!(seconds > e.request_overhead_s)) {
        return Status::InvalidArgument(
            fmt::format("--prefill-table: {} tokens in {} s is not above --request-overhead-ms {} "
                        "(a measured TTFT holds the per-request overhead plus the prefill: "
                        "measure both on the same idle server, the overhead as the TTFT of a "
                        "prompt whose every token but the last is cached, and repeat each "
                        "until their medians settle)",
                        tokens, seconds, request_ms));
      }
      seconds -= e.request_overhead_s;
    }
    auto cost = PrefillCost::FromTable(std::move(table));
    if (!cost.ok()) return cost.status().WithContext("--prefill-table");
    e.prefill = std::move(cost).value();
  } else if (measured_pair && cmd.count("--efficiency") == 0) {
    KVTIER_ASSIGN_OR_RETURN(auto table, ParseTokenSecondsTable(kQwen3H200Table));
    KVTIER_ASSIGN_OR_RETURN(e.prefill, PrefillCost::FromTable(std::move(table)));
  } else {
    KVTIER_ASSIGN_OR_RETURN(double eff, ParseNumber(f.efficiency, "--efficiency"));
    KVTIER_ASSIGN_OR_RETURN(e.prefill, PrefillCost::FromFlops(in.model, gpu.peak_flops, eff));
  }
  KVTIER_ASSIGN_OR_RETURN(double overhead_ms,
                          ParseNumber(f.step_overhead_ms, "--step-overhead-ms"));
  e.step_overhead_s = overhead_ms / 1e3;
  const double hbm = gpu.hbm_bytes_per_s * tp;
  e.decode_weights_s = in.model.active_params * in.model.weight_bytes_per_param / hbm;
  e.decode_s_per_kv_token = static_cast<double>(e.kv_bytes_per_token) / hbm;
  if (!f.decode_step_ms.empty()) {
    KVTIER_ASSIGN_OR_RETURN(DecodeStepFit fit, FitDecodeSteps(f.decode_step_ms));
    // A measured step already holds the step overhead and the reads.
    e.decode_weights_s = std::max(0.0, fit.base_s - e.step_overhead_s);
    e.decode_s_per_kv_token = fit.per_kv_token_s;
  }
  KVTIER_ASSIGN_OR_RETURN(uint64_t mbt, ParseCount(f.max_batched_tokens, "max-batched-tokens", 1));
  KVTIER_ASSIGN_OR_RETURN(uint64_t bt, ParseCount(f.block_tokens, "block-tokens", 1));
  KVTIER_ASSIGN_OR_RETURN(uint64_t ct, ParseCount(f.chunk_tokens, "chunk-tokens", 1));
  if (mbt > (1u << 24) || bt > (1u << 20) || ct > (1u << 20)) {
    return Status::InvalidArgument(
        "--max-batched-tokens, --block-tokens or --chunk-tokens too large");
  }
  e.max_batched_tokens = static_cast<uint32_t>(mbt);
  e.block_tokens = static_cast<uint32_t>(bt);
  e.chunk_tokens = static_cast<uint32_t>(ct);
  auto save_bw = ParseBandwidth(f.save_copy_bw);
  if (!save_bw.ok()) return save_bw.status().WithContext("--save-copy-bw");
  // Every GPU copies its own rank's KV over its own link.
  e.save_copy_bytes_per_s = *save_bw * tp;
  KVTIER_ASSIGN_OR_RETURN(e.save_blocking, ParseNumber(f.save_blocking, "--save-blocking"));
  KVTIER_ASSIGN_OR_RETURN(double layer_us,
                          ParseNumber(f.layer_load_overhead_us, "--layer-load-overhead-us"));
  if (!(layer_us >= 0)) return Status::InvalidArgument("--layer-load-overhead-us must be >= 0");
  e.layer_load_overhead_s = layer_us / 1e6;
  if (e.save_blocking > 1) return Status::InvalidArgument("--save-blocking must be in [0, 1]");
  KVTIER_ASSIGN_OR_RETURN(e.load_blocking, ParseNumber(f.load_blocking, "--load-blocking"));
  if (e.load_blocking > 1) return Status::InvalidArgument("--load-blocking must be in [0, 1]");

  Workload& w = in.workload;
  KVTIER_ASSIGN_OR_RETURN(uint64_t users, ParseCount(f.users, "users", 1));
  KVTIER_ASSIGN_OR_RETURN(uint64_t rounds, ParseCount(f.rounds, "rounds", 1));
  if (users > 100000 || rounds > 100000) {
    return Status::InvalidArgument("--users and --rounds must be <= 100000");
  }
  w.users = static_cast<uint32_t>(users);
  w.rounds = static_cast<uint32_t>(rounds);
  KVTIER_ASSIGN_OR_RETURN(w.system_prompt_tokens, ParseCount(f.system_prompt, "system-prompt", 0));
  KVTIER_ASSIGN_OR_RETURN(w.question_tokens, ParseCount(f.question_tokens, "question-tokens", 1));
  KVTIER_ASSIGN_OR_RETURN(w.answer_tokens, ParseCount(f.answer_tokens, "answer-tokens", 1));
  auto duration = ParseDuration(f.duration);
  if (!duration.ok()) return duration.status().WithContext("--duration");
  w.duration_s = *duration;
  if (!(w.duration_s > 0)) return Status::InvalidArgument("--duration must be > 0");
  auto contexts = ParseTokenList(f.context);
  if (!contexts.ok()) return contexts.status().WithContext("--context");
  in.contexts = *contexts;
  if (!f.qps.empty()) {
    KVTIER_ASSIGN_OR_RETURN(in.qps, ParseNumber(f.qps, "--qps"));
    if (!(in.qps > 0)) return Status::InvalidArgument("--qps must be > 0");
    w.qps = in.qps;
    if (cmd.count("--load") > 0) return Status::InvalidArgument("give --qps or --load, not both");
  } else {
    KVTIER_ASSIGN_OR_RETURN(in.load, ParseNumber(f.load, "--load"));
  }
  if (f.capacity_method == "paced") {
    in.capacity_method = CapacityMethod::kPaced;
  } else if (f.capacity_method == "closed-loop" || f.capacity_method == "closed_loop") {
    in.capacity_method = CapacityMethod::kClosedLoop;
  } else {
    return Status::InvalidArgument(fmt::format(
        "--capacity-method: unknown method '{}' (paced or closed-loop)", f.capacity_method));
  }
  auto stage = ParseDuration(f.capacity_stage_time);
  if (!stage.ok()) return stage.status().WithContext("--capacity-stage-time");
  if (!(*stage >= 1)) return Status::InvalidArgument("--capacity-stage-time must be >= 1 s");
  in.capacity_stage_s = *stage;
  if (!f.capacity_start_qps.empty()) {
    KVTIER_ASSIGN_OR_RETURN(in.capacity_start_qps,
                            ParseNumber(f.capacity_start_qps, "--capacity-start-qps"));
    if (!(in.capacity_start_qps > 0)) {
      return Status::InvalidArgument("--capacity-start-qps must be > 0");
    }
  }
  std::vector<std::string> tier_texts = f.tiers;
  if (tier_texts.empty()) tier_texts.push_back(kDefaultTier);
  for (const std::string& t : tier_texts) {
    KVTIER_ASSIGN_OR_RETURN(TierSpec tier, ParseTierSpec(t));
    in.tiers.push_back(std::move(tier));
  }
  KVTIER_ASSIGN_OR_RETURN(in.write_policy, ParseWritePolicy(f.write_policy));
  KVTIER_ASSIGN_OR_RETURN(in.l1_eviction, ParseEvictionPolicy(f.eviction_policy));
  if (!f.calibrate.empty()) {
    KVTIER_ASSIGN_OR_RETURN(auto table, ParseTokenSecondsTable(f.calibrate));
    if (table.size() != 1 || !(table[0].second > 0)) {
      return Status::InvalidArgument("--calibrate takes one CONTEXT:SECONDS point, seconds > 0");
    }
    in.calibrate = table[0];
  }
  KVTIER_ASSIGN_OR_RETURN(in.hit_suffix_tokens, ParseCount(f.hit_suffix, "hit-suffix", 1));
  in.sensitivity = !f.no_sensitivity;
  in.cost_aware = !f.no_cost_aware;
  in.prefetch = f.prefetch;
  KVTIER_ASSIGN_OR_RETURN(in.prefetch_fraction,
                          ParseNumber(f.prefetch_fraction, "--prefetch-fraction"));
  if (!(in.prefetch_fraction > 0 && in.prefetch_fraction <= 1)) {
    return Status::InvalidArgument("--prefetch-fraction must be in (0, 1]");
  }
  return in;
}

}  // namespace kvtier::planner
