// Test helper: runs file_tier_worker as a child process with its stdin and stdout on pipes.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace kvtier::testing {

class WorkerProcess {
 public:
  WorkerProcess() = default;
  ~WorkerProcess();  // kills the child if it still runs
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  // Starts KVTIER_FILE_TIER_WORKER with `args`. False if it could not be started.
  bool Start(const std::vector<std::string>& args);
  bool Send(const std::string& line);
  // The next line of the child's stdout without the newline; "" on EOF or timeout.
  std::string ReadLine(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // Sends `sig` and reaps the child; returns the wait status.
  int Kill(int sig);
  // Reaps the child after it exits on its own; returns the wait status.
  int Wait();
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1, from_child_ = -1;
  std::string pending_;
};

}  // namespace kvtier::testing
