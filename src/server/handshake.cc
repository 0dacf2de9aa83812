// The door thread: accepts connections, reads and checks their hellos without a thread per
// connection, and starts a thread for each accepted handshake.
#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <system_error>
#include <tuple>

#include "server/printable.h"
#include "server/server_impl.h"

namespace kvtier::server {

void Server::Impl::AcceptLoop() {
  std::list<std::shared_ptr<Connection>> pending;  // accepted, hello not yet complete
  Clock::time_point backoff{};                     // accept paused until then (out of fds)
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<Connection>> polled;
  Clock::time_point next_expiry_scan{};
  while (!stopping_) {
    auto now = Clock::now();
    // Silent connections are closed at their deadline; they never got a thread.
    for (auto it = pending.begin(); it != pending.end();) {
      if ((*it)->hello_deadline <= now) {
        spdlog::info("closing connection {} (pid {}): no hello within {} ms", (*it)->id,
                     (*it)->peer_pid, options_.hello_timeout.count());
        metrics_.refused_by["hello_timeout"]->Increment();
        ClosePending(**it);
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
    auto wake_at = now + std::chrono::seconds(1);
    for (auto& c : pending) wake_at = std::min(wake_at, c->hello_deadline);
    const bool accepting = now >= backoff;
    if (!accepting) wake_at = std::min(wake_at, backoff);
    fds.clear();
    polled.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
    for (auto& c : pending) {
      fds.push_back({c->fd, POLLIN, 0});
      polled.push_back(c);
    }
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(wake_at - now);
    int n = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, wait.count())));
    ReapFinished(false);
    if (Clock::now() >= next_expiry_scan) {
      ExpireReservations(Clock::now());
      next_expiry_scan = Clock::now() + std::chrono::milliseconds(250);
    }
    if (n <= 0 || stopping_) continue;
    for (size_t i = 0; i < polled.size(); ++i) {
      if (!fds[i + 2].revents) continue;
      if (!ReadHello(polled[i])) pending.remove(polled[i]);
    }
    if (fds[1].revents & POLLIN) AcceptNew(pending, &backoff);
  }
  for (auto& c : pending) ClosePending(*c);
}

void Server::Impl::AcceptNew(std::list<std::shared_ptr<Connection>>& pending,
                             Clock::time_point* backoff) {
  for (int round = 0; round < 64; ++round) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED) return;
      // Out of descriptors or memory: the listening socket stays readable, so retrying at once
      // would spin. Pause accepting briefly; connections wait in the backlog meanwhile.
      metrics_.accept_errors.Increment();
      if (!accept_failing_) {
        accept_failing_ = true;
        spdlog::warn(
            "accept failed: {}; pausing new connections, retrying every 100 ms{}",
            std::strerror(err),
            err == EMFILE || err == ENFILE ? " (raise the open-file limit, ulimit -n)" : "");
      }
      *backoff = Clock::now() + std::chrono::milliseconds(100);
      return;
    }
    if (accept_failing_) {
      accept_failing_ = false;
      spdlog::info("accepting connections again");
    }
    auto conn = std::make_shared<Connection>();
    conn->id = next_id_++;
    conn->fd = fd;
    conn->hello_deadline = Clock::now() + options_.hello_timeout;
    struct ucred cred {};
    socklen_t len = sizeof(cred);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
      conn->peer_pid = cred.pid;
      conn->peer_uid = cred.uid;
      conn->peer_known = true;
    }
    metrics_.connections.Increment();
    // A real client says hello at once; whoever holds connections open without one is the
    // first to go when room is needed, so they cannot lock real clients out.
    if (pending.size() >= options_.max_pending_handshakes) {
      auto& oldest = pending.front();
      spdlog::info("closing connection {} (pid {}): {} connections are waiting for a hello",
                   oldest->id, oldest->peer_pid, pending.size());
      metrics_.refused_by["too_many_pending"]->Increment();
      ClosePending(*oldest);
      pending.pop_front();
    }
    pending.push_back(conn);
    // The hello is often there already.
    if (!ReadHello(conn)) pending.pop_back();
  }
}

bool Server::Impl::ReadHello(const std::shared_ptr<Connection>& conn) {
  Connection& c = *conn;
  // A hello is small (protocol.md); no more than this is ever buffered for an unknown peer.
  const size_t limit = kHeaderBytes + std::min<size_t>(options_.max_message_bytes, kMaxHelloBytes);
  while (true) {
    if (c.in.size() >= kHeaderBytes) {
      FrameHeader h = DecodeHeader(c.in.data());
      Status s = CheckRequestHeader(h, options_.max_message_bytes);
      if (s.ok() && h.opcode != static_cast<uint16_t>(Opcode::kHello)) {
        s = Status::InvalidArgument("the first message must be hello");
      }
      if (s.ok() && kHeaderBytes + h.body_length > limit) {
        s = Status::InvalidArgument(
            fmt::format("hello of {} bytes exceeds the limit of {}", h.body_length, limit));
      }
      if (!s.ok()) {
        ProtocolError(c, h, s);
        ClosePending(c);
        return false;
      }
      const size_t total = kHeaderBytes + h.body_length;
      if (c.in.size() >= total) {
        std::vector<uint8_t> rest(c.in.begin() + total, c.in.end());
        std::span<const uint8_t> body(c.in.data() + kHeaderBytes, h.body_length);
        // On success the connection and its buffer belong to its thread from here on.
        if (!HandleHello(conn, h, body, std::move(rest))) ClosePending(c);
        return false;
      }
    }
    uint8_t buf[4096];
    ssize_t r = ::recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (r <= 0) {
      ClosePending(c);
      return false;
    }
    c.in.insert(c.in.end(), buf, buf + r);
  }
}

void Server::Impl::ClosePending(Connection& c) {
  std::lock_guard lock(c.out_mu);
  c.out_closed = true;
  pump_.Forget(c);
  if (c.fd >= 0) ::close(c.fd);
  c.fd = -1;
}

void Server::Impl::ReapFinished(bool all) {
  std::list<std::shared_ptr<Connection>> done;
  {
    std::lock_guard lock(conns_mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (all || (*it)->finished) {
        done.push_back(*it);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : done) {
    if (c->thread.joinable()) c->thread.join();
  }
}

bool Server::Impl::HandleHello(const std::shared_ptr<Connection>& conn, const FrameHeader& h,
                               std::span<const uint8_t> body, std::vector<uint8_t> rest) {
  Connection& c = *conn;
  auto hello = DecodeHelloRequest(body);
  if (!hello.ok()) {
    if (hello.status().code() == StatusCode::kUnimplemented) {
      Refuse(c, h, hello.status(), "version");
    } else {
      ProtocolError(c, h, hello.status());
    }
    return false;
  }
  auto refuse = [&](const Refusal& r) {
    Refuse(c, h, r.status, r.reason);
    return false;
  };
  std::string tenant;
  if (auto r = CheckHello(c, *hello, &tenant)) return refuse(*r);
  c.ns = hello->ns;
  c.tenant = std::move(tenant);
  c.deriver = c.tenant.empty() ? std::make_unique<KeyDeriver>(c.ns)
                               : std::make_unique<KeyDeriver>(TenantRoot(c.ns, c.tenant));
  if (events_) {
    // The ranks of one TP group share their chunks' descriptors: the group is the namespace
    // with rank 0 (and the tenant, where there is one).
    KeyNamespace group = c.ns;
    group.rank = 0;
    const ChunkKey root = c.tenant.empty() ? group.Root() : TenantRoot(group, c.tenant);
    std::memcpy(&c.events_group, root.data(), sizeof(c.events_group));
    events_->RegisterGroup(c.events_group, {c.ns.model_id, "", c.ns.chunk_tokens, c.ns.world_size});
  }
  c.in = std::move(rest);
  const Engine::Pool pool = engine_->pool();
  HelloReply reply;
  reply.session_id = c.id;
  reply.arena_bytes = pool.bytes;
  reply.slot_bytes = pool.slot_bytes;
  reply.chunk_bytes = engine_->options().chunk_bytes;
  reply.num_slots = pool.num_slots;
  if (options_.isolate_clients) {
    if (auto r = OpenWindow(c, &reply)) return refuse(*r);
  }
  reply.max_keys_per_request = options_.max_keys_per_request;
  reply.max_message_bytes = options_.max_message_bytes;
  reply.server_version = KVTIER_VERSION;
  auto frame = EncodeReply(h.opcode, h.request_id, Status::Ok(), HelloReplyFields(reply));
  std::lock_guard lock(conns_mu_);
  if (auto r = AdmitLocked(c)) return refuse(*r);
  // The connection's socket blocks from now on (its thread reads it); replies never block.
  int fl = ::fcntl(c.fd, F_GETFL);
  if (fl >= 0) ::fcntl(c.fd, F_SETFL, fl & ~O_NONBLOCK);
  try {
    conn->thread = std::thread(
        [this, conn, frame = std::move(frame)]() mutable { Serve(conn, std::move(frame)); });
  } catch (const std::system_error& e) {
    // Out of threads (a task limit, memory): this client is refused, the server goes on.
    metrics_.dropped_by["no_thread"]->Increment();
    return refuse({Status::Unavailable(fmt::format("the server cannot start a thread for this "
                                                   "connection ({}); try again later",
                                                   e.what())),
                   "no_thread"});
  }
  conns_.push_back(conn);
  return true;
}

std::optional<Server::Impl::Refusal> Server::Impl::CheckHello(Connection& c,
                                                              const HelloRequest& hello,
                                                              std::string* tenant) const {
  // Names reach logs, /stats and metrics: they must be printable text.
  for (auto [what, text, max] : {std::tuple{"client_name", &hello.client_name, size_t{256}},
                                 std::tuple{"model_id", &hello.ns.model_id, size_t{1024}}}) {
    if (!IsPrintableUtf8(*text) || text->size() > max) {
      return Refusal{Status::InvalidArgument(fmt::format(
                         "{} \"{}\" refused: it must be UTF-8 text of at most {} bytes without "
                         "control characters",
                         what, LogSafe(text->substr(0, 64)), max)),
                     "bad_name"};
    }
  }
  c.name = hello.client_name;  // from here on, refusals are logged with it
  if (hello.version != kProtocolVersion) {
    return Refusal{
        Status::Unimplemented(fmt::format("protocol version {} not supported (server speaks {})",
                                          hello.version, kProtocolVersion)),
        "version"};
  }
  if (!options_.token.empty()) {
    const std::string& t = hello.token;
    bool match = t.size() == options_.token.size() &&
                 CRYPTO_memcmp(t.data(), options_.token.data(), t.size()) == 0;
    if (!match) return Refusal{Status::PermissionDenied("wrong or missing token"), "token"};
  }
  // The tenant comes from what the server knows of the peer (its uid) or from a token the
  // operator issued, never from a field the client fills in: the namespace it declares is
  // public (a model id anyone can name), so it cannot be what keeps tenants apart.
  if (options_.isolate_clients) {
    if (!tenant_tokens_.empty()) {
      const std::string* name = tenant_tokens_.Find(hello.token);
      if (!name) {
        return Refusal{Status::PermissionDenied("wrong or missing token (not a tenant's token)"),
                       "token"};
      }
      *tenant = "tenant:" + *name;
    } else if (c.peer_known) {
      *tenant = fmt::format("uid:{}", c.peer_uid);
    } else {
      return Refusal{Status::PermissionDenied(
                         "the server cannot tell which user this connection is (SO_PEERCRED "
                         "failed), so not its tenant either"),
                     "no_credentials"};
    }
  }
  Status ns = hello.ns.Validate();
  if (!ns.ok()) return Refusal{ns.WithContext("namespace refused"), "namespace"};
  const uint64_t pool_chunk = engine_->options().chunk_bytes;
  if (hello.chunk_bytes != 0 && hello.chunk_bytes != pool_chunk) {
    return Refusal{Status::InvalidArgument(fmt::format(
                       "layout mismatch: a chunk of this client is {} bytes ({} tokens), but "
                       "this server's pool holds {}-byte chunks; start a server for this "
                       "model/layout (--model, --chunk-size, --chunk-bytes)",
                       hello.chunk_bytes, hello.ns.chunk_tokens, pool_chunk)),
                   "chunk_size"};
  }
  if (stopping_)
    return Refusal{Status::Unavailable("server is draining (shutting down)"), "draining"};
  return std::nullopt;
}

std::optional<Server::Impl::Refusal> Server::Impl::OpenWindow(Connection& c, HelloReply* reply) {
  const Engine::Pool pool = engine_->pool();
  // As many window slots as the connection may hold, so one is always free for them, within
  // what the windows' memory bound leaves.
  const uint64_t limit = options_.max_window_bytes > 0 ? options_.max_window_bytes : 4 * pool.bytes;
  uint64_t slots = SlotQuota();
  {
    std::lock_guard lock(window_budget_->mu);
    const uint64_t left = limit > window_budget_->used ? limit - window_budget_->used : 0;
    slots = std::min<uint64_t>(slots, left / pool.slot_bytes);
    window_budget_->used += slots * pool.slot_bytes;
  }
  c.window_budget = window_budget_;  // given back when the connection goes
  c.window_charge = slots * pool.slot_bytes;
  if (slots == 0) {
    return Refusal{Status::Unavailable(fmt::format(
                       "the isolated clients' windows already take the {} MiB they may "
                       "(--max-window-mb); retry later, or raise it or lower --max-client-slots",
                       limit >> 20)),
                   "no_window_memory"};
  }
  auto window = ClientWindow::Create(static_cast<uint32_t>(slots), pool.slot_bytes);
  if (!window.ok()) {
    return Refusal{
        Status::Unavailable(fmt::format("the server cannot make this client's window: {}",
                                        window.status().ToString())),
        "no_window"};
  }
  c.window = std::move(window).value();
  reply->arena_bytes = c.window->bytes();
  reply->num_slots = c.window->num_slots();
  return std::nullopt;
}

std::optional<Server::Impl::Refusal> Server::Impl::AdmitLocked(const Connection& c) const {
  size_t live = 0, same_process = 0;
  for (auto& other : conns_) {
    live += !other->finished;
    same_process += !other->finished && other->peer_pid == c.peer_pid;
  }
  if (live >= options_.max_clients) {
    return Refusal{
        Status::Rejected(fmt::format("too many clients (limit {})", options_.max_clients)),
        "too_many_clients"};
  }
  if (const size_t per_process = ClientsPerProcess(); same_process >= per_process) {
    return Refusal{Status::Rejected(fmt::format("too many connections from process {} (limit "
                                                "{}, --max-clients-per-process)",
                                                c.peer_pid, per_process)),
                   "too_many_from_process"};
  }
  return std::nullopt;
}

}  // namespace kvtier::server
