// WorkerPool: a fixed set of threads draining a bounded FIFO of tasks.
//
// TrySubmit refuses (returns false) instead of blocking when the queue is full, so a caller can
// turn back-pressure into a "rejected" outcome. WaitIdle blocks until every task submitted so far
// has run. The destructor runs what is queued, then joins.
//
// Thread-safety: every method is thread-safe. A task may call TrySubmit, but must not call
// WaitIdle or destroy the pool.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvtier::io {

class WorkerPool {
 public:
  // `max_queued` = 0 means unbounded. REQUIRES: threads >= 1.
  WorkerPool(std::string name, int threads, size_t max_queued);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `task`; false (and nothing queued) if the queue is full or the pool is stopping.
  bool TrySubmit(std::function<void()> task);
  void WaitIdle();

  size_t queued() const;
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop();

  const std::string name_;
  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> queue_;
  size_t running_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvtier::io
