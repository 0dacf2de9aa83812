// `kvtier stress`: a randomized crash test of `kvtier serve` with a file tier, in the spirit of
// RocksDB's db_stress and db_crashtest.py (docs/stress.md).
//
// RunStress drives, for a bounded time and from one seed: a server on a working directory
// (alternately the real `kvtier serve` and the same server in a process of its own with a
// fault-injecting file tier), verifying clients (each chunk's bytes derive from its key, so any
// wrong byte served is caught), an adversarial client (malformed frames, protocol misuse,
// disconnects mid-operation, attacks on the HTTP listener, and in isolated runs another tenant),
// and random SIGKILLs of clients and of the server, with restarts on the same directory. The run
// fails on any wrong byte, any pin left after every client is gone, any server death it did not
// cause, an unclean or slow drain, or a corrupt file left on disk.
//
// Every process the driver starts is `program` run as `<program> stress --role ROLE ...` (a
// verifying client, the adversary, the fault-injecting server) or `<program> serve ...`; the
// `kvtier stress` command is both the driver and, started again by it, each role
// (RunStressRole). Their logs go to files in the working directory.
//
// Thread-safety: RunStress forks and waits for its own children (by pid) and ignores SIGPIPE
// for the whole process; one call per process at a time. It blocks for about `seconds` plus the
// time the end takes (clients finishing, the drain, a check of the directory). RunStressRole is
// the whole of a process the driver started: it may end the process itself.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "kvtier/status.h"

namespace kvtier::stress {

struct StressOptions {
  double seconds = 60;  // > 0
  uint64_t seed = 0;    // 0: from the clock (in the report, so a failure can be replayed)
  int clients = 3;      // verifying client processes, >= 1
  // The working directory (created if missing, kept afterwards); empty: a new temporary one,
  // removed after a run that passed.
  std::string dir;
  uint64_t chunk_bytes = 64 * 1024;  // > 0
  double l1_mb = 4;   // > 0; small: evictions, write-backs and promotions all the time
  double l2_mb = 24;  // > 0; small: the file tier evicts too
  // Per file-tier operation, in the fault-injecting server, [0, 1]. 0: with `kvtier_serve`,
  // never start one; without, its servers run without faults.
  double fault_rate = 0.02;
  bool kill_server = true;   // SIGKILL and drain the server now and then, and restart it
  bool kill_clients = true;  // SIGKILL clients now and then (each is replaced)
  bool adversary = true;     // run the adversarial client
  // Servers isolate clients (private windows, tenant tokens): the verifying clients are one
  // tenant and the adversary also attacks as another, which must never see their chunks.
  bool isolate_clients = false;
  // The program whose `stress --role` and `serve` the driver starts. Empty: this process's own
  // executable (the `kvtier` binary running the command).
  std::string program;
  // Whether `program` has `serve`. Without it (a binary built with the stress command alone)
  // every server is the in-process one of the server role, with faults half of the time.
  bool kvtier_serve = true;
  // Called once the seed and the directory are chosen, before any process starts (the command
  // prints them: a run that hangs can still be replayed). Null: nothing.
  std::function<void(uint64_t seed, const std::string& dir)> on_start;
};

// What a run did. A run that failed still has every count up to its failure.
struct StressReport {
  uint64_t seed = 0;
  std::string dir;           // the working directory
  bool dir_removed = false;  // the temporary directory of a run that passed
  int server_starts = 0;     // of any kind
  int faulty_starts = 0;     // of those, fault-injecting servers
  int server_kills = 0;      // SIGKILLs of the server, each followed by a start
  int drain_signals = 0;     // drains of the server by a signal, each followed by a start
                             // unless the drain failed the run
  int signal_storms = 0;     // bursts of the signals `kvtier serve` ignores
  int client_kills = 0;      // SIGKILLs of verifying clients and of the adversary
  int planted_files = 0;     // chunk files replaced by a FIFO or a directory
  int client_processes = 0;  // verifying clients started, replacements included
  // What the role processes that ran to the end said they did (a killed one tells nothing):
  // the verifying clients' count, operations and chunks served and checked byte for byte, and
  // the adversaries' attacks.
  int clients_finished = 0;
  uint64_t client_ops = 0;
  uint64_t chunks_verified = 0;
  uint64_t adversary_attacks = 0;
  double seconds = 0;   // the whole run, end included
  std::string failure;  // the first thing that went wrong; empty: the run passed

  bool passed() const { return failure.empty(); }
};

// InvalidArgument naming the flag of `kvtier stress`, for options out of range, a working
// directory whose socket path would not fit a Unix socket address, or a `program` that cannot be
// executed.
Status ValidateStressOptions(const StressOptions& options);

// One run. Fails with InvalidArgument (bad options) or IOError (the working directory or the
// tenant file cannot be made) before any process starts; a run that starts returns its report,
// passed or not. Leaves no process behind.
Result<StressReport> RunStress(const StressOptions& options);

// The command's output for a run: the line when it starts, the counts at the end.
std::string StressStartLine(const StressOptions& options, uint64_t seed, const std::string& dir);
std::string StressSummaryLine(const StressReport& report);

// What the driver tells a role on its command line (besides the run's StressOptions: seed, dir,
// chunk_bytes, l1_mb, l2_mb, fault_rate, isolate_clients).
struct StressRoleOptions {
  std::string role;  // "client", "adversary" or "server"
  std::string socket;
  double until_unix = 0;  // clients and the adversary stop at this wall-clock time
  int client_id = 0;
  std::string write_policy = "write_back";  // the server's
  int http_port = -1;                       // the server's HTTP port
  std::string token;                        // this role's tenant token (isolated runs)
};

// Runs one role to its end and returns the process's exit status (see roles.h); InvalidArgument
// for an unknown role. Prints what it did, or why it failed, on stderr.
Result<int> RunStressRole(const StressOptions& run, const StressRoleOptions& role);

}  // namespace kvtier::stress
