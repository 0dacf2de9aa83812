// Passing a descriptor over a Unix socket (SCM_RIGHTS) alongside bytes: how the server hands a
// client the shared pool (or its window) with the hello reply.
#pragma once

#include <sys/types.h>

#include <cstddef>

namespace kvtier {

// sendmsg() of `n` bytes with `fd` riding on the first of them. Returns what sendmsg returns.
ssize_t SendWithFd(int sock, const void* data, size_t n, int fd, int flags);

// recvmsg() into `buf`, like recv(). A descriptor that rode on the bytes read is stored in *fd
// when *fd < 0 (received close-on-exec); any further one is closed, so none leaks.
ssize_t ReceiveWithFd(int sock, void* buf, size_t n, int flags, int* fd);

}  // namespace kvtier
