#include "benchmarks/bench_timing.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

namespace kvtier::benchmarks {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::microseconds;

// A simulated client: a clock it controls, wake-ups `wake_late` after the time asked for, and
// requests that take `service` each.
struct SimulatedClient {
  Clock::time_point now{};
  microseconds wake_late{0};
  microseconds service{10};

  auto SleepUntil() {
    return [this](Clock::time_point t) {
      if (t > now) now = t + wake_late;  // a sleeping thread wakes up late
    };
  }
  auto Now() {
    return [this] { return now; };
  }
  auto Request() {
    return [this] { now += service; };
  }
};

TEST(BenchTiming, LatencyIncludesALateWakeUp) {
  SimulatedClient c;
  c.wake_late = microseconds(500);
  const Clock::time_point scheduled = c.now + microseconds(200);
  const float us = TimeFromSchedule(scheduled, c.SleepUntil(), c.Now(), c.Request());
  // 500 us late plus the request's 10 us: timed from the send it would be 10 us.
  EXPECT_FLOAT_EQ(us, 510.0f);
}

TEST(BenchTiming, LatencyIncludesTheBacklogOfSlowRequests) {
  // Requests due every 100 us that each take 300 us: the backlog grows by 200 us per request,
  // and each one's latency shows it (timed from the send, every one would read 300 us).
  SimulatedClient c;
  c.service = microseconds(300);
  const Clock::time_point start = c.now;
  std::vector<float> us;
  for (int i = 1; i <= 4; ++i) {
    us.push_back(
        TimeFromSchedule(start + microseconds(100 * i), c.SleepUntil(), c.Now(), c.Request()));
  }
  EXPECT_FLOAT_EQ(us[0], 300.0f);
  EXPECT_FLOAT_EQ(us[1], 500.0f);
  EXPECT_FLOAT_EQ(us[2], 700.0f);
  EXPECT_FLOAT_EQ(us[3], 900.0f);
}

TEST(BenchTiming, OnTimeRequestsCostTheirServiceTime) {
  SimulatedClient c;
  const float us = TimeFromSchedule(c.now + microseconds(50), c.SleepUntil(), c.Now(), c.Request());
  EXPECT_FLOAT_EQ(us, 10.0f);
}

TEST(BenchTiming, ScheduleDoesNotMoveWithLateness) {
  const Clock::time_point start{};
  PacedSchedule<Clock> a(start, 200, 7), b(start, 200, 7);
  // The same seed gives the same send times whatever happens in between, and they only grow.
  Clock::time_point prev = start;
  double total_us = 0;
  for (int i = 0; i < 10000; ++i) {
    Clock::time_point t = a.Next();
    EXPECT_EQ(t, b.Next());
    EXPECT_GE(t, prev);
    prev = t;
  }
  total_us = std::chrono::duration<double, std::micro>(prev - start).count();
  // Mean gap within 5 % of 200 us over 10,000 draws.
  EXPECT_NEAR(total_us / 10000, 200.0, 10.0);
}

}  // namespace
}  // namespace kvtier::benchmarks
