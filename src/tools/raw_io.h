// Plain O_DIRECT file I/O: the reference the benchmarks hold the file tier against.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <span>
#include <string>

#include "kvtier/status.h"

namespace kvtier::tools {

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

}  // namespace kvtier::tools
