// RunStress's preparation and cleanup around the driver (driver.cc), and the roles' dispatch.
#include "stress/stress.h"

#include <fmt/format.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "stress/driver.h"
#include "stress/roles.h"

namespace kvtier::stress {
namespace {

namespace fs = std::filesystem;

// The longest socket path a sockaddr_un takes (with its terminating NUL).
constexpr size_t kMaxSocketPath = sizeof(sockaddr_un::sun_path) - 1;

Status CheckSocketPathFits(const std::string& dir, const char* what) {
  const std::string socket = ServerSocket(dir);
  if (socket.size() <= kMaxSocketPath) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("{} {} is too long: the servers' socket {} would be {} bytes, a Unix socket "
                  "address takes at most {}",
                  what, dir, socket, socket.size(), kMaxSocketPath));
}

// Two tenants: the verifying clients and the adversary. Owner-only, as the server demands.
Status WriteTenantFile(const StressOptions& run) {
  const std::string path = TenantFile(run.dir);
  {
    std::ofstream out(path);
    out << "verifiers " << VerifierToken(run.seed) << "\nintruder " << IntruderToken(run.seed)
        << "\n";
    if (!out.flush()) return Status::IOError(fmt::format("cannot write {}", path));
  }
  std::error_code ec;
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write, ec);
  if (ec) return Status::IOError(fmt::format("cannot restrict {}: {}", path, ec.message()));
  return Status::Ok();
}

// Fills in what the options leave to the run: the seed, the program, the working directory
// (*made_dir: a temporary one, made here), the tenant file.
Status Prepare(StressOptions* run, bool* made_dir) {
  *made_dir = false;
  if (run->seed == 0) run->seed = static_cast<uint64_t>(NowUnix() * 1000) % 1000000007;
  if (run->program.empty()) {
    std::error_code ec;
    run->program = fs::read_symlink("/proc/self/exe", ec).string();
    if (ec) return Status::IOError(fmt::format("cannot find this program: {}", ec.message()));
  }
  if (run->dir.empty()) {
    std::error_code ec;
    std::string pattern = (fs::temp_directory_path(ec) / "kvtier-stress-XXXXXX").string();
    if (ec || ::mkdtemp(pattern.data()) == nullptr) {
      return Status::IOError(fmt::format("cannot make a temporary directory: {}",
                                         ec ? ec.message() : std::strerror(errno)));
    }
    run->dir = pattern;
    *made_dir = true;
    if (Status s = CheckSocketPathFits(run->dir, "the temporary directory"); !s.ok()) return s;
  } else {
    std::error_code ec;
    fs::create_directories(run->dir, ec);
    if (ec) return Status::IOError(fmt::format("cannot make --dir {}: {}", run->dir, ec.message()));
  }
  if (run->isolate_clients) return WriteTenantFile(*run);
  return Status::Ok();
}

}  // namespace

Status ValidateStressOptions(const StressOptions& o) {
  if (!(o.seconds > 0) || o.clients < 1 || o.chunk_bytes == 0) {
    return Status::InvalidArgument("--seconds, --clients and --chunk-bytes must be positive");
  }
  if (!(o.l1_mb > 0) || !(o.l2_mb > 0)) {
    return Status::InvalidArgument("--l1-mb and --l2-mb must be positive");
  }
  if (!(o.fault_rate >= 0 && o.fault_rate <= 1)) {
    return Status::InvalidArgument(
        fmt::format("--fault-rate must be a probability, from 0 to 1 (not {})", o.fault_rate));
  }
  if (!o.dir.empty()) {
    if (Status s = CheckSocketPathFits(o.dir, "--dir"); !s.ok()) return s;
  }
  if (!o.program.empty() && ::access(o.program.c_str(), X_OK) != 0) {
    return Status::InvalidArgument(fmt::format("the program to start, {}, cannot be run: {}",
                                               o.program, std::strerror(errno)));
  }
  return Status::Ok();
}

Result<StressReport> RunStress(const StressOptions& options) {
  if (Status s = ValidateStressOptions(options); !s.ok()) return s;
  StressOptions run = options;
  bool made_dir = false;
  Status prepared = Prepare(&run, &made_dir);
  if (!prepared.ok()) {
    std::error_code ec;
    if (made_dir) fs::remove_all(run.dir, ec);
    return prepared;
  }
  // A role that dies must not take the driver with it when the driver writes to it.
  ::signal(SIGPIPE, SIG_IGN);
  if (run.on_start) run.on_start(run.seed, run.dir);
  StressReport report = DriveStress(run);
  report.dir = run.dir;
  if (report.passed() && made_dir) {
    std::error_code ec;
    fs::remove_all(run.dir, ec);
    report.dir_removed = !ec;
  }
  return report;
}

std::string StressStartLine(const StressOptions& options, uint64_t seed, const std::string& dir) {
  return fmt::format("kvtier stress: seed {}, {:.0f} s, {} clients, dir {}", seed, options.seconds,
                     options.clients, dir);
}

std::string StressSummaryLine(const StressReport& r) {
  return fmt::format(
      "kvtier stress: {} server starts ({} fault-injecting), {} server SIGKILLs, {} drain "
      "signals, {} signal storms, {} client SIGKILLs, {} chunk files replaced by a FIFO or "
      "directory, {:.0f} s",
      r.server_starts, r.faulty_starts, r.server_kills, r.drain_signals, r.signal_storms,
      r.client_kills, r.planted_files, r.seconds);
}

Result<int> RunStressRole(const StressOptions& run, const StressRoleOptions& role) {
  if (role.role == "client") return RunVerifyingClient(run, role);
  if (role.role == "adversary") return RunAdversary(run, role);
  if (role.role == "server") return RunFaultyServer(run, role);
  return Status::InvalidArgument(fmt::format("unknown --role {}", role.role));
}

}  // namespace kvtier::stress
