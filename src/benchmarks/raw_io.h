// Plain O_DIRECT file I/O, and the threads that run it: the reference the benchmarks hold the
// file tier against.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::benchmarks {

// Plain O_DIRECT: one pwrite (then fdatasync, as the tier does before publishing) per file.
inline Status RawWrite(const std::string& path, std::span<const uint8_t> buf) {
  int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno(errno, fmt::format("open {} with O_DIRECT", path));
  size_t done = 0;
  while (done < buf.size()) {
    ssize_t n = ::pwrite(fd, buf.data() + done, buf.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Status s = Status::FromErrno(n < 0 ? errno : EIO, fmt::format("write {}", path));
      ::close(fd);
      return s;
    }
    done += static_cast<size_t>(n);
  }
  Status s;
  if (::fdatasync(fd) != 0) s = Status::FromErrno(errno, fmt::format("fdatasync {}", path));
  ::close(fd);
  return s;
}

inline Status RawRead(const std::string& path, std::span<uint8_t> buf) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(errno, fmt::format("open {} with O_DIRECT", path));
  size_t done = 0;
  while (done < buf.size()) {
    ssize_t n = ::pread(fd, buf.data() + done, buf.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Status s = n == 0 ? Status::Corruption(fmt::format("{} is short", path))
                        : Status::FromErrno(errno, fmt::format("read {}", path));
      ::close(fd);
      return s;
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return Status::Ok();
}

// Runs fn(thread, i) for every i in [0, n) on `threads` threads, each taking the next i; returns
// the wall time in seconds.
template <typename Fn>
double Parallel(int threads, uint32_t n, Fn fn) {
  std::atomic<uint32_t> next{0};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (uint32_t i; (i = next.fetch_add(1)) < n;) fn(t, i);
    });
  }
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace kvtier::benchmarks
