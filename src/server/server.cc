// Server lifecycle: options checked, the engine opened, socket and HTTP bound, and the drain.
// The rest of the server: see server_impl.h for which file holds what.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <thread>

#include "server/server_impl.h"
#include "server/socket.h"

namespace kvtier::server {

Server::Impl::~Impl() {
  Stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

namespace {
bool IsListenAddress(const std::string& host) {
  if (host == "localhost") return true;
  in6_addr a6;
  in_addr a4;
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}
}  // namespace

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
  if (options_.http_threads < 1 || options_.http_threads > 256) {
    return Status::InvalidArgument("server: http_threads must be in [1, 256]");
  }
  if (options_.http_port >= 0 && !IsListenAddress(options_.http_host)) {
    // A name would be resolved (a DNS wait at start-up, or an address of another host).
    return Status::InvalidArgument(fmt::format(
        "server: HTTP host \"{}\" is not an address: give a numeric IPv4 or IPv6 address of this "
        "host (127.0.0.1, ::1, 0.0.0.0 for every interface) or localhost",
        options_.http_host));
  }
  if (options_.max_pending_handshakes < 1) {
    return Status::InvalidArgument("server: max_pending_handshakes must be >= 1");
  }
  if (options_.hello_timeout.count() < 1 || options_.send_timeout.count() < 1) {
    return Status::InvalidArgument("server: hello_timeout and send_timeout must be positive");
  }
  if (options_.max_output_bytes < options_.max_message_bytes) {
    return Status::InvalidArgument("server: max_output_bytes must be >= max_message_bytes");
  }
  if (!options_.tenant_tokens.empty()) {
    if (!options_.isolate_clients) {
      return Status::InvalidArgument(
          "server: tenant tokens need isolate_clients (with the shared pool every client can "
          "read and write every chunk: there are no tenants to tell apart)");
    }
    if (!options_.token.empty()) {
      return Status::InvalidArgument(
          "server: a shared token and tenant tokens exclude each other (with tenant tokens a "
          "client presents its tenant's token)");
    }
    KVTIER_ASSIGN_OR_RETURN(tenant_tokens_, TenantTokens::Make(options_.tenant_tokens));
  }
  // Refuse a socket path in use before allocating the pool.
  KVTIER_RETURN_IF_ERROR(CheckSocketPath(options_.socket_path));
  EngineOptions eo = options_.engine;
  eo.ns = ServerNamespace(eo.chunk_bytes);
  if (options_.kv_events) {
    if (options_.isolate_clients && !options_.kv_events_options.endpoint.empty()) {
      return Status::InvalidArgument(
          "server: --kv-events-endpoint is refused with --isolate-clients: one stream would "
          "carry every tenant's prefixes");
    }
    // Before the engine: a bad endpoint fails the start at once, and the tiers get it as their
    // listener. (A kvtier built without libzmq refuses here, saying so.)
    KVTIER_ASSIGN_OR_RETURN(events_, events::Publisher::Start(options_.kv_events_options));
    eo.memory.listener = events_;
    if (eo.file) eo.file->listener = events_;
  }
  auto engine = Engine::Open(eo);
  if (!engine.ok()) return engine.status();
  engine_ = std::move(engine).value();
  if (events_ && engine_->has_file_tier()) {
    // Files the tier found and this process did not store (another host's; all of them after a
    // restart) are announced from their headers. The publisher stops before the engine goes.
    events_->SetDescriptorReader(
        [engine = engine_.get()](const ChunkKey& k) { return engine->ReadChunkDescriptor(k); });
  }
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return Status::FromErrno(errno, "eventfd");
  KVTIER_RETURN_IF_ERROR(pump_.Start());
  KVTIER_ASSIGN_OR_RETURN(listen_fd_,
                          ListenOnSocketPath(options_.socket_path, options_.socket_group));
  socket_bound_ = true;
  if (options_.http_port >= 0) {
    HttpRoutes routes{[this] { return MetricsText(); }, [this] { return stopping_.load(); },
                      [this] { return StatsJson(StatsView::kHttp); }};
    // On failure the destructor removes the socket file.
    KVTIER_ASSIGN_OR_RETURN(http_, HttpListener::Start(options_.http_host, options_.http_port,
                                                       options_.http_threads, std::move(routes)));
  }
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return Status::Ok();
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
      std::lock_guard out_lock(c->out_mu);
      if (!c->out_closed) ::shutdown(c->fd, SHUT_RDWR);
    }
  }
  ReapFinished(true);
  {
    std::unique_lock lock(completion_gate_->mu);  // waits for replies being sent
    completion_gate_->open = false;
  }
  pump_.Stop();
  if (engine_ && was_serving) {
    spdlog::info("draining: waiting for queued engine work (write policy {})",
                 WritePolicyName(engine_->options().write_policy));
    if (engine_->options().write_policy == WritePolicy::kWriteBack && engine_->has_file_tier()) {
      // Write-back keeps dirty chunks only in L1, which dies with the process: write them down.
      Status flushed = engine_->FlushDirty();
      if (!flushed.ok())
        spdlog::error("draining: writing back dirty chunks: {}", flushed.ToString());
    }
    engine_->Drain();
  }
  if (events_) events_->Stop();  // after the drain: its evictions and writes are announced
  if (http_) http_->Stop();      // last: /healthz answers "draining" until the drain is done
  if (was_serving) spdlog::info("drained");
  std::lock_guard lock(stop_mu_);
  stopped_ = true;
  stop_cv_.notify_all();
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

Result<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  Status s;
  try {
    s = impl->Init();
  } catch (const std::system_error& e) {
    // Out of threads (a task limit, memory) while starting the engine's, the door's or the output
    // pump's: a start that fails with a message, not an abort.
    s = Status::Unavailable(fmt::format(
        "the server cannot start its threads ({}); raise the task limit or retry", e.what()));
  }
  if (!s.ok()) return s;
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

void Server::Stop() { impl_->Stop(); }
void Server::Wait() { impl_->Wait(); }
int Server::http_port() const { return impl_->http_port(); }
const std::string& Server::socket_path() const { return impl_->options_.socket_path; }
std::string Server::StatsJson() const { return impl_->StatsJson(); }
std::string Server::MetricsText() const { return impl_->MetricsText(); }
Engine& Server::engine() { return *impl_->engine_; }

}  // namespace kvtier::server
