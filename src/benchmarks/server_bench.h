// `kvtier bench server`: N client processes doing lookups, stores and loads through a server's
// shared pool, each figure next to a limit measured by the same processes in the same run.
//
// RunServerBench forks `clients` client processes, then starts a server in this process (unless
// `socket` names a running one) and drives the clients through barriers:
//  * control round trips: lookups of a 16-key prefix, and pin/unpin of one chunk (prepare_load +
//    release), each timed alone, next to the floor: bare round trips of a message of a lookup
//    request's size to an echo thread over a Unix socket, in rounds of the same shape. Two
//    modes: paced (Poisson arrivals `rpc_interval_us` apart on average per client, latency timed
//    from the scheduled send time, bench_timing.h) and saturated (back to back). In each mode
//    the floor runs first, then kvtier, on the same schedule.
//  * data passes: memcpy (the limit), store into the pool, load another client's chunks. Each
//    pass stores new chunks, so once the pool is full every store evicts. `warmup` passes go
//    unmeasured; the throughput of a phase is the median over the measured passes of the bytes
//    all clients moved over the time from the first start to the last end.
// Steady state (`l2_dir`): the server gets a file tier on a subdirectory of `l2_dir` (removed
// after the run) with `write_policy`, and an L1 pool of two passes' worth of chunks; the tier's
// write rate over the measured passes is reported beside plain O_DIRECT writes of chunk files to
// the same directory by as many threads as the tier writes with.
//
// Thread-safety: REQUIRES the calling process to run no other thread (the clients are forked
// processes that use the client library); one call at a time. Blocks until the run ends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

#include "kvtier/engine.h"
#include "kvtier/status.h"

namespace kvtier::benchmarks {

struct ServerBenchOptions {
  // A running `kvtier serve`; empty: start an L1-only server in this process.
  std::string socket;
  std::string token;          // the running server's token, if it has one
  int clients = 4;            // client processes, [1, 256]
  uint64_t chunk_mib = 4;     // [1, 1024]; of the server started here (a running one has its own)
  uint32_t chunks = 16;       // per client and pass, [1, 4096] (fewer if the pool is small)
  int repeats = 5;            // measured passes, [1, 1000]
  int warmup = 0;             // unmeasured passes before them, [0, 1000]
  int rpc_rounds = 2000;      // control rounds per client and phase, [1, 10^7]
  int rpc_interval_us = 200;  // mean gap of a client's paced rounds, [0, 10^6]; 0: back to back
  // Steady state: a file tier on this directory (must exist) under the server started here.
  std::string l2_dir;
  WritePolicy write_policy = WritePolicy::kWriteBack;  // with l2_dir
  // The server started here gives each client a private window (server-side copies).
  bool isolate_clients = false;
};

// The timed control round trips. kFloor is a floor round's first trip, timed like a lookup;
// kFloorFollow the trips that follow it (every other round two more), timed like prepare_load
// and release. kSendLate is not a round trip: how late each paced lookup went out after its
// scheduled time (the client's wake-up, or a backlog).
enum RpcOp {
  kFloor = 0,
  kFloorFollow = 1,
  kLookup = 2,
  kPrepareLoad = 3,
  kRelease = 4,
  kSendLate = 5,
  kRpcOps = 6
};
inline constexpr const char* kRpcOpNames[kRpcOps] = {"floor",        "floor_followup", "lookup",
                                                     "prepare_load", "release",        "send_late"};
// The floor each kvtier operation is compared with.
constexpr RpcOp FloorOf(int op) { return op == kLookup ? kFloor : kFloorFollow; }
enum RpcMode { kPaced = 0, kSaturated = 1, kRpcModes = 2 };
// The goal: the paced p50 of every kvtier operation at most this many times its floor's (an
// absolute target cannot hold on every machine, the ratio can).
inline constexpr double kRpcGoalVsFloor = 1.5;

// Bytes of a 16-key lookup request, the floor's message size.
size_t FloorMessageBytes();

struct LatencySummary {
  size_t count = 0;
  double p50 = 0, p99 = 0, p999 = 0;  // microseconds
};

// The file tier's side of the measured passes of a steady-state run, and the reference.
struct SteadyStateResult {
  WritePolicy write_policy = WritePolicy::kWriteBack;
  double measured_seconds = 0;  // wall time of the measured passes
  uint64_t l1_evictions = 0;
  uint64_t l2_bytes_written = 0;
  double l2_write_GBps = 0;
  // Plain O_DIRECT writes of as many bytes (at least 16 chunks, at most 4 GiB) in chunk files.
  double raw_o_direct_write_GBps = 0;
  int raw_o_direct_write_threads = 0;
  uint64_t raw_o_direct_bytes = 0;
  double l2_write_vs_raw = 0;
  uint64_t write_backs = 0;      // written back by the flusher
  uint64_t dirty_evictions = 0;  // lost before reaching L2
  uint64_t dirty_refusals = 0;   // stores refused while L2 caught up
  uint64_t write_through_deferred = 0, write_through_dropped = 0;
  uint64_t l2_errors = 0;
};

struct ServerBenchResult {
  std::string server;        // which server, in words
  uint64_t chunk_bytes = 0;  // of the server started here; 0 with `socket`
  LatencySummary rpc[kRpcModes][kRpcOps];
  // p50 of each kvtier operation (kLookup..kRelease) over its floor's p50 in the same mode.
  double vs_floor[kRpcModes][kRpcOps] = {};
  bool goal_met = false;  // see kRpcGoalVsFloor
  double memcpy_GBps = 0, store_GBps = 0, load_GBps = 0;
  // Chunks the measured passes could not store or load: a throughput over fewer bytes.
  uint64_t store_refused_chunks = 0, load_missed_chunks = 0;
  std::optional<SteadyStateResult> steady_state;  // with l2_dir
};

// InvalidArgument, naming the flag of `kvtier bench server`, for options out of range or that
// do not go together (isolate_clients or l2_dir with a running server, both at once, an l2_dir
// that is not a directory).
Status ValidateServerBenchOptions(const ServerBenchOptions& options);

// One run. Fails with InvalidArgument (bad options) or with what went wrong: the server not
// starting, a client process failing (it says why on stderr; a server not listening at `socket`
// fails every client), the reference writes failing. A failure's message() is complete: it
// includes the code of the error underneath. Removes every file it created.
Result<ServerBenchResult> RunServerBench(const ServerBenchOptions& options);

// The JSON object of one run of `kvtier bench server --json`.
nlohmann::json ServerBenchResultToJson(const ServerBenchOptions& options,
                                       const ServerBenchResult& result);

}  // namespace kvtier::benchmarks
