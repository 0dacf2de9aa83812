// TaskPool: a fixed set of worker threads fed by a bounded queue that refuses instead of
// blocking.
//
// TrySubmit queues a batch of tasks all-or-nothing: if the queue lacks room for the whole batch,
// nothing is queued and kRejected is returned, so a caller never stalls behind a slow tier.
//
// Thread-safety: all methods are thread-safe. Tasks must not call Drain() or the destructor.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/status.h"

namespace kvtier {

class TaskPool {
 public:
  // REQUIRES: threads >= 1. max_queued == 0 means unbounded.
  TaskPool(int threads, size_t max_queued, std::string name);
  ~TaskPool();  // runs every queued task, then joins
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  Status TrySubmit(std::vector<std::function<void()>> tasks);
  Status TrySubmit(std::function<void()> task);
  // Blocks until the queue is empty and no task runs.
  void Drain();
  size_t queued() const;
  uint64_t rejections() const;

 private:
  void Worker();

  const size_t max_queued_;
  const std::string name_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;
  size_t running_ = 0;
  uint64_t rejections_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvtier
