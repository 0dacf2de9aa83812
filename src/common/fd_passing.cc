#include "common/fd_passing.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

namespace kvtier {

namespace {
// A message of `n` bytes at `data` with room for one descriptor.
struct FdMessage {
  FdMessage(void* data, size_t n) : iov{data, n} {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
  iovec iov;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
};
}  // namespace

ssize_t SendWithFd(int sock, const void* data, size_t n, int fd, int flags) {
  FdMessage m(const_cast<void*>(data), n);
  cmsghdr* cmsg = CMSG_FIRSTHDR(&m.msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  return ::sendmsg(sock, &m.msg, flags);
}

ssize_t ReceiveWithFd(int sock, void* buf, size_t n, int flags, int* fd) {
  FdMessage m(buf, n);
  const ssize_t r = ::recvmsg(sock, &m.msg, flags | MSG_CMSG_CLOEXEC);
  if (r < 0) return r;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m.msg); c; c = CMSG_NXTHDR(&m.msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int got;
      std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (*fd < 0) {
        *fd = got;
      } else {
        ::close(got);
      }
    }
  }
  return r;
}

}  // namespace kvtier
