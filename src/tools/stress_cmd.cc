// kvtier stress: a randomized crash test of `kvtier serve` with a file tier (src/stress/stress.h,
// docs/stress.md): the flags, and the run's lines on stdout and stderr.
//
// One binary, several roles: the driver starts itself again as `kvtier stress --role client`,
// `--role adversary` and `--role server` (the fault-injecting server), with the hidden flags
// below.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <string>

#include "stress/stress.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

using stress::StressOptions;
using stress::StressRoleOptions;

struct StressArgs {
  std::string role = "driver";
  StressOptions options;
  StressRoleOptions role_options;  // with --role other than driver
};

int RunDriver(StressOptions options) {
#ifdef KVTIER_STRESS_STANDALONE
  // This binary has no `kvtier serve` to start (src/testing/stress).
  options.kvtier_serve = false;
#endif
  options.on_start = [&options](uint64_t seed, const std::string& dir) {
    fmt::print("{}\n", stress::StressStartLine(options, seed, dir));
    std::fflush(stdout);
  };
  auto report = stress::RunStress(options);
  if (!report.ok()) {
    fmt::print(stderr, "kvtier stress: {}\n", report.status().message());
    return 2;
  }
  fmt::print("{}\n", stress::StressSummaryLine(*report));
  if (!report->passed()) {
    fmt::print(stderr, "kvtier stress: FAILED (seed {}): {}\n", report->seed, report->failure);
    fmt::print(stderr, "kvtier stress: logs and the cache directory are kept in {}\n", report->dir);
    return 1;
  }
  fmt::print("kvtier stress: passed (seed {})\n", report->seed);
  return 0;
}

int RunStressCommand(StressArgs& a) {
  if (a.role == "driver") return RunDriver(a.options);
  a.role_options.role = a.role;
  auto rc = stress::RunStressRole(a.options, a.role_options);
  if (!rc.ok()) {
    fmt::print(stderr, "kvtier stress: {}\n", rc.status().message());
    return 2;
  }
  return *rc;
}

void AddStress(CLI::App& parent, CommandContext& ctx) {
  auto a = std::make_shared<StressArgs>();
  StressOptions& o = a->options;
  StressRoleOptions& r = a->role_options;
  auto* cmd = parent.add_subcommand(
      "stress",
      "Crash-test `kvtier serve` with a file tier: verifying clients, an adversarial client, "
      "random SIGKILLs and restarts, fault injection (docs/stress.md). Exit status 0: no wrong "
      "byte, no leaked pin, no unexpected server death");
  cmd->add_option("--seconds", o.seconds, "How long to run")->capture_default_str();
  cmd->add_option("--seed", o.seed, "Random seed (0: from the clock; printed either way)");
  cmd->add_option("--clients", o.clients, "Verifying client processes")->capture_default_str();
  cmd->add_option("--dir", o.dir, "Working directory (default: a new temporary one)");
  cmd->add_option("--chunk-bytes", o.chunk_bytes, "Chunk size")->capture_default_str();
  cmd->add_option("--l1-mb", o.l1_mb, "Server L1 pool, MiB")->capture_default_str();
  cmd->add_option("--l2-mb", o.l2_mb, "Server file tier capacity, MiB")->capture_default_str();
  cmd->add_option("--fault-rate", o.fault_rate,
                  "Per-operation fault probability in the fault-injecting server (0: never start "
                  "one)")
      ->capture_default_str();
  cmd->add_flag("!--no-server-kills", o.kill_server, "Never kill or restart the server");
  cmd->add_flag("!--no-client-kills", o.kill_clients, "Never kill clients");
  cmd->add_flag("!--no-adversary", o.adversary, "No adversarial client");
  cmd->add_flag("--isolate-clients", o.isolate_clients,
                "Servers isolate clients (kvtier serve --isolate-clients); the adversary also "
                "overwrites every byte it can map, as another tenant");
  // Internal: the roles the driver starts.
  cmd->add_option("--role", a->role)->group("");
  cmd->add_option("--socket", r.socket)->group("");
  cmd->add_option("--until-unix", r.until_unix)->group("");
  cmd->add_option("--client-id", r.client_id)->group("");
  cmd->add_option("--write-policy", r.write_policy)->group("");
  cmd->add_option("--http-port", r.http_port)->group("");
  cmd->add_option("--token", r.token)->group("");
  cmd->callback([a, &ctx] { ctx.exit_code = RunStressCommand(*a); });
}

const bool kRegistered = RegisterCommand("", &AddStress);

}  // namespace
}  // namespace kvtier::tools
