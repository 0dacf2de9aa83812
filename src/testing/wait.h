// Waiting in tests for something observable (a counter in the server's stats, a file, a thread
// finishing) instead of sleeping a fixed time: a bounded poll whose deadline is generous, so that
// a loaded machine makes a test slower, never wrong.
#pragma once

#include <chrono>
#include <thread>

namespace kvtier::testing {

// The default deadline of a wait: far beyond what any wait takes on an idle machine.
inline constexpr std::chrono::seconds kWaitDeadline{30};

// Calls `done` until it returns true (then true) or `deadline` has passed (then false, after a
// last call). Polls every `poll`. Use as ASSERT_TRUE(WaitUntil(...)) << "what did not happen".
template <typename Predicate>
bool WaitUntil(Predicate&& done, std::chrono::milliseconds deadline = kWaitDeadline,
               std::chrono::microseconds poll = std::chrono::milliseconds(10)) {
  const auto end = std::chrono::steady_clock::now() + deadline;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= end) return done();
    std::this_thread::sleep_for(poll);
  }
  return true;
}

}  // namespace kvtier::testing
