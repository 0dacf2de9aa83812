// Timing of paced (open-loop) requests for the benchmarks.
//
// A paced client is meant to send requests at given times: Poisson arrivals, `mean_gap_us` apart
// on average, as inference processes do between scheduler steps. If the client wakes up late, or
// an earlier request was still running when the next one was due, the request goes out late; a
// caller of the real system would have waited that long too. So a request's latency is counted
// from its scheduled send time, not from when the client got round to sending it (timing from
// the actual send hides exactly the slow moments: "coordinated omission"). The schedule is
// fixed in advance and never moves with lateness.
//
// Thread-safety: a PacedSchedule is used by one thread; the functions are pure.
#pragma once

#include <chrono>
#include <cstdint>
#include <random>

namespace kvtier::benchmarks {

template <typename Clock = std::chrono::steady_clock>
class PacedSchedule {
 public:
  using TimePoint = typename Clock::time_point;

  // Send times start one gap after `start`. REQUIRES: mean_gap_us > 0.
  PacedSchedule(TimePoint start, double mean_gap_us, uint64_t seed)
      : next_(start), rng_(seed), gap_(1.0 / mean_gap_us) {}

  // The next scheduled send time: the previous one plus a random gap, whatever the time now.
  TimePoint Next() {
    next_ += std::chrono::duration_cast<typename Clock::duration>(
        std::chrono::duration<double, std::micro>(gap_(rng_)));
    return next_;
  }

 private:
  TimePoint next_;
  std::mt19937_64 rng_;
  std::exponential_distribution<double> gap_;
};

// Microseconds from `from` to `to`.
template <typename TimePoint>
float MicrosBetween(TimePoint from, TimePoint to) {
  return std::chrono::duration<float, std::micro>(to - from).count();
}

// Sends one request at `scheduled` and returns its latency in microseconds from that time:
// waits with `sleep_until(scheduled)` (returns at once when already late), runs `request()`,
// then reads `now()`. A late wake-up or a backlog is part of the latency.
template <typename TimePoint, typename SleepUntil, typename Now, typename Request>
float TimeFromSchedule(TimePoint scheduled, SleepUntil&& sleep_until, Now&& now,
                       Request&& request) {
  sleep_until(scheduled);
  request();
  return MicrosBetween(scheduled, now());
}

}  // namespace kvtier::benchmarks
