#include "server/server.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>

#include "common/task_pool.h"
#include "server/codec.h"

namespace kvtier::server {

using Clock = std::chrono::steady_clock;

KeyNamespace ServerNamespace(uint64_t chunk_bytes) {
  KeyNamespace ns;
  ns.model_id = "kvtier-server/v1";
  ns.layout_fingerprint = chunk_bytes;
  ns.chunk_tokens = 1;
  return ns;
}

// SHA-256(ns_root || tag padded to 32 bytes || client key). The first 64 bytes are one SHA-256
// block, so its state is computed once per connection and copied for every key.
struct KeyDeriver::State {
  EVP_MD_CTX* prefix = EVP_MD_CTX_new();
  EVP_MD_CTX* work = EVP_MD_CTX_new();
  ~State() {
    EVP_MD_CTX_free(prefix);
    EVP_MD_CTX_free(work);
  }
};

KeyDeriver::KeyDeriver(const KeyNamespace& ns) : state_(std::make_unique<State>()) {
  uint8_t block[64] = {};
  std::memcpy(block, ns.Root().data(), 32);
  static constexpr char kTag[] = "kvtier/server-key/v1";
  std::memcpy(block + 32, kTag, sizeof(kTag) - 1);
  EVP_DigestInit_ex(state_->prefix, EVP_sha256(), nullptr);
  EVP_DigestUpdate(state_->prefix, block, sizeof(block));
}

KeyDeriver::~KeyDeriver() = default;

ChunkKey KeyDeriver::Derive(const ChunkKey& client_key) {
  EVP_MD_CTX_copy_ex(state_->work, state_->prefix);
  EVP_DigestUpdate(state_->work, client_key.data(), ChunkKey::kSize);
  std::array<uint8_t, 32> out;
  unsigned int len = 0;
  EVP_DigestFinal_ex(state_->work, out.data(), &len);
  return ChunkKey(out);
}

namespace {

// Sends all of `data`; false if the peer is gone or did not read within the send timeout.
bool SendAll(int fd, const uint8_t* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool SendWithFd(int fd, const std::vector<uint8_t>& frame, int pass_fd) {
  struct iovec iov {
    const_cast<uint8_t*>(frame.data()), frame.size()
  };
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  struct msghdr msg {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  struct cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &pass_fd, sizeof(int));
  ssize_t w;
  do {
    w = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
  } while (w < 0 && errno == EINTR);
  if (w < 0) return false;
  if (static_cast<size_t>(w) < frame.size()) {
    return SendAll(fd, frame.data() + w, frame.size() - static_cast<size_t>(w));
  }
  return true;
}

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  // 5 us .. ~10 s, x2.5 per bucket.
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 5e-6; v < 12; v *= 2.5) b.push_back(v);
  return b;
}

}  // namespace

// Prometheus metrics kept by the server itself; the engine's counters are read at scrape time.
struct Metrics {
  Metrics()
      : registry(std::make_shared<prometheus::Registry>()),
        requests(prometheus::BuildCounter()
                     .Name("kvtier_rpc_requests_total")
                     .Help("Protocol requests handled, by operation")
                     .Register(*registry)),
        rpc_latency(prometheus::BuildHistogram()
                        .Name("kvtier_rpc_latency_seconds")
                        .Help("Server-side handling time of a request, by operation")
                        .Register(*registry)),
        load_latency(prometheus::BuildHistogram()
                         .Name("kvtier_load_latency_seconds")
                         .Help("prepare_load: request received to chunks pinned and answered")
                         .Register(*registry)
                         .Add({}, LatencyBuckets())),
        store_latency(prometheus::BuildHistogram()
                          .Name("kvtier_store_latency_seconds")
                          .Help("Store: slots reserved to slots committed (includes the "
                                "client's copy)")
                          .Register(*registry)
                          .Add({}, LatencyBuckets())),
        connected(prometheus::BuildGauge()
                      .Name("kvtier_connected_clients")
                      .Help("Client connections open now")
                      .Register(*registry)
                      .Add({})),
        connections(prometheus::BuildCounter()
                        .Name("kvtier_connections_total")
                        .Help("Client connections accepted")
                        .Register(*registry)
                        .Add({})),
        refused(prometheus::BuildCounter()
                    .Name("kvtier_handshakes_refused_total")
                    .Help("Handshakes refused, by reason")
                    .Register(*registry)),
        protocol_errors(prometheus::BuildCounter()
                            .Name("kvtier_protocol_errors_total")
                            .Help("Connections closed for a malformed, oversized or "
                                  "out-of-order message")
                            .Register(*registry)
                            .Add({})),
        request_errors(prometheus::BuildCounter()
                           .Name("kvtier_request_errors_total")
                           .Help("Requests answered with an error (connection kept)")
                           .Register(*registry)
                           .Add({})),
        released_on_disconnect(prometheus::BuildCounter()
                                   .Name("kvtier_released_on_disconnect_total")
                                   .Help("Pins and reservations released because their "
                                         "connection closed")
                                   .Register(*registry)
                                   .Add({})) {
    for (uint16_t op = 1; op <= kMaxOpcode; ++op) {
      std::string name(OpcodeName(op));
      op_requests[op] = &requests.Add({{"op", name}});
      op_latency[op] = &rpc_latency.Add({{"op", name}}, LatencyBuckets());
    }
    for (const char* reason : {"version", "token", "namespace", "chunk_size", "draining",
                               "too_many_clients"}) {
      refused_by[reason] = &refused.Add({{"reason", reason}});
    }
  }

  std::shared_ptr<prometheus::Registry> registry;
  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Family<prometheus::Histogram>& rpc_latency;
  prometheus::Histogram& load_latency;
  prometheus::Histogram& store_latency;
  prometheus::Gauge& connected;
  prometheus::Counter& connections;
  prometheus::Family<prometheus::Counter>& refused;
  prometheus::Counter& protocol_errors;
  prometheus::Counter& request_errors;
  prometheus::Counter& released_on_disconnect;
  prometheus::Counter* op_requests[kMaxOpcode + 1] = {};
  prometheus::Histogram* op_latency[kMaxOpcode + 1] = {};
  std::unordered_map<std::string, prometheus::Counter*> refused_by;
};

// One client connection. State below `mu` is shared between the connection's thread and the
// completion pool (slow prepare_loads); replies are sent under `mu` too, so frames never
// interleave and nothing is sent once `closed` is set.
struct Connection {
  uint64_t id = 0;
  int fd = -1;
  pid_t peer_pid = 0;
  uid_t peer_uid = 0;
  std::string name;
  KeyNamespace ns;
  std::unique_ptr<KeyDeriver> deriver;  // connection thread only
  std::thread thread;
  std::atomic<bool> finished{false};

  std::mutex mu;
  bool closed = false;
  bool handshaken = false;
  struct Reservation {
    ChunkKey key;
    Clock::time_point since;
  };
  std::unordered_map<SlotId, Reservation> reservations;
  std::unordered_map<SlotId, uint32_t> pins;

  // REQUIRES: mu held.
  bool SendLocked(const std::vector<uint8_t>& frame) {
    if (closed) return false;
    if (!SendAll(fd, frame.data(), frame.size())) {
      ::shutdown(fd, SHUT_RDWR);  // the connection thread sees EOF and cleans up
      return false;
    }
    return true;
  }
};

class Server::Impl {
 public:
  explicit Impl(const ServerOptions& o) : options_(o) {}
  ~Impl() {
    Stop();
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  Status Init();
  void Stop();
  void Wait() {
    std::unique_lock lock(stop_mu_);
    stop_cv_.wait(lock, [this] { return stopped_; });
  }
  std::string StatsJson() const;
  std::string MetricsText() const;

  ServerOptions options_;
  std::unique_ptr<Engine> engine_;
  int http_port_ = -1;

 private:
  Status CheckSocketPath();
  Status BindSocket();
  Status StartHttp();
  void AcceptLoop();
  void ReapFinished(bool all);
  void Serve(std::shared_ptr<Connection> conn);
  // Reads one frame into conn's buffer; returns false on EOF, error or a protocol violation
  // (after replying).
  bool ReadFrame(Connection& c, std::vector<uint8_t>& buf, size_t& begin, size_t& end,
                 FrameHeader* header, std::span<const uint8_t>* body);
  // Handles one request; false closes the connection.
  bool Handle(const std::shared_ptr<Connection>& conn, const FrameHeader& h,
              std::span<const uint8_t> body);
  bool HandleHello(Connection& c, const FrameHeader& h, std::span<const uint8_t> body);
  void FinishPrepareLoad(const std::shared_ptr<Connection>& conn, uint64_t request_id,
                         Clock::time_point started, const OpResult& r);
  void Release(Connection& c);
  void Refuse(Connection& c, const FrameHeader& h, const Status& s, const char* reason);
  void ProtocolError(Connection& c, const FrameHeader& h, const Status& s);

  Metrics metrics_;
  std::unique_ptr<TaskPool> completions_;
  int listen_fd_ = -1;
  bool socket_bound_ = false;  // we created the socket file (and so may remove it)
  int wake_fd_ = -1;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> next_id_{1};

  mutable std::mutex conns_mu_;
  std::list<std::shared_ptr<Connection>> conns_;

  std::unique_ptr<httplib::Server> http_;
  std::thread http_thread_;

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_started_ = false;
  bool stopped_ = false;
  Clock::time_point started_at_ = Clock::now();
};

Status Server::Impl::Init() {
  if (options_.socket_path.empty()) return Status::InvalidArgument("server: socket path is empty");
  if (options_.max_clients < 1) return Status::InvalidArgument("server: max_clients must be >= 1");
  if (options_.max_message_bytes < 1024 || options_.max_message_bytes > (64u << 20)) {
    return Status::InvalidArgument("server: max_message_bytes must be in [1 KiB, 64 MiB]");
  }
  if (options_.max_keys_per_request < 1 ||
      options_.max_keys_per_request * 32ull + 64 > options_.max_message_bytes) {
    return Status::InvalidArgument(
        "server: max_keys_per_request must be >= 1 and fit in max_message_bytes");
  }
  if (options_.completion_threads < 1 || options_.completion_threads > 64) {
    return Status::InvalidArgument("server: completion_threads must be in [1, 64]");
  }
  // Refuse a socket path in use before allocating the pool.
  KVTIER_RETURN_IF_ERROR(CheckSocketPath());
  EngineOptions eo = options_.engine;
  eo.ns = ServerNamespace(eo.chunk_bytes);
  auto engine = Engine::Open(eo);
  if (!engine.ok()) return engine.status();
  engine_ = std::move(engine).value();
  completions_ = std::make_unique<TaskPool>(options_.completion_threads, 1u << 16,
                                            "prepare_load completions");
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return Status::FromErrno(errno, "eventfd");
  KVTIER_RETURN_IF_ERROR(BindSocket());
  Status http = StartHttp();
  if (!http.ok()) return http;  // the destructor removes the socket file
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return Status::Ok();
}

namespace {
Result<sockaddr_un> SocketAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(fmt::format(
        "socket path \"{}\" is too long ({} bytes, at most {})", path, path.size(),
        sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}
}  // namespace

// A live server at the path is an error; a stale socket file (its server died) is removed.
Status Server::Impl::CheckSocketPath() {
  const std::string& path = options_.socket_path;
  KVTIER_ASSIGN_OR_RETURN(sockaddr_un addr, SocketAddress(path));
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

Status Server::Impl::BindSocket() {
  const std::string& path = options_.socket_path;
  KVTIER_RETURN_IF_ERROR(CheckSocketPath());
  KVTIER_ASSIGN_OR_RETURN(sockaddr_un addr, SocketAddress(path));

  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return Status::FromErrno(errno, "socket");
  gid_t gid = static_cast<gid_t>(-1);
  if (!options_.socket_group.empty()) {
    struct group* g = ::getgrnam(options_.socket_group.c_str());
    if (!g) {
      return Status::InvalidArgument(fmt::format("unknown socket group \"{}\"",
                                                 options_.socket_group));
    }
    gid = g->gr_gid;
  }
  // Created owner-only from the start (no window with wider permissions); widened to the group
  // afterwards if asked.
  mode_t old = ::umask(0177);
  int rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  ::umask(old);
  if (rc != 0) return Status::FromErrno(err, fmt::format("binding socket \"{}\"", path));
  socket_bound_ = true;
  if (gid != static_cast<gid_t>(-1)) {
    if (::chown(path.c_str(), static_cast<uid_t>(-1), gid) != 0 || ::chmod(path.c_str(), 0660)) {
      Status s = Status::FromErrno(errno, fmt::format("giving socket \"{}\" to group \"{}\"", path,
                                                      options_.socket_group));
      ::unlink(path.c_str());
      return s;
    }
  }
  if (::listen(listen_fd_, 128) != 0) {
    Status s = Status::FromErrno(errno, "listen");
    ::unlink(path.c_str());
    return s;
  }
  return Status::Ok();
}

Status Server::Impl::StartHttp() {
  if (options_.http_port < 0) return Status::Ok();
  http_ = std::make_unique<httplib::Server>();
  http_->new_task_queue = [] { return new httplib::ThreadPool(2); };
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(MetricsText(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http_->Get("/healthz", [this](const httplib::Request&, httplib::Response& res) {
    if (stopping_) {
      res.status = 503;
      res.set_content("draining\n", "text/plain");
    } else {
      res.set_content("ok\n", "text/plain");
    }
  });
  http_->Get("/stats", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(StatsJson(), "application/json");
  });
  if (options_.http_port == 0) {
    http_port_ = http_->bind_to_any_port(options_.http_host);
    if (http_port_ < 0) {
      return Status::Unavailable(
          fmt::format("cannot bind an HTTP port on \"{}\"", options_.http_host));
    }
  } else {
    if (!http_->bind_to_port(options_.http_host, options_.http_port)) {
      return Status::Unavailable(fmt::format(
          "cannot bind HTTP {}:{} (port in use, or host not a local address)", options_.http_host,
          options_.http_port));
    }
    http_port_ = options_.http_port;
  }
  http_thread_ = std::thread([this] { http_->listen_after_bind(); });
  return Status::Ok();
}

void Server::Impl::AcceptLoop() {
  while (!stopping_) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    int n = ::poll(fds, 2, 1000);
    ReapFinished(false);
    if (n <= 0 || stopping_) continue;
    if (!(fds[0].revents & POLLIN)) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    auto conn = std::make_shared<Connection>();
    conn->id = next_id_++;
    conn->fd = fd;
    struct ucred cred {};
    socklen_t len = sizeof(cred);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
      conn->peer_pid = cred.pid;
      conn->peer_uid = cred.uid;
    }
    struct timeval tv {};
    tv.tv_sec = options_.send_timeout.count() / 1000;
    tv.tv_usec = (options_.send_timeout.count() % 1000) * 1000;
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    metrics_.connections.Increment();
    std::lock_guard lock(conns_mu_);
    conns_.push_back(conn);
    conn->thread = std::thread([this, conn] { Serve(conn); });
  }
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

void Server::Impl::Refuse(Connection& c, const FrameHeader& h, const Status& s,
                          const char* reason) {
  spdlog::warn("refusing client {} (pid {}, \"{}\"): {}", c.id, c.peer_pid, c.name, s.ToString());
  metrics_.refused_by[reason]->Increment();
  std::lock_guard lock(c.mu);
  c.SendLocked(EncodeReply(h.opcode, h.request_id, s));
}

void Server::Impl::ProtocolError(Connection& c, const FrameHeader& h, const Status& s) {
  spdlog::warn("closing client {} (pid {}, \"{}\") after a protocol error: {}", c.id, c.peer_pid,
               c.name, s.ToString());
  metrics_.protocol_errors.Increment();
  std::lock_guard lock(c.mu);
  c.SendLocked(EncodeReply(h.opcode & ~kReplyBit, h.request_id, s));
}

bool Server::Impl::ReadFrame(Connection& c, std::vector<uint8_t>& buf, size_t& begin,
                             size_t& end, FrameHeader* header, std::span<const uint8_t>* body) {
  auto fill = [&](size_t need) -> bool {
    if (end - begin >= need) return true;
    if (begin > 0) {  // compact: the unread bytes go to the front
      std::memmove(buf.data(), buf.data() + begin, end - begin);
      end -= begin;
      begin = 0;
    }
    if (buf.size() < need) buf.resize(need);
    while (end < need) {
      ssize_t r = ::recv(c.fd, buf.data() + end, buf.size() - end, 0);
      if (r == 0) return false;
      if (r < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      end += static_cast<size_t>(r);
    }
    return true;
  };
  if (!fill(kHeaderBytes)) return false;
  *header = DecodeHeader(buf.data() + begin);
  Status s = CheckRequestHeader(*header, options_.max_message_bytes);
  if (!s.ok()) {
    // Oversized lengths are never read: the connection is closed right away.
    ProtocolError(c, *header, s);
    return false;
  }
  if (!fill(kHeaderBytes + header->body_length)) return false;
  *body = std::span<const uint8_t>(buf.data() + begin + kHeaderBytes, header->body_length);
  begin += kHeaderBytes + header->body_length;
  return true;
}

void Server::Impl::Serve(std::shared_ptr<Connection> conn) {
  Connection& c = *conn;
  std::vector<uint8_t> buf(64 * 1024);
  size_t begin = 0, end = 0;
  FrameHeader h;
  std::span<const uint8_t> body;
  while (ReadFrame(c, buf, begin, end, &h, &body)) {
    if (!Handle(conn, h, body)) break;
  }
  Release(c);
  c.finished = true;
}

void Server::Impl::Release(Connection& c) {
  std::vector<SlotId> reserved, pinned;
  bool was_handshaken;
  {
    std::lock_guard lock(c.mu);
    c.closed = true;
    was_handshaken = c.handshaken;
    for (auto& [slot, r] : c.reservations) reserved.push_back(slot);
    for (auto& [slot, n] : c.pins) {
      for (uint32_t i = 0; i < n; ++i) pinned.push_back(slot);
    }
    c.reservations.clear();
    c.pins.clear();
    ::close(c.fd);
    c.fd = -1;
  }
  engine_->AbortSlots(reserved);
  engine_->Unpin(pinned);
  if (was_handshaken) metrics_.connected.Decrement();
  if (!reserved.empty() || !pinned.empty()) {
    metrics_.released_on_disconnect.Increment(static_cast<double>(reserved.size() + pinned.size()));
    spdlog::info("client {} (pid {}, \"{}\") disconnected holding {} reservations and {} pins: "
                 "released",
                 c.id, c.peer_pid, c.name, reserved.size(), pinned.size());
  } else {
    spdlog::debug("client {} disconnected", c.id);
  }
}

bool Server::Impl::HandleHello(Connection& c, const FrameHeader& h,
                               std::span<const uint8_t> body) {
  auto hello = DecodeHelloRequest(body);
  if (!hello.ok()) {
    if (hello.status().code() == StatusCode::kUnimplemented) {
      Refuse(c, h, hello.status(), "version");
    } else {
      ProtocolError(c, h, hello.status());
    }
    return false;
  }
  c.name = hello->client_name;
  if (hello->version != kProtocolVersion) {
    Refuse(c, h,
           Status::Unimplemented(fmt::format("protocol version {} not supported (server speaks {})",
                                             hello->version, kProtocolVersion)),
           "version");
    return false;
  }
  if (!options_.token.empty()) {
    const std::string& t = hello->token;
    bool match = t.size() == options_.token.size() &&
                 CRYPTO_memcmp(t.data(), options_.token.data(), t.size()) == 0;
    if (!match) {
      Refuse(c, h, Status::PermissionDenied("wrong or missing token"), "token");
      return false;
    }
  }
  Status ns = hello->ns.Validate();
  if (!ns.ok()) {
    Refuse(c, h, ns.WithContext("namespace refused"), "namespace");
    return false;
  }
  const uint64_t pool_chunk = engine_->options().chunk_bytes;
  if (hello->chunk_bytes != 0 && hello->chunk_bytes != pool_chunk) {
    Refuse(c, h,
           Status::InvalidArgument(fmt::format(
               "layout mismatch: a chunk of this client is {} bytes ({} tokens), but this server's "
               "pool holds {}-byte chunks; start a server for this model/layout (--model, "
               "--chunk-size, --chunk-bytes)",
               hello->chunk_bytes, hello->ns.chunk_tokens, pool_chunk)),
           "chunk_size");
    return false;
  }
  if (stopping_) {
    Refuse(c, h, Status::Unavailable("server is draining (shutting down)"), "draining");
    return false;
  }
  {
    std::lock_guard lock(conns_mu_);
    size_t live = 0;
    for (auto& other : conns_) live += !other->finished;
    if (live > options_.max_clients) {
      Refuse(c, h,
             Status::Rejected(fmt::format("too many clients (limit {})", options_.max_clients)),
             "too_many_clients");
      return false;
    }
  }
  c.ns = hello->ns;
  c.deriver = std::make_unique<KeyDeriver>(c.ns);
  MemoryTier& mem = engine_->memory_tier();
  HelloReply reply;
  reply.session_id = c.id;
  reply.arena_bytes = mem.arena_bytes();
  reply.slot_bytes = mem.slot_bytes();
  reply.chunk_bytes = mem.chunk_bytes();
  reply.num_slots = mem.num_slots();
  reply.max_keys_per_request = options_.max_keys_per_request;
  reply.max_message_bytes = options_.max_message_bytes;
  reply.server_version = KVTIER_VERSION;
  auto frame = EncodeReply(h.opcode, h.request_id, Status::Ok(), HelloReplyFields(reply));
  std::lock_guard lock(c.mu);
  if (!SendWithFd(c.fd, frame, mem.fd())) return false;
  c.handshaken = true;
  metrics_.connected.Increment();
  spdlog::info("client {} connected: pid {}, uid {}, \"{}\", model \"{}\" rank {}/{}", c.id,
               c.peer_pid, c.peer_uid, c.name, c.ns.model_id, c.ns.rank, c.ns.world_size);
  return true;
}

bool Server::Impl::Handle(const std::shared_ptr<Connection>& conn, const FrameHeader& h,
                          std::span<const uint8_t> body) {
  Connection& c = *conn;
  const auto started = Clock::now();
  const auto op = static_cast<Opcode>(h.opcode);
  if (!c.handshaken) {
    if (op != Opcode::kHello) {
      ProtocolError(c, h, Status::InvalidArgument("the first message must be hello"));
      return false;
    }
    return HandleHello(c, h, body);
  }
  if (op == Opcode::kHello) {
    ProtocolError(c, h, Status::InvalidArgument("hello sent twice"));
    return false;
  }
  const uint32_t max_keys = options_.max_keys_per_request;
  auto derive = [&](const std::vector<ChunkKey>& keys) {
    std::vector<ChunkKey> out;
    out.reserve(keys.size());
    for (const ChunkKey& k : keys) out.push_back(c.deriver->Derive(k));
    return out;
  };
  auto reply = [&](const Status& s, std::span<const uint8_t> fields = {}) {
    if (!s.ok()) metrics_.request_errors.Increment();
    std::lock_guard lock(c.mu);
    return c.SendLocked(EncodeReply(h.opcode, h.request_id, s, fields));
  };
  bool keep = true;
  switch (op) {
    case Opcode::kLookup: {
      auto keys = DecodeKeysRequest(body, max_keys);
      if (!keys.ok()) {
        ProtocolError(c, h, keys.status());
        return false;
      }
      LookupResult r = engine_->Lookup(derive(*keys));
      keep = reply(Status::Ok(), LookupReplyFields({static_cast<uint32_t>(r.total),
                                                    static_cast<uint32_t>(r.memory)}));
      break;
    }
    case Opcode::kReserve: {
      auto keys = DecodeKeysRequest(body, max_keys);
      if (!keys.ok()) {
        ProtocolError(c, h, keys.status());
        return false;
      }
      auto derived = derive(*keys);
      std::vector<SlotId> slots = engine_->ReserveSlots(derived);
      std::lock_guard lock(c.mu);
      for (size_t i = 0; i < slots.size(); ++i) {
        if (slots[i] != kNoSlot) c.reservations[slots[i]] = {derived[i], started};
      }
      keep = c.SendLocked(EncodeReply(h.opcode, h.request_id, Status::Ok(),
                                      SlotsReplyFields(slots)));
      break;
    }
    case Opcode::kCommit:
    case Opcode::kAbort: {
      auto slots = DecodeSlotsRequest(body, max_keys);
      if (!slots.ok()) {
        ProtocolError(c, h, slots.status());
        return false;
      }
      std::vector<ChunkKey> keys;
      std::vector<SlotId> valid;
      Status bad;
      Clock::time_point oldest = started;
      {
        std::lock_guard lock(c.mu);
        std::unordered_set<SlotId> seen;
        for (SlotId s : *slots) {
          if (s == kNoSlot) continue;
          auto it = c.reservations.find(s);
          if (it == c.reservations.end() || !seen.insert(s).second) {
            bad = Status::InvalidArgument(
                fmt::format("slot {} is not reserved by this connection", s));
            break;
          }
          keys.push_back(it->second.key);
          valid.push_back(s);
          oldest = std::min(oldest, it->second.since);
        }
        if (bad.ok()) {
          for (SlotId s : valid) c.reservations.erase(s);
        }
      }
      if (!bad.ok()) {
        keep = reply(bad);
        break;
      }
      if (op == Opcode::kCommit) {
        engine_->CommitSlots(keys, valid);
        if (!valid.empty()) {
          metrics_.store_latency.Observe(
              std::chrono::duration<double>(Clock::now() - oldest).count());
        }
        keep = reply(Status::Ok(), U32ReplyFields(static_cast<uint32_t>(valid.size())));
      } else {
        engine_->AbortSlots(valid);
        keep = reply(Status::Ok());
      }
      break;
    }
    case Opcode::kPrepareLoad: {
      auto keys = DecodeKeysRequest(body, max_keys);
      if (!keys.ok()) {
        ProtocolError(c, h, keys.status());
        return false;
      }
      auto handle = engine_->PrepareLoad(derive(*keys));
      if (!handle.ok()) {
        keep = reply(handle.status());
        break;
      }
      if (handle->Done()) {
        FinishPrepareLoad(conn, h.request_id, started, handle->Wait());
      } else {
        // A promotion from the file tier is under way: answer when it is done, without holding
        // up this connection's other requests.
        OpHandle op_handle = *handle;
        Status queued = completions_->TrySubmit([this, conn, op_handle, id = h.request_id,
                                                 started] {
          FinishPrepareLoad(conn, id, started, op_handle.Wait());
        });
        if (!queued.ok()) FinishPrepareLoad(conn, h.request_id, started, op_handle.Wait());
      }
      break;
    }
    case Opcode::kRelease: {
      auto slots = DecodeSlotsRequest(body, max_keys);
      if (!slots.ok()) {
        ProtocolError(c, h, slots.status());
        return false;
      }
      Status bad;
      {
        std::lock_guard lock(c.mu);
        std::unordered_map<SlotId, uint32_t> want;
        for (SlotId s : *slots) want[s]++;
        for (auto& [s, n] : want) {
          auto it = c.pins.find(s);
          if (it == c.pins.end() || it->second < n) {
            bad = Status::InvalidArgument(
                fmt::format("slot {} is not pinned by this connection ({} releases asked)", s, n));
            break;
          }
        }
        if (bad.ok()) {
          for (auto& [s, n] : want) {
            auto it = c.pins.find(s);
            if ((it->second -= n) == 0) c.pins.erase(it);
          }
        }
      }
      if (bad.ok()) engine_->Unpin(*slots);
      keep = reply(bad);
      break;
    }
    case Opcode::kStats: {
      Status s = DecodeEmptyRequest(body);
      if (!s.ok()) {
        ProtocolError(c, h, s);
        return false;
      }
      keep = reply(Status::Ok(), TextReplyFields(StatsJson()));
      break;
    }
    case Opcode::kPing: {
      Status s = DecodeEmptyRequest(body);
      if (!s.ok()) {
        ProtocolError(c, h, s);
        return false;
      }
      keep = reply(Status::Ok());
      break;
    }
    case Opcode::kHello:
      break;
  }
  metrics_.op_requests[h.opcode]->Increment();
  metrics_.op_latency[h.opcode]->Observe(
      std::chrono::duration<double>(Clock::now() - started).count());
  return keep;
}

void Server::Impl::FinishPrepareLoad(const std::shared_ptr<Connection>& conn,
                                     uint64_t request_id, Clock::time_point started,
                                     const OpResult& r) {
  Connection& c = *conn;
  const uint16_t opcode = static_cast<uint16_t>(Opcode::kPrepareLoad);
  std::vector<uint8_t> frame;
  if (r.slots.empty() && !r.status.ok() && !r.status.IsNotFound()) {
    frame = EncodeReply(opcode, request_id, r.status);
  } else {
    PrepareLoadReply p;
    p.chunks = static_cast<uint32_t>(r.slots.size());
    p.slots = r.slots;
    frame = EncodeReply(opcode, request_id, Status::Ok(), PrepareLoadReplyFields(p));
  }
  bool unpin_now = false;
  {
    std::lock_guard lock(c.mu);
    if (c.closed) {
      unpin_now = true;  // the client is gone: nobody will release these pins
    } else {
      for (SlotId s : r.slots) c.pins[s]++;
      // If the reply does not reach the client, the connection thread releases c.pins at close.
      c.SendLocked(frame);
    }
  }
  if (unpin_now) engine_->Unpin(r.slots);
  metrics_.load_latency.Observe(std::chrono::duration<double>(Clock::now() - started).count());
}

void Server::Impl::Stop() {
  {
    std::lock_guard lock(stop_mu_);
    if (stop_started_) {
      return;
    }
    stop_started_ = true;
  }
  const bool was_serving = accept_thread_.joinable();
  if (was_serving) spdlog::info("draining: closing the socket and every client connection");
  stopping_ = true;
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(wake_fd_, &one, sizeof(one));
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
  if (socket_bound_) ::unlink(options_.socket_path.c_str());
  {
    std::lock_guard lock(conns_mu_);
    for (auto& c : conns_) {
      std::lock_guard conn_lock(c->mu);
      if (!c->closed) ::shutdown(c->fd, SHUT_RDWR);
    }
  }
  ReapFinished(true);
  if (completions_) completions_->Drain();
  if (engine_ && was_serving) {
    spdlog::info("draining: waiting for queued engine work (write policy {})",
                 WritePolicyName(engine_->options().write_policy));
    if (engine_->options().write_policy == WritePolicy::kWriteBack && engine_->file_tier()) {
      // Write-back keeps dirty chunks only in L1, which dies with the process: write them down.
      Status flushed = engine_->FlushDirty();
      if (!flushed.ok()) spdlog::error("draining: writing back dirty chunks: {}", flushed.ToString());
    }
    engine_->Drain();
  }
  if (http_) {
    http_->stop();
    if (http_thread_.joinable()) http_thread_.join();
  }
  if (was_serving) spdlog::info("drained");
  std::lock_guard lock(stop_mu_);
  stopped_ = true;
  stop_cv_.notify_all();
}

std::string Server::Impl::StatsJson() const {
  EngineStats st = engine_->Stats();
  const MemoryTierStats& m = st.memory_detail;
  nlohmann::json j;
  j["version"] = KVTIER_VERSION;
  j["protocol_version"] = kProtocolVersion;
  j["uptime_s"] = std::chrono::duration<double>(Clock::now() - started_at_).count();
  j["draining"] = stopping_.load();
  j["socket"] = options_.socket_path;
  j["write_policy"] = WritePolicyName(engine_->options().write_policy);
  j["pool"] = {{"capacity_bytes", m.capacity_bytes}, {"slot_bytes", m.slot_bytes},
               {"chunk_bytes", engine_->options().chunk_bytes}, {"num_slots", m.num_slots},
               {"resident", m.resident}, {"pinned", m.pinned}, {"huge_pages", m.huge_pages},
               {"eviction_policy", EvictionPolicyName(engine_->options().memory.eviction)}};
  auto tier = [](const TierCounters& t) {
    return nlohmann::json{{"lookups", t.lookups},     {"hits", t.hits},
                          {"misses", t.misses},       {"bytes_written", t.bytes_in},
                          {"bytes_read", t.bytes_out}, {"evictions", t.evictions},
                          {"rejections", t.rejections}, {"errors", t.errors}};
  };
  j["tiers"]["memory"] = tier(st.memory);
  j["engine"] = {{"stores", st.stores}, {"loads", st.loads}, {"rejected_ops", st.rejected_ops}};
  if (st.has_file) {
    const FileTierStats& f = st.file_detail;
    j["tiers"]["file"] = tier(st.file);
    j["tiers"]["file"]["path"] = engine_->options().file->root;
    j["tiers"]["file"]["chunks"] = f.chunks;
    j["tiers"]["file"]["bytes"] = f.bytes;
    j["tiers"]["file"]["capacity_bytes"] = f.capacity_bytes;
    j["tiers"]["file"]["o_direct"] = f.o_direct;
    j["tiers"]["file"]["io_engine"] = f.io_engine;
    j["tiers"]["file"]["corrupt"] = f.corrupt;
    j["tiers"]["file"]["queued_writes"] = f.queued_writes;
    j["engine"]["promotions"] = st.promotions;
    j["engine"]["deadline_misses"] = st.deadline_misses;
  }
  nlohmann::json clients = nlohmann::json::array();
  {
    std::lock_guard lock(conns_mu_);
    for (auto& c : conns_) {
      std::lock_guard conn_lock(c->mu);
      if (c->closed || !c->handshaken) continue;
      size_t pins = 0;
      for (auto& [s, n] : c->pins) pins += n;
      clients.push_back({{"id", c->id},
                         {"pid", c->peer_pid},
                         {"name", c->name},
                         {"model_id", c->ns.model_id},
                         {"rank", c->ns.rank},
                         {"world_size", c->ns.world_size},
                         {"pins", pins},
                         {"reservations", c->reservations.size()}});
    }
  }
  j["clients"] = std::move(clients);
  return j.dump(2) + "\n";
}

std::string Server::Impl::MetricsText() const {
  std::vector<prometheus::MetricFamily> families = metrics_.registry->Collect();
  EngineStats st = engine_->Stats();
  using prometheus::ClientMetric;
  using prometheus::MetricFamily;
  using prometheus::MetricType;
  auto counter = [&](const char* name, const char* help,
                     std::vector<std::pair<std::string, double>> per_tier) {
    MetricFamily f{name, help, MetricType::Counter, {}};
    for (auto& [tier, v] : per_tier) {
      ClientMetric m;
      m.label.push_back({"tier", tier});
      m.counter.value = v;
      f.metric.push_back(std::move(m));
    }
    families.push_back(std::move(f));
  };
  auto d = [](uint64_t v) { return static_cast<double>(v); };
  auto tiers = [&](auto field) {
    std::vector<std::pair<std::string, double>> v{{"memory", d(field(st.memory))}};
    if (st.has_file) v.emplace_back("file", d(field(st.file)));
    return v;
  };
  counter("kvtier_lookups_total", "Lookups per tier",
          tiers([](const TierCounters& t) { return t.lookups; }));
  counter("kvtier_hits_total", "Chunks found per tier",
          tiers([](const TierCounters& t) { return t.hits; }));
  counter("kvtier_misses_total", "Chunks not found per tier",
          tiers([](const TierCounters& t) { return t.misses; }));
  counter("kvtier_bytes_written_total", "Chunk bytes written into each tier",
          tiers([](const TierCounters& t) { return t.bytes_in; }));
  counter("kvtier_bytes_read_total", "Chunk bytes read out of each tier",
          tiers([](const TierCounters& t) { return t.bytes_out; }));
  counter("kvtier_evictions_total", "Chunks evicted per tier",
          tiers([](const TierCounters& t) { return t.evictions; }));
  counter("kvtier_rejections_total", "Operations refused (pool or queue full) per tier",
          tiers([](const TierCounters& t) { return t.rejections; }));
  counter("kvtier_errors_total", "Errors per tier",
          tiers([](const TierCounters& t) { return t.errors; }));
  {
    MetricFamily f{"kvtier_engine_ops_total", "Engine operations", MetricType::Counter, {}};
    for (auto [name, v] : {std::pair{"store", st.stores}, std::pair{"load", st.loads},
                           std::pair{"rejected", st.rejected_ops},
                           std::pair{"promotion", st.promotions},
                           std::pair{"deadline_miss", st.deadline_misses}}) {
      ClientMetric m;
      m.label.push_back({"op", name});
      m.counter.value = d(v);
      f.metric.push_back(std::move(m));
    }
    families.push_back(std::move(f));
  }
  auto gauge = [&](const char* name, const char* help,
                   std::vector<std::pair<std::string, double>> by_state, const char* label) {
    MetricFamily f{name, help, MetricType::Gauge, {}};
    for (auto& [k, v] : by_state) {
      ClientMetric m;
      if (label) m.label.push_back({label, k});
      m.gauge.value = v;
      f.metric.push_back(std::move(m));
    }
    families.push_back(std::move(f));
  };
  const MemoryTierStats& m = st.memory_detail;
  gauge("kvtier_pool_slots", "L1 pool slots by state",
        {{"total", m.num_slots}, {"resident", m.resident}, {"pinned", m.pinned}}, "state");
  gauge("kvtier_pool_bytes", "L1 pool bytes",
        {{"capacity", d(m.capacity_bytes)},
         {"used", d(static_cast<uint64_t>(m.resident) * m.slot_bytes)}},
        "kind");
  if (st.has_file) {
    gauge("kvtier_file_tier_bytes", "File tier bytes",
          {{"used", d(st.file_detail.bytes)}, {"capacity", d(st.file_detail.capacity_bytes)}},
          "kind");
    gauge("kvtier_file_tier_queued", "File tier operations queued now",
          {{"read", d(st.file_detail.queued_reads)}, {"write", d(st.file_detail.queued_writes)}},
          "op");
  }
  return prometheus::TextSerializer().Serialize(families);
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

Result<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  Status s = impl->Init();
  if (!s.ok()) return s;
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

void Server::Stop() { impl_->Stop(); }
void Server::Wait() { impl_->Wait(); }
int Server::http_port() const { return impl_->http_port_; }
const std::string& Server::socket_path() const { return impl_->options_.socket_path; }
std::string Server::StatsJson() const { return impl_->StatsJson(); }
std::string Server::MetricsText() const { return impl_->MetricsText(); }
Engine& Server::engine() { return *impl_->engine_; }

}  // namespace kvtier::server
