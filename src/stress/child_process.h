// The driver's processes: started by fork and exec with their output in a log, and described
// by how they ended.
//
// Thread-safety: plain functions. Spawn forks: call it from a process whose other threads hold
// no lock the child could need before exec (the driver runs no thread of its own).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace kvtier::stress {

// Starts argv[0] with `argv` (signals unblocked), its stdout and stderr appended to `log_path`
// (empty: the caller's). Returns the child's pid, or -1 if fork fails; a child that cannot exec
// exits with status 127.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& log_path);

// A wait status in words: "exit status 1", "signal 9 (Killed)".
std::string DescribeWaitStatus(int status);

// A TCP port on 127.0.0.1 that nobody listens on now (the kernel's pick for an ephemeral bind),
// or -1.
int FreeLoopbackPort();

}  // namespace kvtier::stress
