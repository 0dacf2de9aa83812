// LogLimiter: lets a message through at most `burst` times per `interval`, and says how many were
// held back when it lets one through again. For errors that can repeat at I/O rate (a full disk,
// a full queue): the first ones are logged, the rest are counted, none floods the log.
//
//   static LogLimiter limiter;  // or one per object
//   if (auto n = limiter.Allow(); n) spdlog::warn("disk full{}", LogLimiter::Suppressed(*n));
//
// Thread-safety: Allow is thread-safe.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

namespace kvtier {

class LogLimiter {
 public:
  explicit LogLimiter(std::chrono::milliseconds interval = std::chrono::seconds(10),
                      uint32_t burst = 3)
      : interval_(interval), burst_(burst) {}

  // nullopt: stay quiet. Otherwise log now; the value is how many calls were held back since the
  // last message that was let through.
  std::optional<uint64_t> Allow() {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (now - window_start_ >= interval_) {
      window_start_ = now;
      in_window_ = 0;
    }
    if (in_window_ >= burst_) {
      ++suppressed_;
      return std::nullopt;
    }
    ++in_window_;
    uint64_t held = suppressed_;
    suppressed_ = 0;
    return held;
  }

  // " (N similar messages suppressed)" or "".
  static std::string Suppressed(uint64_t n) {
    return n == 0 ? std::string() : fmt::format(" ({} similar messages suppressed)", n);
  }

 private:
  const std::chrono::milliseconds interval_;
  const uint32_t burst_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point window_start_{};
  uint32_t in_window_ = 0;
  uint64_t suppressed_ = 0;
};

}  // namespace kvtier
