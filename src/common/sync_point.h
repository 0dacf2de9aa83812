// Sync points: named places in library code where a test forces an ordering between threads
// ("A happens before B") or runs code of its own, so that a race is made certain rather than
// likely by a sleep. After RocksDB's test_util/sync_point.h.
//
// In library code:
//   TEST_SYNC_POINT("Engine::JoinFileRead:Joined");
//   TEST_SYNC_POINT_CALLBACK("Engine::StartFileReads:BeforeJoin", &key);
// In a test:
//   SyncPointScope sync;  // on; everything cleared and off again at the end of the scope
//   SyncPoint::Get().LoadDependency({{"Engine::JoinFileRead:Joined", "Test:AfterJoin"}});
//   ...
//   TEST_SYNC_POINT("Test:AfterJoin");  // returns once a load has joined the read
//
// A point is named "Class::Method:Where". Test code may name points of its own (above).
//
// Cost: with KVTIER_SYNC_POINTS off (CMake; off where tests are not built, as in the Python
// wheel) the macros expand to nothing. Built in, a point that no test has enabled costs one
// relaxed atomic load and a branch.
//
// Thread-safety: every method is thread-safe. Callbacks run on the thread that reached the
// point, outside the facility's lock: they may block, or reach other points.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier {

#ifdef KVTIER_NO_SYNC_POINTS
inline constexpr bool kSyncPointsBuiltIn = false;
#else
inline constexpr bool kSyncPointsBuiltIn = true;
#endif

class SyncPoint {
 public:
  // `successor`, when reached, waits until `predecessor` has been reached (since the last
  // ClearTrace).
  struct Dependency {
    std::string predecessor;
    std::string successor;
  };

  static SyncPoint& Get();

  // Replaces the dependencies. A successor waits for every one of its predecessors, at most
  // the dependency timeout (then it goes on and the wait counts in timeouts()): a test that
  // names a point never reached fails instead of hanging.
  void LoadDependency(std::vector<Dependency> dependencies);
  // Runs `callback` (with the argument of TEST_SYNC_POINT_CALLBACK, else nullptr) each time
  // `point` is reached, after the point's predecessors and before it counts as reached.
  void SetCallBack(const std::string& point, std::function<void(void*)> callback);
  void ClearCallBack(const std::string& point);
  void ClearAllCallBacks();
  // Points do nothing (not even count) until processing is enabled.
  void EnableProcessing();
  void DisableProcessing();
  // Forgets which points were reached.
  void ClearTrace();
  // Off, and no dependencies, callbacks or trace.
  void Reset();

  // How often `point` has been reached since the last ClearTrace.
  uint64_t Hits(std::string_view point) const;
  // Blocks until `point` has been reached `n` times; false if not within `timeout`.
  bool WaitForHits(std::string_view point, uint64_t n, std::chrono::milliseconds timeout);
  // Successors that gave up waiting for a predecessor.
  uint64_t timeouts() const;
  void set_dependency_timeout(std::chrono::milliseconds timeout);

  // The macros' target. REQUIRES: `point` outlives the call.
  void Process(std::string_view point, void* arg);
  static bool enabled() { return enabled_.load(std::memory_order_relaxed); }

 private:
  SyncPoint() = default;
  bool PredecessorsReached(std::string_view point) const;  // REQUIRES: mu_ held

  static std::atomic<bool> enabled_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // successor -> its predecessors
  std::map<std::string, std::vector<std::string>, std::less<>> predecessors_;
  std::map<std::string, std::function<void(void*)>, std::less<>> callbacks_;
  std::map<std::string, uint64_t, std::less<>> hits_;
  std::chrono::milliseconds dependency_timeout_{30000};
  uint64_t timeouts_ = 0;
  uint64_t callbacks_running_ = 0;
};

// Enables processing for a scope (a test); at its end waits for running callbacks, then turns
// processing off and clears dependencies, callbacks and trace.
class SyncPointScope {
 public:
  SyncPointScope() {
    SyncPoint::Get().Reset();
    SyncPoint::Get().EnableProcessing();
  }
  ~SyncPointScope() { SyncPoint::Get().Reset(); }
  SyncPointScope(const SyncPointScope&) = delete;
  SyncPointScope& operator=(const SyncPointScope&) = delete;
};

}  // namespace kvtier

#ifdef KVTIER_NO_SYNC_POINTS
#define TEST_SYNC_POINT(point) static_cast<void>(0)
#define TEST_SYNC_POINT_CALLBACK(point, arg) static_cast<void>(0)
#else
#define TEST_SYNC_POINT(point)                                                     \
  do {                                                                             \
    if (::kvtier::SyncPoint::enabled()) ::kvtier::SyncPoint::Get().Process(point, nullptr); \
  } while (0)
#define TEST_SYNC_POINT_CALLBACK(point, arg)                                    \
  do {                                                                          \
    if (::kvtier::SyncPoint::enabled()) ::kvtier::SyncPoint::Get().Process(point, arg); \
  } while (0)
#endif
