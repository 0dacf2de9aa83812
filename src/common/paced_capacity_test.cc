#include "common/paced_capacity.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace kvtier {
namespace {

// One request every `every` seconds from `first` on, each taking `latency` (finished only if by
// `end`).
struct Stage {
  std::vector<std::pair<double, double>> finished;
  std::vector<double> sends;
  Stage(double first, double every, double latency, double end) {
    for (double t = first; t < end; t += every) {
      sends.push_back(t);
      if (t + latency <= end) finished.emplace_back(t, t + latency);
    }
  }
};

TEST(PacedCapacityTest, AServerThatKeepsUpIsNotBehindThoughRequestsAreInFlightAtTheEnd) {
  // 2 requests/s, each taking 3 s: 6 in flight when a 20 s stage ends.
  Stage s(0, 0.5, 3.0, 20);
  PacedStageReading r = ReadPacedStage(s.finished, s.sends, 0, 20);
  EXPECT_FALSE(r.fell_behind);
  EXPECT_NEAR(r.finished_rps, 2.0, 0.1);
  EXPECT_NEAR(r.sent_rps, 2.0, 0.1);
  EXPECT_NEAR(r.latency_s, 3.0, 1e-9);
}

TEST(PacedCapacityTest, AQuietStartDoesNotReadAsLagging) {
  // The steady-state start: nothing is sent for the first 4 s, then 2 requests/s.
  Stage s(4, 0.5, 1.0, 20);
  EXPECT_FALSE(ReadPacedStage(s.finished, s.sends, 0, 20).fell_behind);
}

TEST(PacedCapacityTest, AServerFinishingLessThanItIsSentIsBehind) {
  // 4 requests/s sent, 1.5/s served: the queue (and the latency) grows all stage.
  std::vector<std::pair<double, double>> finished;
  std::vector<double> sends;
  double free_at = 0;
  for (double t = 0; t < 20; t += 0.25) {
    sends.push_back(t);
    free_at = std::max(free_at, t) + 1 / 1.5;
    if (free_at <= 20) finished.emplace_back(t, free_at);
  }
  PacedStageReading r = ReadPacedStage(finished, sends, 0, 20);
  EXPECT_TRUE(r.fell_behind);
  EXPECT_NEAR(r.finished_rps, 1.5, 0.15);
}

TEST(PacedCapacityTest, NothingFinishedReadsAsZero) {
  std::vector<double> sends = {1, 2, 3};
  PacedStageReading r = ReadPacedStage({}, sends, 0, 20);
  EXPECT_EQ(r.finished_rps, 0);
  EXPECT_TRUE(r.fell_behind);
  EXPECT_FALSE(ReadPacedStage({}, {}, 0, 20).fell_behind);
}

}  // namespace
}  // namespace kvtier
