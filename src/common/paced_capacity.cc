#include "common/paced_capacity.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtier {

PacedStageReading ReadPacedStage(std::span<const std::pair<double, double>> finished,
                                 std::span<const double> sends, double start, double end) {
  PacedStageReading r;
  const double from = start + 0.1 * (end - start);
  const double window = end - from;
  if (!(window > 0)) return r;
  std::vector<double> latencies;
  int64_t done = 0;
  for (const auto& [sent, fin] : finished) {
    if (fin > end) continue;
    latencies.push_back(fin - sent);
    done += fin >= from;
  }
  if (!latencies.empty()) {
    auto mid = latencies.begin() + static_cast<std::ptrdiff_t>(latencies.size() / 2);
    std::nth_element(latencies.begin(), mid, latencies.end());
    r.latency_s = *mid;
  }
  // A queue that grows all stage long shows as a latency of the stage's length; half the window
  // keeps a comparison window, and such a stage is behind anyway.
  const double shift = std::min(r.latency_s, 0.5 * window);
  const double lo = std::max(start, from - shift), hi = end - shift;
  int64_t sent = 0;
  for (double s : sends) sent += s >= lo && s <= hi;
  r.finished_rps = static_cast<double>(done) / window;
  r.sent_rps = hi > lo ? static_cast<double>(sent) / (hi - lo) : 0;
  r.fell_behind = r.finished_rps < 0.9 * r.sent_rps;
  return r;
}

}  // namespace kvtier
