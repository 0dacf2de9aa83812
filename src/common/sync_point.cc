#include "common/sync_point.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace kvtier {

std::atomic<bool> SyncPoint::enabled_{false};

SyncPoint& SyncPoint::Get() {
  static SyncPoint* instance = new SyncPoint();  // never destroyed: points may be reached late
  return *instance;
}

void SyncPoint::LoadDependency(std::vector<Dependency> dependencies) {
  std::lock_guard lock(mu_);
  predecessors_.clear();
  for (auto& d : dependencies) {
    predecessors_[std::move(d.successor)].push_back(std::move(d.predecessor));
  }
  cv_.notify_all();
}

void SyncPoint::SetCallBack(const std::string& point, std::function<void(void*)> callback) {
  std::lock_guard lock(mu_);
  callbacks_[point] = std::move(callback);
}

void SyncPoint::ClearCallBack(const std::string& point) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, dependency_timeout_, [&] { return callbacks_running_ == 0; });
  callbacks_.erase(point);
}

void SyncPoint::ClearAllCallBacks() {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, dependency_timeout_, [&] { return callbacks_running_ == 0; });
  callbacks_.clear();
}

void SyncPoint::EnableProcessing() { enabled_.store(true, std::memory_order_relaxed); }

void SyncPoint::DisableProcessing() { enabled_.store(false, std::memory_order_relaxed); }

void SyncPoint::ClearTrace() {
  std::lock_guard lock(mu_);
  hits_.clear();
}

void SyncPoint::Reset() {
  DisableProcessing();
  std::unique_lock lock(mu_);
  // A callback still running may use what the test that set it is about to destroy.
  cv_.wait_for(lock, dependency_timeout_, [&] { return callbacks_running_ == 0; });
  predecessors_.clear();
  callbacks_.clear();
  hits_.clear();
  timeouts_ = 0;
  cv_.notify_all();  // successors still waiting have nothing left to wait for
}

uint64_t SyncPoint::Hits(std::string_view point) const {
  std::lock_guard lock(mu_);
  auto it = hits_.find(point);
  return it == hits_.end() ? 0 : it->second;
}

bool SyncPoint::WaitForHits(std::string_view point, uint64_t n,
                            std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] {
    auto it = hits_.find(point);
    return it != hits_.end() && it->second >= n;
  });
}

uint64_t SyncPoint::timeouts() const {
  std::lock_guard lock(mu_);
  return timeouts_;
}

void SyncPoint::set_dependency_timeout(std::chrono::milliseconds timeout) {
  std::lock_guard lock(mu_);
  dependency_timeout_ = timeout;
}

bool SyncPoint::PredecessorsReached(std::string_view point) const {
  auto it = predecessors_.find(point);
  if (it == predecessors_.end()) return true;
  return std::all_of(it->second.begin(), it->second.end(),
                     [&](const std::string& p) { return hits_.contains(p); });
}

void SyncPoint::Process(std::string_view point, void* arg) {
  if (!enabled()) return;
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, dependency_timeout_, [&] {
        return !enabled() || PredecessorsReached(point);
      })) {
    ++timeouts_;
    spdlog::warn("sync point {}: a predecessor was not reached in {} ms", point,
                    dependency_timeout_.count());
  }
  if (auto it = callbacks_.find(point); it != callbacks_.end() && enabled()) {
    std::function<void(void*)> callback = it->second;
    ++callbacks_running_;
    lock.unlock();
    callback(arg);
    lock.lock();
    --callbacks_running_;
  }
  ++hits_[std::string(point)];
  cv_.notify_all();
}

}  // namespace kvtier
