// `kvtier simulate`: the discrete-event model of a serving engine with and without offload tiers,
// reported in full (TTFT distribution, per-tier hits by requests and by tokens, bytes moved,
// GPU memory, engine steps, how long the simulation itself took).
#include <fmt/format.h>

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "planner/options.h"
#include "planner/simulator.h"
#include "planner/units.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

using planner::FormatBytes;
using planner::FormatSeconds;
using planner::SimResult;

nlohmann::json ArmJson(const SimResult& r, const std::vector<planner::TierSpec>& tiers) {
  nlohmann::json hit = nlohmann::json::object(), hit_tokens = nlohmann::json::object();
  for (size_t s = 0; s < r.source_names.size(); ++s) {
    hit[r.source_names[s]] = r.HitRate(s);
    hit_tokens[r.source_names[s]] = r.prompt_tokens ? r.tokens_by_source[s] / r.prompt_tokens : 0;
  }
  nlohmann::json written = nlohmann::json::object(), read = nlohmann::json::object();
  for (size_t t = 0; t < tiers.size(); ++t) {
    written[tiers[t].name] = r.bytes_written.empty() ? 0.0 : r.bytes_written[t];
    read[tiers[t].name] = r.bytes_read.empty() ? 0.0 : r.bytes_read[t];
  }
  return {{"requests", r.requests},
          {"mean_ttft_s", r.mean_ttft_s},
          {"median_ttft_s", r.median_ttft_s},
          {"p90_ttft_s", r.p90_ttft_s},
          {"p99_ttft_s", r.p99_ttft_s},
          {"hit_rate", hit},
          {"token_share", hit_tokens},
          {"bytes_written", written},
          {"bytes_read", read},
          {"peak_working_set_tokens", r.peak_working_set_tokens},
          {"gpu_capacity_tokens", r.gpu_capacity_tokens},
          {"admission_waits", r.admission_waits},
          {"engine_steps", r.steps},
          {"engine_busy_s", r.engine_busy_s},
          {"throughput_rps", r.throughput_rps},
          {"simulated_s", r.end_s},
          {"wall_s", r.wall_s}};
}

std::string ArmText(const char* title, const SimResult& r,
                    const std::vector<planner::TierSpec>& tiers) {
  std::string out =
      fmt::format("  {}: {} requests, TTFT mean {} / median {} / p90 {} / p99 {}\n", title,
                  r.requests, FormatSeconds(r.mean_ttft_s), FormatSeconds(r.median_ttft_s),
                  FormatSeconds(r.p90_ttft_s), FormatSeconds(r.p99_ttft_s));
  out += "    prompts from:";
  for (size_t s = 0; s < r.source_names.size(); ++s) {
    out += fmt::format(" {} {:.0f}% of requests ({:.0f}% of tokens){}", r.source_names[s],
                       r.HitRate(s) * 100,
                       r.prompt_tokens ? 100 * r.tokens_by_source[s] / r.prompt_tokens : 0.0,
                       s + 1 < r.source_names.size() ? "," : "\n");
  }
  for (size_t t = 0; t < tiers.size() && !r.bytes_written.empty(); ++t) {
    out += fmt::format("    {}: wrote {}, read {}, peak {} of {}{}\n", tiers[t].name,
                       FormatBytes(r.bytes_written[t]), FormatBytes(r.bytes_read[t]),
                       FormatBytes(r.tier_peak_bytes[t]), FormatBytes(tiers[t].capacity_bytes),
                       t == 0 && r.dirty_evictions > 0
                           ? fmt::format(", {} chunks evicted dirty (lost before they were "
                                         "written below)",
                                         r.dirty_evictions)
                           : "");
  }
  out += fmt::format(
      "    GPU: peak in-flight reservation {:.0f} of {:.0f} tokens, {} admission waits, {} "
      "recomputed "
      "after eviction; engine {} steps, busy {}, {:.3f} req/s over {}; simulated in {}\n",
      r.peak_working_set_tokens, r.gpu_capacity_tokens, r.admission_waits,
      r.evicted_recompute_tokens, r.steps, FormatSeconds(r.engine_busy_s), r.throughput_rps,
      FormatSeconds(r.end_s), FormatSeconds(r.wall_s));
  return out;
}

// One row per simulated request, both arms, in the columns of bench qa's CSV where they match
// (times in simulated seconds from the start), so the two can be compared request by request.
Status AppendRequestLog(const std::string& path, bool first, uint64_t context,
                        const SimResult& base, const SimResult& off,
                        const std::vector<planner::TierSpec>& tiers) {
  std::ofstream out(path, first ? std::ios::trunc : std::ios::app);
  if (!out) return Status::IOError(fmt::format("--requests-csv: cannot write '{}'", path));
  if (first) {
    out << "context,arm,user_id,round,launch_time,ttft,finish_time,prompt_tokens,gpu_tokens";
    for (const auto& t : tiers) out << "," << t.name << "_tokens";
    out << ",recomputed_tokens\n";
  }
  for (const auto* r : {&base, &off}) {
    for (const planner::RequestLog& l : r->request_log) {
      out << fmt::format("{},{},{},{},{:.6f},{:.6f},{:.6f},{},{}", context,
                         r == &base ? "no-offload" : "offload", l.conversation, l.round + 1,
                         l.sent_s, l.ttft_s, l.finish_s, l.prompt_tokens, l.gpu_tokens);
      for (size_t t = 0; t < tiers.size(); ++t) {
        out << "," << (t < l.tier_tokens.size() ? l.tier_tokens[t] : 0);
      }
      out << "," << l.recomputed_tokens << "\n";
    }
  }
  out.flush();
  return out ? Status::Ok()
             : Status::IOError(fmt::format("--requests-csv: writing '{}' failed", path));
}

int RunSimulateCommand(const CLI::App& cmd, planner::PlannerFlags& flags,
                       const std::string& requests_csv) {
  auto fail = [](const Status& s) {
    fmt::print(stderr, "kvtier simulate: {}\n", s.message());
    return 1;
  };
  if (Status s = planner::MergeConfigFile(cmd, &flags); !s.ok()) return fail(s);
  if (!flags.plot.empty()) {
    return fail(Status::InvalidArgument("--plot belongs to `kvtier plan`"));
  }
  auto inputs = planner::BuildPlanInputs(cmd, flags, false);
  if (!inputs.ok()) return fail(inputs.status());
  const planner::PlanInputs& in = *inputs;
  nlohmann::json points = nlohmann::json::array();
  std::string text = fmt::format(
      "{} on {}: {} B of KV per token, {} of GPU KV memory, prefill from {}, step overhead {}\n",
      in.model.name, in.gpu_description, in.engine.kv_bytes_per_token,
      FormatBytes(in.engine.gpu_kv_bytes), in.engine.prefill.description(),
      FormatSeconds(in.engine.step_overhead_s));
  double wall = 0;
  for (size_t i = 0; i < in.contexts.size(); ++i) {
    planner::SimOptions o = planner::SimOptionsFor(in, /*offload=*/false);
    o.workload.context_tokens = in.contexts[i];
    fmt::print(stderr, "simulating context {} tokens ({}/{})\n", in.contexts[i], i + 1,
               in.contexts.size());
    // Each arm at its own qps: --qps, or --load of that arm's capacity measured as `kvtier plan`
    // measures it (the same code).
    auto arm_qps = planner::QpsForEachArm(in, in.contexts[i]);
    if (!arm_qps.ok()) return fail(arm_qps.status());
    const double qps_base = arm_qps->baseline, qps_off = arm_qps->offload;
    o.keep_requests = !requests_csv.empty();
    o.workload.qps = qps_base;
    auto base = planner::Simulate(o);
    if (!base.ok()) return fail(base.status());
    o.tiers = in.tiers;
    o.workload.qps = qps_off;
    auto off = planner::Simulate(o);
    if (!off.ok()) return fail(off.status());
    if (!requests_csv.empty()) {
      if (Status s = AppendRequestLog(requests_csv, i == 0, in.contexts[i], *base, *off, in.tiers);
          !s.ok()) {
        return fail(s);
      }
    }
    wall += base->wall_s + off->wall_s;
    text += fmt::format(
        "\ncontext {} tokens, qps {:.3f} (one question per user every {}){}\n", in.contexts[i],
        qps_base, FormatSeconds(o.workload.users / qps_base),
        qps_off != qps_base ? fmt::format("; offload at qps {:.3f}", qps_off) : std::string());
    text += ArmText("no offload", *base, in.tiers);
    text += ArmText("offload   ", *off, in.tiers);
    points.push_back({{"context_tokens", in.contexts[i]},
                      {"qps", qps_base},
                      {"offload_qps", qps_off},
                      {"baseline", ArmJson(*base, in.tiers)},
                      {"offload", ArmJson(*off, in.tiers)}});
  }
  fmt::print(stderr, "simulated {} context length(s) in {:.3f} s of host time\n",
             in.contexts.size(), wall);
  if (flags.json) {
    nlohmann::json j = {{"kv_bytes_per_token", in.engine.kv_bytes_per_token}, {"points", points}};
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("{}", text);
  }
  return 0;
}

void AddSimulate(CLI::App& parent, CommandContext& ctx) {
  auto* cmd = parent.add_subcommand(
      "simulate",
      "Discrete-event model of one serving engine running the multi-round chat workload, with "
      "and without offload tiers: TTFT distribution, per-tier hits, bytes moved");
  cmd->footer(
      "Same inputs as `kvtier plan` (see docs/planner.md for the model). Units: sizes need one "
      "(8GiB = 8 x 2^30 bytes, 19GB = 19 x 10^9); bandwidths are per second (3.55GB/s); "
      "durations take s/m/h.");
  auto flags = std::make_shared<planner::PlannerFlags>();
  planner::AddPlannerFlags(cmd, flags.get());
  auto requests_csv = std::make_shared<std::string>();
  cmd->add_option("--requests-csv", *requests_csv,
                  "Also write every simulated request (both arms, every context) to FILE: when it "
                  "was sent, its TTFT, where its prompt came from; bench qa's CSV columns where "
                  "they match")
      ->type_name("FILE");
  cmd->callback([cmd, flags, requests_csv, &ctx] {
    ctx.exit_code = RunSimulateCommand(*cmd, *flags, *requests_csv);
  });
}

const bool kRegistered = RegisterCommand("", &AddSimulate);

}  // namespace
}  // namespace kvtier::tools
