#include "server/socket.h"

#include <fmt/format.h>
#include <grp.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kvtier/socket_path.h"

namespace kvtier::server {

namespace {
Result<sockaddr_un> SocketAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(
        fmt::format("socket path \"{}\" is too long ({} bytes, at most {})", path, path.size(),
                    sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

// The default socket's directory when $XDG_RUNTIME_DIR is unset: /tmp is writable by everyone,
// so the socket lives in a directory only we can write to, created here if needed. Anything else
// at that name (another user's directory, a symlink, a directory others may write to) is
// refused: whoever controls the directory could bind the socket first and collect clients'
// tokens.
Status EnsurePrivateSocketDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Status::FromErrno(errno, fmt::format("creating the socket directory \"{}\"", dir));
  }
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    return Status::FromErrno(errno, fmt::format("checking the socket directory \"{}\"", dir));
  }
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::getuid() || (st.st_mode & 022) != 0) {
    return Status::PermissionDenied(fmt::format(
        "socket directory \"{}\" is not a directory owned by this user (uid {}) and writable "
        "only by it; remove it or choose --socket",
        dir, ::getuid()));
  }
  return Status::Ok();
}

}  // namespace

Status CheckSocketPath(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(sockaddr_un addr, SocketAddress(path));
  if (const std::string dir = PrivateSocketDir(); path.rfind(dir + "/", 0) == 0) {
    KVTIER_RETURN_IF_ERROR(EnsurePrivateSocketDir(dir));
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return Status::Ok();
  if (!S_ISSOCK(st.st_mode)) {
    return Status::InvalidArgument(
        fmt::format("socket path \"{}\" exists and is not a socket; refusing to replace it", path));
  }
  int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int rc = ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  ::close(probe);
  if (rc == 0) {
    return Status::Unavailable(
        fmt::format("socket path \"{}\" is in use: a server is already listening there", path));
  }
  if (err != ECONNREFUSED && err != ENOENT) {
    return Status::FromErrno(err, fmt::format("probing existing socket \"{}\"", path));
  }
  spdlog::info("removing stale socket file {}", path);
  ::unlink(path.c_str());
  return Status::Ok();
}

Result<int> ListenOnSocketPath(const std::string& path, const std::string& group) {
  KVTIER_RETURN_IF_ERROR(CheckSocketPath(path));
  // Bound and listening under a name of its own first, then linked to its path: whoever sees the
  // path can connect (a script that waits for the file never meets a socket that refuses), and
  // link, unlike rename, fails if another server took the path meanwhile. A path too long for
  // the extra name is bound in place.
  std::string staging = fmt::format("{}.{}", path, ::getpid());
  if (!SocketAddress(staging).ok()) staging = path;
  KVTIER_ASSIGN_OR_RETURN(sockaddr_un addr, SocketAddress(staging));

  // Non-blocking: the door thread accepts until EAGAIN.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Status::FromErrno(errno, "socket");
  bool bound = false;
  auto fail = [&](Status s) {
    if (bound) ::unlink(staging.c_str());
    ::close(fd);
    return s;
  };
  gid_t gid = static_cast<gid_t>(-1);
  if (!group.empty()) {
    struct group* g = ::getgrnam(group.c_str());
    if (!g) return fail(Status::InvalidArgument(fmt::format("unknown socket group \"{}\"", group)));
    gid = g->gr_gid;
  }
  // Created owner-only from the start (no window with wider permissions); widened to the group
  // afterwards if asked.
  mode_t old = ::umask(0177);
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  ::umask(old);
  if (rc != 0) return fail(Status::FromErrno(err, fmt::format("binding socket \"{}\"", staging)));
  bound = true;
  if (gid != static_cast<gid_t>(-1)) {
    if (::chown(staging.c_str(), static_cast<uid_t>(-1), gid) != 0 ||
        ::chmod(staging.c_str(), 0660)) {
      return fail(Status::FromErrno(
          errno, fmt::format("giving socket \"{}\" to group \"{}\"", path, group)));
    }
  }
  if (::listen(fd, 128) != 0) return fail(Status::FromErrno(errno, "listen"));
  if (staging != path) {
    if (::link(staging.c_str(), path.c_str()) != 0) {
      if (errno == EEXIST) {
        return fail(Status::Unavailable(fmt::format(
            "socket path \"{}\" is in use: another server took it as this one started", path)));
      }
      return fail(Status::FromErrno(errno, fmt::format("linking socket \"{}\"", path)));
    }
    ::unlink(staging.c_str());
  }
  return fd;
}

}  // namespace kvtier::server
