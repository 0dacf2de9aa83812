#include "common/task_pool.h"

#include <fmt/format.h>

namespace kvtier {

TaskPool::TaskPool(int threads, size_t max_queued, std::string name)
    : max_queued_(max_queued), name_(std::move(name)) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Worker(); });
}

TaskPool::~TaskPool() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

Status TaskPool::TrySubmit(std::vector<std::function<void()>> tasks) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return Status::Aborted(fmt::format("{} is shutting down", name_));
    if (max_queued_ != 0 && queue_.size() + tasks.size() > max_queued_) {
      ++rejections_;
      return Status::Rejected(fmt::format("{} queue full ({} queued, limit {})", name_,
                                          queue_.size(), max_queued_));
    }
    for (auto& t : tasks) queue_.push_back(std::move(t));
  }
  if (tasks.size() == 1) {
    work_cv_.notify_one();
  } else {
    work_cv_.notify_all();
  }
  return Status::Ok();
}

Status TaskPool::TrySubmit(std::function<void()> task) {
  std::vector<std::function<void()>> one;
  one.push_back(std::move(task));
  return TrySubmit(std::move(one));
}

void TaskPool::Drain() {
  std::unique_lock lock(mu_);
  idle_cv_.wait(lock, [this] { return queue_.empty() && running_ == 0; });
}

size_t TaskPool::queued() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

uint64_t TaskPool::rejections() const {
  std::lock_guard lock(mu_);
  return rejections_;
}

void TaskPool::Worker() {
  std::unique_lock lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything queued has run
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    lock.unlock();
    task();
    lock.lock();
    --running_;
    if (queue_.empty() && running_ == 0) idle_cv_.notify_all();
  }
}

}  // namespace kvtier
