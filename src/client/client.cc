// Client side of the server protocol (the client library; the in-process adapter is
// src/engine/chunk_store.cc).
//
// Replies are read by whichever waiting thread holds the "reader" role (leader/follower): the
// thread that needs a reply reads the socket itself, so a round trip costs no extra thread hop;
// replies for other requests are parked in `ready_` and their waiters woken.
#include "kvtier/client.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "common/fd_passing.h"
#include "common/task_pool.h"
#include "server/codec.h"

namespace kvtier {

using Clock = std::chrono::steady_clock;
using server::FrameHeader;
using server::Opcode;

namespace {

// An operation whose result is computed by someone else and handed over once.
class PromiseOp final : public AsyncOp::Impl {
 public:
  void Set(OpResult r) {
    std::lock_guard lock(mu_);
    result_ = std::move(r);
    cv_.notify_all();
  }
  bool Done() override {
    std::lock_guard lock(mu_);
    return result_.has_value();
  }
  std::optional<OpResult> WaitFor(std::optional<std::chrono::nanoseconds> timeout) override {
    std::unique_lock lock(mu_);
    if (!timeout) {
      cv_.wait(lock, [this] { return result_.has_value(); });
    } else if (!cv_.wait_for(lock, *timeout, [this] { return result_.has_value(); })) {
      return std::nullopt;
    }
    return result_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<OpResult> result_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Client::Impl

class Client::Impl : public std::enable_shared_from_this<Client::Impl> {
 public:
  struct Frame {
    uint16_t opcode = 0;
    std::vector<uint8_t> body;
  };

  explicit Impl(const ClientOptions& o) : options(o) {}
  ~Impl() {
    copies.reset();  // finishes queued Store/Load copies while the connection is still up
    if (fd >= 0) ::close(fd);
    if (base) ::munmap(base, hello.arena_bytes);
  }

  Status Connect();
  // SO_PEERCRED: the server must run as options.server_uid, or as this user or root.
  Status CheckServerIdentity();
  // Sends a request frame whose id was registered with Register().
  Status Send(uint64_t id, const std::vector<uint8_t>& frame);
  uint64_t Register() {
    uint64_t id = next_id.fetch_add(1);
    std::lock_guard lock(mu);
    pending[id] = true;
    return id;
  }
  // Waits for the reply to `id`. An error if the connection is (or becomes) broken or the rpc
  // deadline `hard` passes (which breaks it); nullopt if `soft` passes first.
  Result<std::optional<Frame>> Await(uint64_t id, Clock::time_point hard, Clock::time_point soft);
  // Register + send + await, for synchronous calls. Returns the reader positioned after an OK
  // status, via `fields`.
  Result<Frame> Call(const std::function<std::vector<uint8_t>(uint64_t)>& build);
  // Stops waiting for `id`: its reply, when it comes, is dropped (and a prepare_load's pins are
  // released).
  void Abandon(uint64_t id);
  Status ReleaseSlots(std::span<const SlotId> slots);
  // Sends a release without waiting for its reply (dropped when it comes): for destructors and
  // replies nobody waits for. The Locked form with mu held.
  void ReleaseSlotsNoWait(std::span<const SlotId> slots);
  void ReleaseSlotsNoWaitLocked(std::span<const SlotId> slots);

  Result<LookupResult> TryLookup(std::span<const ChunkKey> keys);
  Result<std::vector<SlotId>> Reserve(std::span<const ChunkKey> keys);
  Status Commit(std::span<const SlotId> slots);
  Status Abort(std::span<const SlotId> slots);
  Result<AsyncOp> PrepareLoad(std::span<const ChunkKey> keys);
  Status CheckKeys(size_t n) const {
    if (n > hello.max_keys_per_request) {
      return Status::InvalidArgument(
          fmt::format("{} keys exceed the server's limit of {} per "
                      "request",
                      n, hello.max_keys_per_request));
    }
    return Status::Ok();
  }
  Status Broken() {
    std::lock_guard lock(mu);
    return broken;
  }
  uint8_t* SlotPtr(SlotId s) const { return base + static_cast<uint64_t>(s) * hello.slot_bytes; }
  bool ValidSlot(SlotId s) const { return s < hello.num_slots; }

  ClientOptions options;
  int fd = -1;
  uint8_t* base = nullptr;
  server::HelloReply hello;
  std::unique_ptr<TaskPool> copies;

 private:
  enum class ReadOutcome { kFrame, kNoData, kError };
  // Reads one frame (reader role only). kNoData if nothing complete arrived by `deadline`.
  ReadOutcome ReadOne(Clock::time_point deadline, FrameHeader* h, Frame* f, Status* error);
  void BreakLocked(Status s) {
    if (broken.ok()) {
      broken = std::move(s);
      if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
    }
    cv.notify_all();
  }
  void DispatchLocked(const FrameHeader& h, Frame f);

  std::atomic<uint64_t> next_id{1};
  std::mutex send_mu;
  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  bool reader_active = false;
  Status broken;
  std::unordered_map<uint64_t, bool> pending;  // ids sent, reply not yet received
  std::unordered_map<uint64_t, Frame> ready;
  std::unordered_map<uint64_t, bool> abandoned;
  // Read buffer, touched only by the reader.
  std::vector<uint8_t> rbuf = std::vector<uint8_t>(64 * 1024);
  size_t rbegin = 0, rend = 0;
};

namespace {

Status ConnectError(int err, const std::string& path) {
  switch (err) {
    case ENOENT:
    case ECONNREFUSED:
      return Status::Unavailable(fmt::format(
          "no kvtier server listens at \"{}\" (start one with `kvtier serve --socket {}`)", path,
          path));
    case EACCES:
    case EPERM:
      return Status::PermissionDenied(fmt::format(
          "not allowed to connect to \"{}\" (the socket is owner-only unless the server was "
          "started with --socket-group)",
          path));
    default:
      return Status::FromErrno(err, fmt::format("connecting to \"{}\"", path));
  }
}

// Milliseconds until `deadline`, rounded up, for poll(); 0 once it has passed.
int RemainingMs(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return 1 << 30;
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>((us + 999) / 1000, 0, 1 << 30));
}

}  // namespace

Status Client::Impl::CheckServerIdentity() {
  int64_t expected = options.server_uid;
  if (expected < 0) {
    if (const char* env = std::getenv("KVTIER_SERVER_UID"); env && *env) {
      char* end = nullptr;
      long long v = std::strtoll(env, &end, 10);
      if (*end != '\0' || v < 0 || v > 0xFFFFFFFELL) {
        return Status::InvalidArgument(fmt::format("KVTIER_SERVER_UID \"{}\" is not a uid", env));
      }
      expected = v;
    }
  }
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return Status::FromErrno(errno, "reading the server's credentials (SO_PEERCRED)");
  }
  const uid_t me = ::getuid();
  const bool trusted =
      expected >= 0 ? cred.uid == static_cast<uid_t>(expected) : cred.uid == me || cred.uid == 0;
  if (!trusted) {
    return Status::PermissionDenied(fmt::format(
        "the process listening at \"{}\" (pid {}) runs as uid {}, not as {}; refusing to send "
        "it the token (set ClientOptions::server_uid or KVTIER_SERVER_UID if the server runs as "
        "another user on purpose)",
        options.socket_path, cred.pid, cred.uid,
        expected >= 0 ? fmt::format("the expected uid {}", expected)
                      : fmt::format("this user (uid {}) or root", me)));
  }
  return Status::Ok();
}

Status Client::Impl::Connect() {
  if (options.socket_path.empty()) options.socket_path = DefaultSocketPath();
  KVTIER_RETURN_IF_ERROR(options.ns.Validate().WithContext("client namespace"));
  if (options.copy_threads < 0 || options.copy_threads > 64) {
    return Status::InvalidArgument("client: copy_threads must be in [0, 64]");
  }
  if (options.token.size() > 0xFFFF || options.client_name.size() > 0xFFFF) {
    return Status::InvalidArgument("client: token or client name longer than 65535 bytes");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string& path = options.socket_path;
  if (path.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(fmt::format("socket path \"{}\" is too long", path));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::FromErrno(errno, "socket");
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ConnectError(errno, path);
  }
  // Whoever listens at the path learns our token and gets our keys: make sure it is the server
  // we mean (another local user may have bound a socket there first).
  KVTIER_RETURN_IF_ERROR(CheckServerIdentity());
  struct timeval tv {};
  tv.tv_sec = options.rpc_timeout.count() / 1000;
  tv.tv_usec = (options.rpc_timeout.count() % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));

  server::HelloRequest req;
  req.token = options.token;
  req.ns = options.ns;
  req.chunk_bytes = options.chunk_bytes;
  req.client_name = options.client_name;
  const uint64_t id = next_id.fetch_add(1);
  auto frame = server::EncodeHelloRequest(id, req);
  if (::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(frame.size())) {
    return Status::Unavailable(
        fmt::format("sending the handshake to \"{}\" failed: {}", path, std::strerror(errno)));
  }

  // The reply carries the arena's descriptor on its first byte, so the header is read with
  // recvmsg; the rest with recv.
  const auto deadline = Clock::now() + options.connect_timeout;
  uint8_t header[server::kHeaderBytes];
  size_t got = 0;
  int passed_fd = -1;
  auto wait_readable = [&]() -> Status {
    pollfd p{fd, POLLIN, 0};
    int n = ::poll(&p, 1, RemainingMs(deadline));
    if (n == 0) return Status::Timeout(fmt::format("no handshake reply from \"{}\"", path));
    if (n < 0 && errno != EINTR) return Status::FromErrno(errno, "poll");
    return Status::Ok();
  };
  while (got < sizeof(header)) {
    KVTIER_RETURN_IF_ERROR(wait_readable());
    ssize_t r = ReceiveWithFd(fd, header + got, sizeof(header) - got, 0, &passed_fd);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      return Status::Unavailable(
          fmt::format("the server at \"{}\" closed the connection during the handshake", path));
    }
    got += static_cast<size_t>(r);
  }
  struct FdCloser {
    int& fd;
    ~FdCloser() {
      if (fd >= 0) ::close(fd);
    }
  } closer{passed_fd};
  FrameHeader h = server::DecodeHeader(header);
  if (h.opcode != (static_cast<uint16_t>(Opcode::kHello) | server::kReplyBit) ||
      h.request_id != id || h.body_length > (1u << 20)) {
    return Status::Unavailable(fmt::format("\"{}\" does not speak the kvtier protocol", path));
  }
  std::vector<uint8_t> body(h.body_length);
  got = 0;
  while (got < body.size()) {
    KVTIER_RETURN_IF_ERROR(wait_readable());
    ssize_t r = ::recv(fd, body.data() + got, body.size() - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return Status::Unavailable("the server closed the connection during the handshake");
    got += static_cast<size_t>(r);
  }
  server::Reader reader(body);
  Status remote;
  KVTIER_RETURN_IF_ERROR(server::DecodeReplyStatus(reader, &remote));
  if (!remote.ok()) return remote.WithContext("server refused the connection");
  KVTIER_ASSIGN_OR_RETURN(hello, server::DecodeHelloReply(reader));
  if (passed_fd < 0) return Status::Internal("handshake reply carried no pool descriptor");
  if (hello.version != server::kProtocolVersion || hello.slot_bytes < hello.chunk_bytes ||
      hello.chunk_bytes == 0 || hello.num_slots == 0 ||
      hello.arena_bytes < hello.slot_bytes * hello.num_slots ||
      (options.chunk_bytes != 0 && hello.chunk_bytes != options.chunk_bytes) ||
      hello.max_keys_per_request == 0) {
    return Status::Internal("inconsistent handshake reply from the server");
  }
  struct stat st;
  if (::fstat(passed_fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < hello.arena_bytes) {
    return Status::Internal("the pool descriptor is smaller than the announced arena");
  }
  int flags = MAP_SHARED | (options.populate_mapping ? MAP_POPULATE : 0);
  void* p = ::mmap(nullptr, hello.arena_bytes, PROT_READ | PROT_WRITE, flags, passed_fd, 0);
  if (p == MAP_FAILED) return Status::FromErrno(errno, "mapping the server's pool");
  base = static_cast<uint8_t*>(p);
  options.chunk_bytes = hello.chunk_bytes;
  if (options.copy_threads > 0) {
    copies = std::make_unique<TaskPool>(
        options.copy_threads, std::max<size_t>(1, options.max_queued_copies), "client copy queue");
  }
  return Status::Ok();
}

Status Client::Impl::Send(uint64_t id, const std::vector<uint8_t>& frame) {
  int err = 0;
  {
    std::lock_guard lock(send_mu);
    const uint8_t* p = frame.data();
    size_t n = frame.size();
    while (n > 0) {
      ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        err = w < 0 ? errno : EPIPE;
        break;
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  if (err == 0) return Status::Ok();
  // Lock order is mu -> send_mu, so mu is taken only after send_mu is released.
  std::lock_guard lock(mu);
  pending.erase(id);
  BreakLocked(Status::Unavailable(
      fmt::format("lost the connection to the kvtier server: {}", std::strerror(err))));
  return broken;
}

Client::Impl::ReadOutcome Client::Impl::ReadOne(Clock::time_point deadline, FrameHeader* h,
                                                Frame* f, Status* error) {
  while (true) {
    size_t have = rend - rbegin;
    if (have >= server::kHeaderBytes) {
      *h = server::DecodeHeader(rbuf.data() + rbegin);
      if (!(h->opcode & server::kReplyBit) || h->flags != 0 || h->body_length > (64u << 20)) {
        *error = Status::Unavailable("malformed reply from the kvtier server");
        return ReadOutcome::kError;
      }
      size_t total = server::kHeaderBytes + h->body_length;
      if (have >= total) {
        f->opcode = h->opcode & ~server::kReplyBit;
        f->body.assign(rbuf.begin() + rbegin + server::kHeaderBytes, rbuf.begin() + rbegin + total);
        rbegin += total;
        return ReadOutcome::kFrame;
      }
      if (rbuf.size() < total) {
        std::memmove(rbuf.data(), rbuf.data() + rbegin, have);
        rend = have;
        rbegin = 0;
        rbuf.resize(total);
      }
    }
    if (rbegin == rend) rbegin = rend = 0;
    if (rend == rbuf.size()) {
      std::memmove(rbuf.data(), rbuf.data() + rbegin, rend - rbegin);
      rend -= rbegin;
      rbegin = 0;
    }
    ssize_t r;
    if (deadline - Clock::now() > std::chrono::milliseconds(200)) {
      // A synchronous call: block in recv (bounded by SO_RCVTIMEO = rpc_timeout), one system
      // call per reply instead of poll + recv.
      r = ::recv(fd, rbuf.data() + rend, rbuf.size() - rend, 0);
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (Clock::now() >= deadline) return ReadOutcome::kNoData;
        continue;
      }
    } else {
      pollfd p{fd, POLLIN, 0};
      int n = ::poll(&p, 1, RemainingMs(deadline));
      if (n == 0) return ReadOutcome::kNoData;
      if (n < 0 && errno != EINTR) {
        *error = Status::FromErrno(errno, "poll");
        return ReadOutcome::kError;
      }
      if (n < 0) continue;
      r = ::recv(fd, rbuf.data() + rend, rbuf.size() - rend, MSG_DONTWAIT);
    }
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r <= 0) {
      *error = Status::Unavailable("the kvtier server closed the connection");
      return ReadOutcome::kError;
    }
    rend += static_cast<size_t>(r);
  }
}

void Client::Impl::DispatchLocked(const FrameHeader& h, Frame f) {
  if (pending.erase(h.request_id)) {
    ready[h.request_id] = std::move(f);
    return;
  }
  if (abandoned.erase(h.request_id)) {
    // Nobody waits for this reply. A prepare_load's pins must still be given back.
    if (f.opcode == static_cast<uint16_t>(Opcode::kPrepareLoad)) {
      server::Reader r(f.body);
      Status remote;
      if (server::DecodeReplyStatus(r, &remote).ok() && remote.ok()) {
        auto p = server::DecodePrepareLoadReply(r, hello.max_keys_per_request);
        if (p.ok()) ReleaseSlotsNoWaitLocked(p->slots);
      }
    }
    return;
  }
  BreakLocked(Status::Unavailable(
      fmt::format("the kvtier server answered unknown request {}", h.request_id)));
}

Result<std::optional<Client::Impl::Frame>> Client::Impl::Await(uint64_t id, Clock::time_point hard,
                                                               Clock::time_point soft) {
  std::unique_lock lock(mu);
  while (true) {
    auto it = ready.find(id);
    if (it != ready.end()) {
      Frame f = std::move(it->second);
      ready.erase(it);
      return std::optional<Frame>(std::move(f));
    }
    if (!broken.ok()) return broken;
    const auto now = Clock::now();
    if (now >= hard) {
      BreakLocked(Status::Timeout(fmt::format("the kvtier server did not answer within {} ms",
                                              options.rpc_timeout.count())));
      return broken;
    }
    const auto until = std::min(hard, soft);
    if (!reader_active) {
      reader_active = true;
      lock.unlock();
      FrameHeader h;
      Frame f;
      Status error;
      ReadOutcome o = ReadOne(until, &h, &f, &error);
      lock.lock();
      reader_active = false;
      if (o == ReadOutcome::kFrame) DispatchLocked(h, std::move(f));
      if (o == ReadOutcome::kError) BreakLocked(error);
      cv.notify_all();
      if (o == ReadOutcome::kNoData && Clock::now() >= soft) return std::optional<Frame>();
      continue;
    }
    if (now >= soft) return std::optional<Frame>();
    cv.wait_until(lock, until);
  }
}

void Client::Impl::Abandon(uint64_t id) {
  std::unique_lock lock(mu);
  if (pending.erase(id)) {
    abandoned[id] = true;
    return;
  }
  auto it = ready.find(id);
  if (it == ready.end()) return;
  Frame f = std::move(it->second);
  ready.erase(it);
  FrameHeader h;
  h.request_id = id;
  abandoned[id] = true;
  DispatchLocked(h, std::move(f));
}

Result<Client::Impl::Frame> Client::Impl::Call(
    const std::function<std::vector<uint8_t>(uint64_t)>& build) {
  uint64_t id = Register();
  KVTIER_RETURN_IF_ERROR(Send(id, build(id)));
  auto deadline = Clock::now() + options.rpc_timeout;
  auto reply = Await(id, deadline, Clock::time_point::max());
  if (!reply.ok()) return reply.status();
  if (!reply->has_value()) return Status::Internal("no reply");  // unreachable: no soft deadline
  Frame f = std::move(reply->value());
  return f;
}

namespace {
// Decodes the status at the head of a reply; the reader then points at the fields.
Status RemoteStatus(server::Reader& r) {
  Status remote;
  KVTIER_RETURN_IF_ERROR(server::DecodeReplyStatus(r, &remote));
  return remote;
}
}  // namespace

Result<LookupResult> Client::Impl::TryLookup(std::span<const ChunkKey> keys) {
  LookupResult total;
  const size_t batch = hello.max_keys_per_request;
  for (size_t at = 0; at < keys.size(); at += batch) {
    auto part = keys.subspan(at, std::min(batch, keys.size() - at));
    KVTIER_ASSIGN_OR_RETURN(auto f, Call([&](uint64_t id) {
                              return server::EncodeKeysRequest(Opcode::kLookup, id, part);
                            }));
    server::Reader r(f.body);
    KVTIER_RETURN_IF_ERROR(RemoteStatus(r));
    KVTIER_ASSIGN_OR_RETURN(auto l, server::DecodeLookupReply(r));
    if (l.total > part.size() || l.memory > l.total) {
      return Status::Internal("lookup reply counts more chunks than asked");
    }
    if (total.memory == total.total) total.memory += l.memory;
    total.total += l.total;
    if (l.total < part.size()) break;
  }
  return total;
}

Result<std::vector<SlotId>> Client::Impl::Reserve(std::span<const ChunkKey> keys) {
  KVTIER_RETURN_IF_ERROR(CheckKeys(keys.size()));
  KVTIER_ASSIGN_OR_RETURN(auto f, Call([&](uint64_t id) {
                            return server::EncodeKeysRequest(Opcode::kReserve, id, keys);
                          }));
  server::Reader r(f.body);
  KVTIER_RETURN_IF_ERROR(RemoteStatus(r));
  KVTIER_ASSIGN_OR_RETURN(auto slots, server::DecodeSlotsReply(r, hello.max_keys_per_request));
  if (slots.size() > keys.size()) return Status::Internal("reserve reply has too many slots");
  for (SlotId s : slots) {
    if (s != kNoSlot && !ValidSlot(s)) return Status::Internal("reserve reply: slot out of range");
  }
  return slots;
}

Status Client::Impl::Commit(std::span<const SlotId> slots) {
  KVTIER_RETURN_IF_ERROR(CheckKeys(slots.size()));
  KVTIER_ASSIGN_OR_RETURN(auto f, Call([&](uint64_t id) {
                            return server::EncodeSlotsRequest(Opcode::kCommit, id, slots);
                          }));
  server::Reader r(f.body);
  KVTIER_RETURN_IF_ERROR(RemoteStatus(r));
  return server::DecodeU32Reply(r).status();
}

Status Client::Impl::Abort(std::span<const SlotId> slots) {
  KVTIER_RETURN_IF_ERROR(CheckKeys(slots.size()));
  KVTIER_ASSIGN_OR_RETURN(auto f, Call([&](uint64_t id) {
                            return server::EncodeSlotsRequest(Opcode::kAbort, id, slots);
                          }));
  server::Reader r(f.body);
  KVTIER_RETURN_IF_ERROR(RemoteStatus(r));
  return server::DecodeEmptyReply(r);
}

Status Client::Impl::ReleaseSlots(std::span<const SlotId> slots) {
  if (slots.empty()) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(CheckKeys(slots.size()));
  KVTIER_ASSIGN_OR_RETURN(auto f, Call([&](uint64_t id) {
                            return server::EncodeSlotsRequest(Opcode::kRelease, id, slots);
                          }));
  server::Reader r(f.body);
  KVTIER_RETURN_IF_ERROR(RemoteStatus(r));
  return server::DecodeEmptyReply(r);
}

void Client::Impl::ReleaseSlotsNoWait(std::span<const SlotId> slots) {
  std::lock_guard lock(mu);
  ReleaseSlotsNoWaitLocked(slots);
}

void Client::Impl::ReleaseSlotsNoWaitLocked(std::span<const SlotId> slots) {
  if (slots.empty() || !broken.ok()) return;  // a broken connection: the server released them
  for (size_t at = 0; at < slots.size(); at += hello.max_keys_per_request) {
    const size_t n = std::min<size_t>(hello.max_keys_per_request, slots.size() - at);
    uint64_t id = next_id.fetch_add(1);
    abandoned[id] = true;
    // Lock order mu -> send_mu (Send never takes mu while holding send_mu).
    auto frame = server::EncodeSlotsRequest(Opcode::kRelease, id, slots.subspan(at, n));
    std::lock_guard lock(send_mu);
    [[maybe_unused]] ssize_t w = ::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
  }
}

namespace {

// A prepare_load whose reply may come later. The first Wait/WaitFor that sees the result hands
// the pins to the caller; if nobody ever takes them, the destructor releases them.
class RemoteLoadOp final : public AsyncOp::Impl {
 public:
  RemoteLoadOp(std::shared_ptr<Client::Impl> client, uint64_t id, size_t keys,
               Clock::time_point sent)
      : client_(std::move(client)), id_(id), keys_(keys), sent_(sent) {}
  ~RemoteLoadOp() override {
    std::lock_guard lock(mu_);
    if (!result_) {
      client_->Abandon(id_);
    } else if (!taken_) {
      client_->ReleaseSlotsNoWait(result_->slots);  // no round trip in a destructor
    }
  }
  bool Done() override { return Poll(Clock::now()).has_value(); }
  std::optional<OpResult> WaitFor(std::optional<std::chrono::nanoseconds> timeout) override {
    auto soft = timeout ? Clock::now() + *timeout : Clock::time_point::max();
    auto r = Poll(soft);
    if (r) {
      std::lock_guard lock(mu_);
      taken_ = true;
    }
    return r;
  }

 private:
  std::optional<OpResult> Poll(Clock::time_point soft) {
    std::lock_guard lock(mu_);
    if (result_) return result_;
    auto hard = sent_ + client_->options.rpc_timeout;
    auto f = client_->Await(id_, hard, soft);
    OpResult r;
    if (!f.ok()) {
      r.status = f.status();
    } else if (!f->has_value()) {
      return std::nullopt;
    } else {
      server::Reader reader((*f)->body);
      r.status = RemoteStatus(reader);
      if (r.status.ok()) {
        auto p = server::DecodePrepareLoadReply(reader, client_->hello.max_keys_per_request);
        if (!p.ok()) {
          r.status = p.status();
        } else {
          bool valid = p->slots.size() <= keys_;
          for (SlotId s : p->slots) valid = valid && client_->ValidSlot(s);
          if (!valid) {
            r.status = Status::Internal("prepare_load reply: bad slots");
          } else {
            r.chunks = p->chunks;
            r.slots = std::move(p->slots);
            if (r.chunks < keys_) {
              r.status = Status::NotFound(
                  fmt::format("{} of {} leading chunks available", r.chunks, keys_));
            }
          }
        }
      }
    }
    result_ = std::move(r);
    return result_;
  }

  std::shared_ptr<Client::Impl> client_;
  const uint64_t id_;
  const size_t keys_;
  const Clock::time_point sent_;
  std::mutex mu_;
  std::optional<OpResult> result_;
  bool taken_ = false;
};

}  // namespace

Result<AsyncOp> Client::Impl::PrepareLoad(std::span<const ChunkKey> keys) {
  KVTIER_RETURN_IF_ERROR(CheckKeys(keys.size()));
  uint64_t id = Register();
  auto sent = Clock::now();
  KVTIER_RETURN_IF_ERROR(Send(id, server::EncodeKeysRequest(Opcode::kPrepareLoad, id, keys)));
  return AsyncOp(std::make_shared<RemoteLoadOp>(shared_from_this(), id, keys.size(), sent));
}

// ---------------------------------------------------------------------------------------------
// Client

Client::Client(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() { impl_->copies.reset(); }

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto impl = std::make_shared<Impl>(options);
  Status s = impl->Connect();
  if (!s.ok()) return s;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

uint64_t Client::chunk_bytes() const { return impl_->hello.chunk_bytes; }
uint64_t Client::session_id() const { return impl_->hello.session_id; }
uint32_t Client::num_slots() const { return impl_->hello.num_slots; }
uint64_t Client::slot_bytes() const { return impl_->hello.slot_bytes; }
uint32_t Client::max_keys_per_request() const { return impl_->hello.max_keys_per_request; }
uint8_t* Client::pool_base() const { return impl_->base; }
uint64_t Client::pool_bytes() const { return impl_->hello.arena_bytes; }
bool Client::connected() const { return impl_->Broken().ok(); }
Status Client::broken_status() const { return impl_->Broken(); }

std::span<uint8_t> Client::SlotData(SlotId slot) const {
  if (!impl_->ValidSlot(slot)) return {};
  return {impl_->SlotPtr(slot), impl_->hello.chunk_bytes};
}

LookupResult Client::Lookup(std::span<const ChunkKey> keys) {
  auto r = impl_->TryLookup(keys);
  return r.ok() ? *r : LookupResult{};
}

Result<LookupResult> Client::TryLookup(std::span<const ChunkKey> keys) {
  return impl_->TryLookup(keys);
}

Result<std::vector<SlotId>> Client::ReserveSlots(std::span<const ChunkKey> keys) {
  return impl_->Reserve(keys);
}

Status Client::CommitSlots(std::span<const ChunkKey> keys, std::span<const SlotId> slots) {
  if (keys.size() < slots.size()) {
    return Status::InvalidArgument("commit: more slots than keys");
  }
  return impl_->Commit(slots);
}

Status Client::AbortSlots(std::span<const SlotId> slots) { return impl_->Abort(slots); }

Result<AsyncOp> Client::PrepareLoad(std::span<const ChunkKey> keys) {
  return impl_->PrepareLoad(keys);
}

Status Client::Unpin(std::span<const SlotId> slots) { return impl_->ReleaseSlots(slots); }

Status Client::Ping() {
  KVTIER_ASSIGN_OR_RETURN(auto f, impl_->Call([](uint64_t id) {
    return server::EncodeEmptyRequest(Opcode::kPing, id);
  }));
  server::Reader r(f.body);
  KVTIER_RETURN_IF_ERROR(RemoteStatus(r));
  return server::DecodeEmptyReply(r);
}

Status Client::Describe(std::span<const ChunkKey> keys,
                        std::span<const std::span<const uint8_t>> descriptors) {
  if (keys.size() != descriptors.size()) {
    return Status::InvalidArgument(
        fmt::format("describe: {} keys but {} descriptors", keys.size(), descriptors.size()));
  }
  std::vector<server::DescribeEntry> entries(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const size_t n = descriptors[i].size();
    if (n == 0 || n > server::kMaxDescriptorBytes) {
      return Status::InvalidArgument(
          fmt::format("describe: descriptor {} has {} bytes (1 to {} allowed)", i, n,
                      server::kMaxDescriptorBytes));
    }
    entries[i] = {keys[i], descriptors[i]};
  }
  // Frames within the server's limits: at most max_keys_per_request entries and
  // max_message_bytes of body each.
  const size_t max_body = impl_->hello.max_message_bytes;
  size_t at = 0;
  while (at < entries.size()) {
    size_t end = at, body = 4;
    while (end < entries.size() && end - at < impl_->hello.max_keys_per_request) {
      const size_t add = server::DescribeEntryBytes(entries[end].descriptor.size());
      if (end > at && body + add > max_body) break;
      body += add;
      ++end;
    }
    auto part = std::span<const server::DescribeEntry>(entries).subspan(at, end - at);
    KVTIER_ASSIGN_OR_RETURN(
        auto f, impl_->Call([&](uint64_t id) { return server::EncodeDescribeRequest(id, part); }));
    server::Reader r(f.body);
    KVTIER_RETURN_IF_ERROR(RemoteStatus(r));
    KVTIER_RETURN_IF_ERROR(server::DecodeEmptyReply(r));
    at = end;
  }
  return Status::Ok();
}

Result<std::string> Client::StatsJson() {
  KVTIER_ASSIGN_OR_RETURN(auto f, impl_->Call([](uint64_t id) {
    return server::EncodeEmptyRequest(Opcode::kStats, id);
  }));
  server::Reader r(f.body);
  KVTIER_RETURN_IF_ERROR(RemoteStatus(r));
  return server::DecodeTextReply(r);
}

namespace {

// Runs `work` on the client's copy pool (or inline without one) and returns its handle.
Result<AsyncOp> RunCopy(TaskPool* pool, std::function<OpResult()> work) {
  if (!pool) return AsyncOp::Finished(work());
  auto op = std::make_shared<PromiseOp>();
  Status s = pool->TrySubmit([op, work = std::move(work)] { op->Set(work()); });
  if (!s.ok()) return s;
  return AsyncOp(op);
}

}  // namespace

Result<AsyncOp> Client::Store(std::span<const ChunkKey> keys,
                              std::span<const std::span<const uint8_t>> src) {
  if (keys.size() != src.size()) {
    return Status::InvalidArgument(
        fmt::format("store: {} keys but {} source buffers", keys.size(), src.size()));
  }
  const uint64_t cb = chunk_bytes();
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i].size() != cb) {
      return Status::InvalidArgument(
          fmt::format("store: buffer {} holds {} bytes, a chunk is {}", i, src[i].size(), cb));
    }
  }
  KVTIER_RETURN_IF_ERROR(impl_->Broken());
  std::vector<ChunkKey> k(keys.begin(), keys.end());
  std::vector<std::span<const uint8_t>> s(src.begin(), src.end());
  return RunCopy(impl_->copies.get(), [impl = impl_, k = std::move(k), s = std::move(s)] {
    OpResult r;
    const size_t batch = impl->hello.max_keys_per_request;
    for (size_t at = 0; at < k.size(); at += batch) {
      size_t n = std::min(batch, k.size() - at);
      auto slots = impl->Reserve(std::span(k).subspan(at, n));
      if (!slots.ok()) {
        r.status = slots.status();
        return r;
      }
      for (size_t i = 0; i < slots->size(); ++i) {
        SlotId slot = (*slots)[i];
        if (slot != kNoSlot) std::memcpy(impl->SlotPtr(slot), s[at + i].data(), s[at + i].size());
      }
      Status c = impl->Commit(*slots);
      if (!c.ok()) {
        r.status = c;
        return r;
      }
      r.chunks += slots->size();
      if (slots->size() < n) {
        r.status = Status::Rejected(fmt::format(
            "server pool full: stored {} of {} chunks (the rest are pinned or reserved)", r.chunks,
            k.size()));
        return r;
      }
    }
    return r;
  });
}

Result<AsyncOp> Client::Load(std::span<const ChunkKey> keys,
                             std::span<const std::span<uint8_t>> dst) {
  if (keys.size() != dst.size()) {
    return Status::InvalidArgument(
        fmt::format("load: {} keys but {} destination buffers", keys.size(), dst.size()));
  }
  const uint64_t cb = chunk_bytes();
  for (size_t i = 0; i < dst.size(); ++i) {
    if (dst[i].size() != cb) {
      return Status::InvalidArgument(
          fmt::format("load: buffer {} holds {} bytes, a chunk is {}", i, dst[i].size(), cb));
    }
  }
  KVTIER_RETURN_IF_ERROR(impl_->Broken());
  std::vector<ChunkKey> k(keys.begin(), keys.end());
  std::vector<std::span<uint8_t>> d(dst.begin(), dst.end());
  return RunCopy(impl_->copies.get(), [impl = impl_, k = std::move(k), d = std::move(d)] {
    OpResult r;
    const size_t batch = impl->hello.max_keys_per_request;
    for (size_t at = 0; at < k.size(); at += batch) {
      size_t n = std::min(batch, k.size() - at);
      auto op = impl->PrepareLoad(std::span(k).subspan(at, n));
      if (!op.ok()) {
        r.status = op.status();
        return r;
      }
      OpResult p = op->Wait();
      for (size_t i = 0; i < p.slots.size(); ++i) {
        std::memcpy(d[at + i].data(), impl->SlotPtr(p.slots[i]), d[at + i].size());
      }
      Status u = impl->ReleaseSlots(p.slots);
      r.chunks += p.slots.size();
      if (!u.ok()) {
        r.status = u;
        return r;
      }
      if (p.slots.size() < n) {
        r.status = p.status.ok() || p.status.IsNotFound()
                       ? Status::NotFound(
                             fmt::format("{} of {} leading chunks available", r.chunks, k.size()))
                       : p.status;
        return r;
      }
    }
    return r;
  });
}

}  // namespace kvtier
