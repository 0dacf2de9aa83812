#include "common/task_pool.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>

namespace kvtier {

using Clock = std::chrono::steady_clock;

namespace {
std::atomic<size_t> detached_running{0};
}  // namespace

// Everything the workers touch lives here, shared with them, so that a worker detached at
// shutdown (stuck in a task) can still finish its loop after the TaskPool object is gone.
struct TaskPool::State {
  explicit State(const TaskPoolOptions& o) : options(o) {}

  struct WorkerInfo {
    bool busy = false;
    bool exited = false;  // its thread has left the loop (a finished thread to join)
    bool detached = false;  // abandoned at shutdown; counted in detached_running
    Clock::time_point busy_since;
  };

  const TaskPoolOptions options;
  std::mutex mu;
  std::condition_variable work_cv, idle_cv, watchdog_cv;
  std::deque<std::function<void()>> queue;
  std::vector<WorkerInfo> workers;   // by index, one per thread ever started
  std::vector<std::thread> handles;  // by index; moved out at shutdown
  size_t alive = 0, running = 0;
  uint64_t rejections = 0, replacements = 0;
  Clock::time_point last_completion = Clock::now();
  bool stopping = false;
  bool dropping = false;  // shutdown gave up on stalled tasks: workers leave after their task

  bool StallHandling() const { return options.stall_timeout.count() > 0; }
  // REQUIRES: mu held.
  size_t StalledLocked(Clock::time_point now) const {
    if (!StallHandling()) return 0;
    size_t n = 0;
    for (const WorkerInfo& w : workers) n += w.busy && now - w.busy_since >= options.stall_timeout;
    return n;
  }
  // REQUIRES: mu held. True when every running task is stalled and none has finished for a stall
  // timeout since `since`: waiting longer is waiting on the kernel.
  bool HopelessLocked(Clock::time_point now, Clock::time_point since) const {
    if (!StallHandling() || running == 0) return false;
    if (StalledLocked(now) < running) return false;
    return now - std::max(since, last_completion) >= options.stall_timeout;
  }
  Clock::duration Tick() const {
    return std::clamp<Clock::duration>(options.stall_timeout / 4, std::chrono::milliseconds(5),
                                       std::chrono::milliseconds(250));
  }
};

// REQUIRES: state->mu held. Starts replacement threads while stalled tasks leave fewer than
// `threads` healthy workers and there is work queued.
void TaskPool::GrowLocked(const std::shared_ptr<State>& state) {
  auto* worker = &TaskPool::Worker;
  auto& s = *state;
  if (!s.StallHandling() || s.stopping || s.queue.empty()) return;
  const auto now = Clock::now();
  const size_t stalled = s.StalledLocked(now);
  const size_t base = static_cast<size_t>(s.options.threads);
  const size_t cap = base + static_cast<size_t>(std::max(s.options.max_extra_threads, 0));
  while (s.alive - stalled < base && s.alive < cap) {
    // Reuse the place of a thread that has left (a retired replacement): join it first, which
    // is immediate, since it no longer needs the lock we hold.
    size_t index = 0;
    while (index < s.workers.size() && !s.workers[index].exited) ++index;
    if (index == s.workers.size()) {
      s.workers.emplace_back();
      s.handles.emplace_back();
    } else if (s.handles[index].joinable()) {
      s.handles[index].join();
    }
    s.workers[index] = {};
    ++s.alive;
    ++s.replacements;
    s.handles[index] = std::thread(worker, state, index);
    spdlog::warn("{}: {} tasks stalled for over {} ms; started a replacement thread ({} threads)",
                 s.options.name, stalled, s.options.stall_timeout.count(), s.alive);
  }
}

TaskPool::TaskPool(int threads, size_t max_queued, std::string name)
    : TaskPool(TaskPoolOptions{threads, max_queued, std::move(name)}) {}

TaskPool::TaskPool(const TaskPoolOptions& options) : state_(std::make_shared<State>(options)) {
  Start(std::max(options.threads, 1));
}

void TaskPool::Start(int threads) {
  std::lock_guard lock(state_->mu);
  for (int i = 0; i < threads; ++i) {
    state_->workers.emplace_back();
    ++state_->alive;
    state_->handles.emplace_back(&TaskPool::Worker, state_, static_cast<size_t>(i));
  }
  if (state_->StallHandling()) watchdog_ = std::thread(&TaskPool::Watchdog, state_);
}

TaskPool::~TaskPool() { Shutdown(); }

size_t TaskPool::Shutdown() {
  std::lock_guard threads_lock(threads_mu_);
  if (shut_down_) return 0;
  shut_down_ = true;
  State& s = *state_;
  std::deque<std::function<void()>> dropped;
  std::vector<std::thread> handles;
  std::vector<bool> detach;
  size_t abandoned = 0;
  {
    std::unique_lock lock(s.mu);
    s.stopping = true;
    s.work_cv.notify_all();
    s.watchdog_cv.notify_all();
    const auto since = Clock::now();
    while (s.alive > 0) {
      if (s.HopelessLocked(Clock::now(), since)) {
        s.dropping = true;
        dropped.swap(s.queue);
        abandoned = s.running;
        s.work_cv.notify_all();
        break;
      }
      if (s.StallHandling()) {
        s.idle_cv.wait_for(lock, s.Tick());
      } else {
        s.idle_cv.wait(lock);
      }
    }
    handles.swap(s.handles);
    for (auto& w : s.workers) {
      detach.push_back(w.busy);
      if (w.busy) {
        w.detached = true;
        detached_running.fetch_add(1);
      }
    }
  }
  if (abandoned > 0) {
    spdlog::error(
        "{}: gave up on {} tasks stuck for over {} ms (threads detached); dropped {} "
        "queued tasks",
        s.options.name, abandoned, s.options.stall_timeout.count(), dropped.size());
  }
  dropped.clear();  // outside the lock: tasks' captures may do anything when destroyed
  if (watchdog_.joinable()) watchdog_.join();
  for (size_t i = 0; i < handles.size(); ++i) {
    if (!handles[i].joinable()) continue;
    // A worker not busy now will see `stopping` with an empty queue and leave promptly.
    if (detach[i]) {
      handles[i].detach();
    } else {
      handles[i].join();
    }
  }
  return abandoned;
}

Status TaskPool::TrySubmit(std::vector<std::function<void()>> tasks) {
  {
    std::lock_guard lock(state_->mu);
    State& s = *state_;
    if (s.stopping) return Status::Aborted(fmt::format("{} is shutting down", s.options.name));
    if (s.options.max_queued != 0 && s.queue.size() + tasks.size() > s.options.max_queued) {
      ++s.rejections;
      return Status::Rejected(fmt::format("{} queue full ({} queued, limit {})", s.options.name,
                                          s.queue.size(), s.options.max_queued));
    }
    for (auto& t : tasks) s.queue.push_back(std::move(t));
    GrowLocked(state_);
  }
  if (tasks.size() == 1) {
    state_->work_cv.notify_one();
  } else {
    state_->work_cv.notify_all();
  }
  return Status::Ok();
}

Status TaskPool::TrySubmit(std::function<void()> task) {
  std::vector<std::function<void()>> one;
  one.push_back(std::move(task));
  return TrySubmit(std::move(one));
}

bool TaskPool::Drain() {
  State& s = *state_;
  std::unique_lock lock(s.mu);
  const auto since = Clock::now();
  for (;;) {
    if (s.queue.empty() && s.running == 0) return true;
    if (s.HopelessLocked(Clock::now(), since)) return false;
    if (s.StallHandling()) {
      s.idle_cv.wait_for(lock, s.Tick());
    } else {
      s.idle_cv.wait(lock);
    }
  }
}

size_t TaskPool::queued() const {
  std::lock_guard lock(state_->mu);
  return state_->queue.size();
}

uint64_t TaskPool::rejections() const {
  std::lock_guard lock(state_->mu);
  return state_->rejections;
}

size_t TaskPool::threads() const {
  std::lock_guard lock(state_->mu);
  return state_->alive;
}

size_t TaskPool::stalled() const {
  std::lock_guard lock(state_->mu);
  return state_->StalledLocked(Clock::now());
}

uint64_t TaskPool::replacements() const {
  std::lock_guard lock(state_->mu);
  return state_->replacements;
}

void TaskPool::Worker(std::shared_ptr<State> state, size_t index) {
  State& s = *state;
  const size_t base = static_cast<size_t>(s.options.threads);
  std::unique_lock lock(s.mu);
  for (;;) {
    s.work_cv.wait(lock, [&s] { return s.stopping || !s.queue.empty(); });
    if (s.queue.empty() || s.dropping) break;  // stopping, and everything queued has run
    std::function<void()> task = std::move(s.queue.front());
    s.queue.pop_front();
    ++s.running;
    s.workers[index].busy = true;
    s.workers[index].busy_since = Clock::now();
    lock.unlock();
    task();
    task = nullptr;  // its captures are released outside the lock
    lock.lock();
    --s.running;
    s.workers[index].busy = false;
    s.last_completion = Clock::now();
    s.idle_cv.notify_all();
    if (s.dropping) break;
    // A replacement thread leaves once the stuck threads are back and there is nothing to do.
    if (s.StallHandling() && s.queue.empty() && s.alive - s.StalledLocked(Clock::now()) > base) {
      break;
    }
  }
  --s.alive;
  s.workers[index].exited = true;
  if (s.workers[index].detached) detached_running.fetch_sub(1);
  s.idle_cv.notify_all();
}

size_t TaskPool::DetachedRunning() { return detached_running.load(); }

void TaskPool::Watchdog(std::shared_ptr<State> state) {
  State& s = *state;
  std::unique_lock lock(s.mu);
  while (!s.stopping) {
    s.watchdog_cv.wait_for(lock, s.Tick());
    if (!s.stopping) GrowLocked(state);
  }
}

}  // namespace kvtier
