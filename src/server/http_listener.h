// The server's HTTP listener: /metrics (Prometheus text), /healthz and /stats, bounded in every
// input (docs/security.md): connections, request lines, headers, bodies and ranges.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "kvtier/status.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace kvtier::server {

struct HttpRoutes {
  std::function<std::string()> metrics;  // GET /metrics
  std::function<bool()> draining;        // GET /healthz: 503 "draining" when true, else 200
  std::function<std::string()> stats;    // GET /stats
};

class HttpListener {
 public:
  // Binds host:port (0: a free port) and serves `routes` from `threads` workers. Errors:
  // kUnavailable when the port cannot be bound (in use, or not a local address).
  static Result<std::unique_ptr<HttpListener>> Start(const std::string& host, int port, int threads,
                                                     HttpRoutes routes);
  ~HttpListener();  // Stop()

  int port() const { return port_; }
  // Stops listening and waits for the listener's thread. Idempotent.
  void Stop();

 private:
  HttpListener();

  std::unique_ptr<httplib::Server> http_;
  HttpRoutes routes_;
  int port_ = -1;
  size_t workers_ = 0;
  std::thread thread_;
  std::atomic<bool> thread_done_{false};
};

}  // namespace kvtier::server
