// The server role: `kvtier serve`'s server in a process of its own, with a fault-injecting file
// tier (io/fault_injection_env.h) that fails, shortens and corrupts its I/O on a seed.
#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdlib>

#include "common/task_pool.h"
#include "io/fault_injection_env.h"
#include "kvtier/io.h"
#include "server/config.h"
#include "server/server.h"
#include "stress/roles.h"

namespace kvtier::stress {
namespace {

using namespace std::chrono_literals;

// What `kvtier serve` would be given for the same run (the driver's command line for it).
server::ServeConfig ServerConfig(const StressOptions& run, const StressRoleOptions& role) {
  server::ServeConfig c;
  c.chunk_bytes = run.chunk_bytes;
  c.l1_size_gb = run.l1_mb / 1024.0;
  server::L2Spec l2;
  l2.path = run.dir + "/cache";
  l2.max_size_gb = run.l2_mb / 1024.0;
  c.l2 = {l2};
  c.socket = role.socket;
  c.http_port = role.http_port;
  c.write_policy = role.write_policy;
  c.isolate_clients = run.isolate_clients;
  if (run.isolate_clients) c.tenant_token_file = TenantFile(run.dir);
  return c;
}

// Faults at `rate` per operation (sync and metadata errors at a quarter of it), new ones for
// each start since the driver gives each start its own seed.
FaultInjectionOptions Faults(uint64_t seed, double rate) {
  FaultInjectionOptions f;
  f.seed = seed;
  f.read_error = f.write_error = f.no_space = rate;
  f.short_read = f.short_write = rate;
  f.bit_flip = rate;
  f.sync_error = f.metadata_error = rate / 4;
  return f;
}

}  // namespace

int RunFaultyServer(const StressOptions& run, const StressRoleOptions& role) {
  spdlog::set_level(spdlog::level::err);
  // Taken by sigwait below, never by a handler: the drain runs on this thread.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  auto options = server::BuildServerOptions(ServerConfig(run, role));
  if (!options.ok()) {
    fmt::print(stderr, "stress server: {}\n", options.status().ToString());
    return kExitBroken;
  }
  // Never destroyed: operations abandoned at shutdown may return into it.
  static FaultInjectionEnv* env = nullptr;
  if (run.fault_rate > 0) {
    env = new FaultInjectionEnv(Env::Default(), Faults(run.seed, run.fault_rate));
    env->SetEnabled(false);  // opening (the directory scan) goes clean
    options->engine.file->env = env;
  }
  options->engine.file->stall_timeout = 2000ms;
  auto srv = server::Server::Start(*options);
  if (!srv.ok()) {
    fmt::print(stderr, "stress server: {}\n", srv.status().ToString());
    return kExitBroken;
  }
  if (env) env->SetEnabled(true);
  int sig = 0;
  sigwait(&signals, &sig);
  if (env) env->SetEnabled(false);  // a clean drain: the write-back at shutdown is not tested here
  (*srv)->Stop();
  srv->reset();
  if (TaskPool::DetachedRunning() > 0) std::quick_exit(kExitOk);  // as kvtier serve does
  return kExitOk;
}

}  // namespace kvtier::stress
