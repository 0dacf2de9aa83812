// TaskPool: a set of worker threads fed by a bounded queue that refuses instead of blocking.
//
// TrySubmit queues a batch of tasks all-or-nothing: if the queue lacks room for the whole batch,
// nothing is queued and kRejected is returned, so a caller never stalls behind a slow tier.
//
// Stalled tasks (optional, TaskPoolOptions::stall_timeout): a task that has run longer than the
// stall timeout is taken to be stuck in the kernel (a read from a hung NFS server cannot be
// interrupted). The pool then starts a replacement thread for it, up to `max_extra_threads`
// beyond `threads`, so stuck tasks do not starve the queue; extra threads leave once the stuck
// ones are back. Drain and the destructor stop waiting once nothing but stalled tasks has run
// for a stall timeout: Drain returns false, the destructor drops the queued tasks (unrun) and
// detaches the stuck threads, which exit whenever their task returns. A task that may be
// abandoned this way must therefore own (or share ownership of) everything it touches.
//
// Thread-safety: all methods are thread-safe. Tasks must not call Drain() or the destructor.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/status.h"

namespace kvtier {

struct TaskPoolOptions {
  int threads = 1;        // REQUIRED: >= 1
  size_t max_queued = 0;  // 0 = unbounded
  std::string name = "task pool";
  // Zero: tasks never count as stalled, and Drain and the destructor wait for every task.
  std::chrono::milliseconds stall_timeout{0};
  int max_extra_threads = 0;  // replacement threads for stalled tasks, at most
};

class TaskPool {
 public:
  // REQUIRES: threads >= 1. max_queued == 0 means unbounded. No stall handling.
  TaskPool(int threads, size_t max_queued, std::string name);
  explicit TaskPool(const TaskPoolOptions& options);
  // Runs every queued task, then joins; with stall handling, gives up on stalled tasks (see
  // above).
  ~TaskPool();
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  Status TrySubmit(std::vector<std::function<void()>> tasks);
  Status TrySubmit(std::function<void()> task);
  // Blocks until the queue is empty and no task runs (true), or, with stall handling, until
  // only stalled tasks have run for a stall timeout (false).
  bool Drain();
  // What the destructor does, callable earlier: stops taking tasks (TrySubmit returns kAborted),
  // runs or drops the queue, joins or detaches the threads. Returns the number of stalled tasks
  // abandoned (their threads detached); 0 when everything finished. Idempotent.
  size_t Shutdown();

  size_t queued() const;
  uint64_t rejections() const;
  size_t threads() const;         // live worker threads (stalled ones included)
  size_t stalled() const;         // tasks running longer than the stall timeout now
  uint64_t replacements() const;  // threads started to replace stalled ones, so far
  // Threads detached at shutdown (by any pool of this process) whose task has not returned yet.
  // A process that exits while this is not 0 should skip static destructors (quick_exit), which
  // those threads could still reach when their task returns.
  static size_t DetachedRunning();

 private:
  struct State;
  void Start(int threads);
  static void Worker(std::shared_ptr<State> state, size_t index);
  static void Watchdog(std::shared_ptr<State> state);
  static void GrowLocked(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
  std::mutex threads_mu_;
  std::vector<std::thread> threads_;  // by worker index; joined or detached at Shutdown
  std::thread watchdog_;
  bool shut_down_ = false;
};

}  // namespace kvtier
