// The reading of one stage of the paced capacity method (docs/bench-qa.md): the workload paced
// as in a run, deliberately overloaded. `kvtier bench qa --find-capacity` judges its real stages
// and `kvtier plan --load` its simulated ones with this same function, so the planner models the
// method as the load generator runs it.
#pragma once

#include <span>
#include <utility>

namespace kvtier {

struct PacedStageReading {
  double finished_rps = 0;  // requests finished in the window, per second
  double sent_rps = 0;      // requests sent per second, over the window shifted back by latency
  double latency_s = 0;     // median send-to-finish time of the stage's finished requests
  bool fell_behind = false;
};

// `finished` holds (sent, finished) times of the requests that finished by `end`; `sends` the
// send times of every request of the stage. The window is the stage after its first tenth.
// The server fell behind when it finished under 90 % of what was sent one latency earlier
// (the requests that could have finished in the window): comparing with the pacing's nominal
// rate, or with the sends of the same window, would call a short stage behind for the
// requests still in flight at its end, or for the steady-state start's first quiet seconds.
PacedStageReading ReadPacedStage(std::span<const std::pair<double, double>> finished,
                                 std::span<const double> sends, double start, double end);

}  // namespace kvtier
