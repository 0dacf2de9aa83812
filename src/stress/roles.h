// The processes a stress run is made of, besides its driver, and what they share with it: exit
// statuses, the files of the working directory, the tenants' tokens. Each role is the whole of a
// process that the driver starts as `<program> stress --role ROLE` (stress.h); it prints what it
// did, or why it failed, on stderr, which the driver sends to a log in the working directory.
//
// Thread-safety: each Run* function is a process's main work; the rest are pure functions, and
// AppendRoleCounts, which appends with one write (atomic among the roles).
#pragma once

#include <cstdint>
#include <string>

#include "stress/stress.h"

namespace kvtier::stress {

// Exit statuses of the roles: what the driver learns of each process.
inline constexpr int kExitOk = 0;
inline constexpr int kExitWrongByte = 3;  // a verifying client saw a wrong byte
inline constexpr int kExitBroken = 4;     // a role could not work at all (bad setup)
inline constexpr int kExitLeak = 5;       // another tenant found a verifying client's chunk

// The Unix socket every server of the run listens on.
std::string ServerSocket(const std::string& dir);

// The tenant token file of an isolated run, and the two tenants' tokens (from the seed).
std::string TenantFile(const std::string& dir);
std::string VerifierToken(uint64_t seed);
std::string IntruderToken(uint64_t seed);

// The current server's HTTP port, for the adversary: rewritten at every start.
std::string HttpPortFile(const std::string& dir);

// One line per role process that ran to the end: "client OPS VERIFIED" or "adversary ATTACKS".
// The driver adds them up into its report (a killed process appends nothing).
std::string RoleCountsFile(const std::string& dir);
void AppendRoleCounts(const std::string& dir, const std::string& line);

// Seconds since the epoch: the roles stop at a wall-clock time the driver chose.
double NowUnix();

// A client that stores and loads the chunks of chunk_data.h through every path of the client
// library and checks every byte it is served. kExitWrongByte at the first wrong one.
int RunVerifyingClient(const StressOptions& run, const StressRoleOptions& role);

// The adversarial client: malformed frames and protocol misuse on raw connections, attacks on
// the HTTP listener, and in isolated runs another tenant (adversary.cc). kExitLeak if that
// tenant finds a chunk of the verifying clients.
int RunAdversary(const StressOptions& run, const StressRoleOptions& role);

// The server of `kvtier serve` in this process, with a fault-injecting file tier (none at a
// fault rate of 0), until SIGTERM or SIGINT; then a clean drain. kExitBroken if it cannot start.
int RunFaultyServer(const StressOptions& run, const StressRoleOptions& role);

}  // namespace kvtier::stress
