// Server: `kvtier serve` inside this process (start_server), and default_socket_path.
#include "server/server.h"

#include <Python.h>  // first, as Python's headers require
#include <fmt/format.h>
#include <nanobind/nanobind.h>

#include <memory>
#include <string>
#include <utility>

#include "kvtier/socket_path.h"
#include "kvtier/status.h"
#include "python/binding.h"
#include "server/config.h"

namespace kvtier::python {
namespace {

// `kvtier serve` inside this process: the engine, its L1 pool and its file tier live here, and
// other processes (or this one, through connect()) reach it on its socket.
class PyServer {
 public:
  explicit PyServer(std::unique_ptr<server::Server> s)
      : server_(std::move(s)),
        socket_path_(server_->socket_path()),
        http_port_(server_->http_port()) {}
  PyServer(const PyServer&) = delete;
  PyServer& operator=(const PyServer&) = delete;
  ~PyServer() { ReapShared(std::move(server_)); }  // ~Server drains: never on the caller

  const std::string& socket_path() const { return socket_path_; }
  int http_port() const { return http_port_; }
  bool stopped() const { return server_ == nullptr; }

  nb::dict Stats() const {
    std::string text = Running().StatsJson();
    return nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(text));
  }
  std::string Metrics() const { return Running().MetricsText(); }

  void Stop() {
    if (!server_) return;
    std::shared_ptr<server::Server> s = std::move(server_);
    nb::gil_scoped_release release;
    s->Stop();
    s.reset();
  }

 private:
  server::Server& Running() const {
    if (!server_) throw StatusError("closed", "the server is stopped");
    return *server_;
  }

  std::shared_ptr<server::Server> server_;  // null once stopped
  std::string socket_path_;
  int http_port_;
};

PyServer* StartServer(nb::handle config_obj) {
  const std::string text = JsonTextOf(config_obj, "config must be a JSON string or a dict");
  // The same settings and checks as `kvtier serve --config`.
  server::ServeConfig config;
  Check(server::ApplyConfigJson(text, &config));
  server::ServerOptions options = Unwrap(server::BuildServerOptions(config));
  Result<std::unique_ptr<server::Server>> s = [&] {
    nb::gil_scoped_release release;
    return server::Server::Start(options);
  }();
  return new PyServer(Unwrap(std::move(s)));
}

}  // namespace

void RegisterServer(nb::module_& m) {
  nb::class_<PyServer>(
      m, "Server",
      "A `kvtier serve` running inside this process (start_server). Stop it with stop() or a "
      "with block; dropping it stops it in the background.")
      .def_prop_ro("socket_path", &PyServer::socket_path, "The Unix socket it listens on.")
      .def_prop_ro("http_port", &PyServer::http_port,
                   "The HTTP port of /metrics, /healthz and /stats, or -1 without HTTP.")
      .def_prop_ro("stopped", &PyServer::stopped, "True after stop().")
      .def("stats", &PyServer::Stats,
           "The statistics document as a dict, every client listed: the operator's view (under "
           "isolate_clients, HTTP /stats lists no client and a client's stats() only its "
           "tenant's).")
      .def("metrics", &PyServer::Metrics, "The /metrics text (Prometheus).")
      .def("stop", &PyServer::Stop,
           "Drains and stops; idempotent. Blocks: closes every connection (releasing what it "
           "held), writes L1's dirty chunks to L2 (write-back), finishes queued writes and "
           "removes the socket.")
      .def("__enter__", [](nb::object self) { return self; })
      .def("__exit__", [](PyServer& s, nb::args) {
        s.Stop();
        return false;
      });

  m.def("start_server", &StartServer, nb::arg("config") = "{}", nb::rv_policy::take_ownership,
        "Starts `kvtier serve` inside this process. ``config``: the settings `kvtier serve "
        "--config` reads, as a JSON string or dict (keys as the flags: l1_size_gb, chunk_bytes, "
        "chunk_size, model, l2 (a list of tier objects), no_l2, write_policy, eviction_policy, "
        "socket, token, http_port, worker_threads, ...); the defaults are the command's. "
        "InvalidArgumentError for bad settings; KvtierError \"unavailable\" when the socket is "
        "in use.");

  m.def("default_socket_path", &DefaultSocketPath,
        "Where `kvtier serve` listens by default: $XDG_RUNTIME_DIR/kvtier.sock, else "
        "/tmp/kvtier-<uid>.sock.");
}

}  // namespace kvtier::python
