#include "server/http_listener.h"

#include <cpp-httplib/httplib.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <chrono>
#include <system_error>

namespace kvtier::server {

namespace {
constexpr size_t kHttpQueuedConnections = 16;
constexpr size_t kHttpMaxBodyBytes = 4096;
}  // namespace

HttpListener::HttpListener() : http_(std::make_unique<httplib::Server>()) {}

HttpListener::~HttpListener() { Stop(); }

Result<std::unique_ptr<HttpListener>> HttpListener::Start(const std::string& host, int port,
                                                          int threads, HttpRoutes routes) {
  std::unique_ptr<HttpListener> l(new HttpListener());
  l->routes_ = std::move(routes);
  httplib::Server& http = *l->http_;
  // Every HTTP connection ties up a worker while it is read, so a slow one (a stalled scraper,
  // a half-sent request) must neither take all workers nor keep one long: several workers,
  // short read/write timeouts and a short keep-alive. /healthz then answers while a few slow
  // connections are open.
  // Every input is bounded: connections (the workers, and at most kHttpQueuedConnections
  // accepted and waiting for one; beyond that a connection is closed at once, so HTTP holds at
  // most that many descriptors and cannot starve the Unix socket's clients or the file tier),
  // the request line, header lines and their count (compile-time limits of the vendored
  // httplib, CMakeLists.txt), the body (no route takes one), and a range request at most one
  // range (an answer never larger than the document).
  const size_t workers = static_cast<size_t>(threads);
  l->workers_ = workers;
  http.new_task_queue = [workers] {
    return new httplib::ThreadPool(workers, workers, kHttpQueuedConnections);
  };
  http.set_payload_max_length(kHttpMaxBodyBytes);
  // httplib's default socket options add SO_REUSEPORT, with which a second server binds the
  // same port and the kernel splits connections between the two (a stopped server's /healthz
  // answered by a live one): SO_REUSEADDR only (a restart may still bind over TIME_WAIT).
  http.set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  http.set_read_timeout(std::chrono::seconds(2));
  http.set_write_timeout(std::chrono::seconds(2));
  http.set_keep_alive_timeout(2);
  http.set_keep_alive_max_count(100);
  const HttpRoutes* r = &l->routes_;
  http.Get("/metrics", [r](const httplib::Request&, httplib::Response& res) {
    res.set_content(r->metrics(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http.Get("/healthz", [r](const httplib::Request&, httplib::Response& res) {
    if (r->draining()) {
      res.status = 503;
      res.set_content("draining\n", "text/plain");
    } else {
      res.set_content("ok\n", "text/plain");
    }
  });
  http.Get("/stats", [r](const httplib::Request&, httplib::Response& res) {
    res.set_content(r->stats(), "application/json");
  });
  if (port == 0) {
    l->port_ = http.bind_to_any_port(host);
    if (l->port_ < 0) {
      return Status::Unavailable(fmt::format("cannot bind an HTTP port on \"{}\"", host));
    }
  } else {
    if (!http.bind_to_port(host, port)) {
      return Status::Unavailable(fmt::format(
          "cannot bind HTTP {}:{} (port in use, or host not a local address)", host, port));
    }
    l->port_ = port;
  }
  HttpListener* self = l.get();
  l->thread_ = std::thread([self] {
    try {
      self->http_->listen_after_bind();
    } catch (const std::system_error& e) {
      // Its workers could not start (out of threads): the Unix socket's service goes on
      // without HTTP rather than the whole server aborting.
      spdlog::error(
          "HTTP listener stopped: cannot start its {} workers ({}); /metrics, /healthz "
          "and /stats are not served",
          self->workers_, e.what());
    }
    self->thread_done_ = true;
  });
  return l;
}

void HttpListener::Stop() {
  if (!thread_.joinable()) return;
  // httplib's stop() does nothing to a server whose listen loop has not begun yet, and that
  // loop would then accept forever: a SIGTERM right after start hung the drain.
  while (!http_->is_running() && !thread_done_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  http_->stop();
  thread_.join();
}

}  // namespace kvtier::server
