// `kvtier plan`: thresholds, predicted TTFT with and without offload, the regime and a plot.
#include <fmt/format.h>

#include <memory>

#include "planner/options.h"
#include "planner/plan.h"
#include "planner/units.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

int RunPlanCommand(const CLI::App& cmd, planner::PlannerFlags& flags, bool fast) {
  auto fail = [](const Status& s) {
    fmt::print(stderr, "kvtier plan: {}\n", s.message());
    return 1;
  };
  if (Status s = planner::MergeConfigFile(cmd, &flags); !s.ok()) return fail(s);
  auto inputs = planner::BuildPlanInputs(cmd, flags, fast);
  if (!inputs.ok()) return fail(inputs.status());
  if (!flags.plot.empty() && !flags.plot.ends_with(".svg") && !flags.plot.ends_with(".png")) {
    return fail(Status::InvalidArgument(
        fmt::format("--plot '{}': the file must end in .svg or .png", flags.plot)));
  }
  auto progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
  auto report = planner::RunPlan(*inputs, progress);
  if (!report.ok()) return fail(report.status());
  if (!fast) {
    fmt::print(stderr, "simulated {} context length(s) in {:.2f} s of host time (main runs)\n",
               report->points.size(), report->total_sim_wall_s);
  }
  if (flags.json) {
    fmt::print("{}\n", planner::ReportToJson(*report).dump(2));
  } else {
    fmt::print("{}", planner::FormatReport(*report));
  }
  if (!flags.plot.empty()) {
    if (Status s = planner::WritePlot(*report, flags.plot); !s.ok()) return fail(s);
    fmt::print(stderr, "plot written to {}\n", flags.plot);
  }
  return 0;
}

void AddPlan(CLI::App& parent, CommandContext& ctx) {
  auto* cmd = parent.add_subcommand(
      "plan",
      "Predict whether KV offload pays for a model, GPU, workload and tiers: KV size, the "
      "eviction-onset and payoff thresholds, TTFT with and without offload, the regime, a plot");
  cmd->footer(
      "Units: sizes need one (8GiB = 8 x 2^30 bytes, 19GB = 19 x 10^9; 8 or 8G alone is refused "
      "as ambiguous); bandwidths are per second (3.55GB/s, 20GiB/s, "
      "25Gbit/s); durations take s/m/h (bare = seconds); token counts take k = x1024.\n"
      "By default each context length is simulated twice (no offload, offload) with the "
      "discrete-event model of `kvtier simulate`; --fast uses the closed forms only.\n"
      "Regimes: 1 = the working set fits in GPU memory; 2 = the GPU evicts but recomputing is "
      "cheaper than reading from the slowest tier; 3 = reading from it wins.");
  auto flags = std::make_shared<planner::PlannerFlags>();
  auto fast = std::make_shared<bool>(false);
  planner::AddPlannerFlags(cmd, flags.get());
  cmd->add_flag("--fast", *fast,
                "Closed forms only: instant, but ignores queueing and the order of eviction");
  cmd->callback([cmd, flags, fast, &ctx] { ctx.exit_code = RunPlanCommand(*cmd, *flags, *fast); });
}

const bool kRegistered = RegisterCommand("", &AddPlan);

}  // namespace
}  // namespace kvtier::tools
