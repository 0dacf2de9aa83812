// The driver: one server at a time on the working directory, the verifying clients and the
// adversary as processes of their own, and random disruptions until the end; then the checks
// that only the end allows (no pin left, nothing corrupt on disk).
#include "stress/driver.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/cache_dir.h"
#include "kvtier/client.h"
#include "stress/child_process.h"
#include "stress/chunk_data.h"
#include "stress/roles.h"

namespace kvtier::stress {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// What kvtier serve does with each signal (src/tools/serve_cmd.cc, docs/protocol.md): these
// drain it as SIGTERM does; the ignored ones must leave it serving.
constexpr int kDrainSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGALRM, SIGXCPU, SIGPWR};
constexpr int kIgnoredSignals[] = {SIGPIPE, SIGUSR1, SIGUSR2, SIGXFSZ};

struct Child {
  pid_t pid = -1;
  std::string what;
  bool killed_by_us = false;
  int client_id = -1;  // a verifying client's; -1: the server or the adversary
};

class Driver {
 public:
  explicit Driver(const StressOptions& options)
      : o_(options), rng_(options.seed), socket_(ServerSocket(options.dir)) {}

  StressReport Run();

 private:
  // The server.
  void StartServer();
  int PublishHttpPort();
  std::vector<std::string> FaultyServerArgs(double fault_rate, int http_port) const;
  std::vector<std::string> KvtierServeArgs(int http_port) const;
  void AwaitServer();
  bool StopServer(bool kill);  // false (with a failure recorded) on an unclean or slow exit

  // The role processes.
  std::vector<std::string> RoleArgs(const std::string& role, uint64_t seed) const;
  std::vector<std::string> WithIsolation(std::vector<std::string> argv) const;
  void StartClient(int id);
  void StartAdversary();
  void Reap(bool final);
  void JudgeExit(const Child& c, int status);

  // What happens between the start and the end.
  void Disrupt();
  void KillClient();
  void PlantNonRegularFile();
  void SignalStorm();

  // The end.
  void AwaitRoles();
  void CheckNoPinLeft();
  void CheckCacheDir();
  void AddRoleCounts();

  ClientOptions DriverClientOptions() const;
  std::optional<nlohmann::json> Stats();
  void Fail(std::string why) {
    if (r_.failure.empty()) r_.failure = std::move(why);
  }
  bool failed() const { return !r_.failure.empty(); }

  const StressOptions& o_;
  std::mt19937_64 rng_;
  const std::string socket_;
  double until_unix_ = 0;
  std::string write_policy_;  // the current server's
  Child server_;
  std::map<pid_t, Child> clients_;  // verifying clients and the adversary, by pid
  StressReport r_;
};

StressReport Driver::Run() {
  const auto started = Clock::now();
  r_.seed = o_.seed;
  std::error_code ec;
  std::filesystem::remove(RoleCountsFile(o_.dir), ec);  // an earlier run's, in a --dir reused
  StartServer();
  // The run's time counts from a listening server: a slow start (a sanitizer build, a loaded
  // machine) must not eat a short run's time for the roles.
  until_unix_ = NowUnix() + o_.seconds;
  for (int i = 0; i < o_.clients && !failed(); ++i) StartClient(i);
  if (o_.adversary && !failed()) StartAdversary();
  while (!failed() && NowUnix() < until_unix_ - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300 + rng_() % 1500));
    Reap(false);
    if (failed() || NowUnix() >= until_unix_ - 3) break;
    Disrupt();
  }
  AwaitRoles();
  if (!failed()) CheckNoPinLeft();
  if (server_.pid > 0) StopServer(false);
  if (!failed()) CheckCacheDir();
  AddRoleCounts();
  r_.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return r_;
}

// --- the server ---

void Driver::StartServer() {
  const char* policies[] = {"write_back", "write_through"};
  write_policy_ = policies[rng_() % 2];
  bool faulty;
  double fault_rate;
  if (o_.kvtier_serve) {
    faulty = o_.fault_rate > 0 && rng_() % 2 == 0;
    fault_rate = o_.fault_rate;
  } else {
    // No `kvtier serve` to start: every server is the in-process one, with faults half of the
    // time (the role's fault rate of 0 makes it a plain server).
    faulty = true;
    fault_rate = rng_() % 2 == 0 ? o_.fault_rate : 0;
  }
  const int http_port = PublishHttpPort();
  auto argv =
      WithIsolation(faulty ? FaultyServerArgs(fault_rate, http_port) : KvtierServeArgs(http_port));
  if (o_.isolate_clients && !faulty) {
    argv.insert(argv.end(), {"--tenant-token-file", TenantFile(o_.dir)});
  }
  if (faulty && fault_rate > 0) ++r_.faulty_starts;
  server_ = {Spawn(argv, o_.dir + "/server.log"),
             !faulty          ? "kvtier serve"
             : fault_rate > 0 ? "fault-injecting server"
                              : "in-process server",
             false};
  ++r_.server_starts;
  if (server_.pid < 0) {
    Fail(fmt::format("cannot start {}: {}", server_.what, std::strerror(errno)));
    return;
  }
  AwaitServer();
}

// A fresh HTTP port each start, told to the adversary through a file (renamed into place, so
// the adversary never reads half of it).
int Driver::PublishHttpPort() {
  const int http_port = FreeLoopbackPort();
  const std::string tmp = HttpPortFile(o_.dir) + ".tmp";
  std::ofstream(tmp) << http_port << "\n";
  std::error_code ec;
  std::filesystem::rename(tmp, HttpPortFile(o_.dir), ec);
  return http_port;
}

std::vector<std::string> Driver::FaultyServerArgs(double fault_rate, int http_port) const {
  auto argv = RoleArgs("server", o_.seed + r_.server_starts);  // new faults each start
  argv.insert(argv.end(),
              {"--write-policy", write_policy_, "--l1-mb", fmt::format("{}", o_.l1_mb), "--l2-mb",
               fmt::format("{}", o_.l2_mb), "--fault-rate", fmt::format("{}", fault_rate),
               "--http-port", std::to_string(http_port)});
  return argv;
}

std::vector<std::string> Driver::KvtierServeArgs(int http_port) const {
  return {o_.program,
          "serve",
          "--socket",
          socket_,
          "--http-port",
          std::to_string(http_port),
          "--chunk-bytes",
          std::to_string(o_.chunk_bytes),
          "--l1-size-gb",
          fmt::format("{}", o_.l1_mb / 1024.0),
          "--l2",
          nlohmann::json{{"path", o_.dir + "/cache"}, {"max_size_gb", o_.l2_mb / 1024.0}}.dump(),
          "--write-policy",
          write_policy_,
          "--log-level",
          "warn"};
}

// Ready when a client can connect; a server that exits first, or takes 30 s, fails the run.
void Driver::AwaitServer() {
  auto until = Clock::now() + 30s;
  while (Clock::now() < until) {
    ClientOptions o = DriverClientOptions();
    o.client_name.clear();
    o.connect_timeout = 500ms;
    if (Client::Connect(o).ok()) return;
    int status;
    if (::waitpid(server_.pid, &status, WNOHANG) == server_.pid) {
      Fail(fmt::format("{} did not start: {} (see {}/server.log)", server_.what,
                       DescribeWaitStatus(status), o_.dir));
      server_.pid = -1;
      return;
    }
    std::this_thread::sleep_for(50ms);
  }
  Fail(fmt::format("{} did not accept a client within 30 s", server_.what));
}

bool Driver::StopServer(bool kill) {
  if (server_.pid <= 0) return false;
  server_.killed_by_us = true;
  // kvtier serve drains on any of its drain signals; the in-process server on SIGTERM.
  const int sig = kill ? SIGKILL
                  : server_.what != "kvtier serve"
                      ? SIGTERM
                      : kDrainSignals[rng_() % std::size(kDrainSignals)];
  ::kill(server_.pid, sig);
  auto until = Clock::now() + 30s;
  int status = 0;
  for (;;) {
    pid_t r = ::waitpid(server_.pid, &status, WNOHANG);
    if (r == server_.pid) break;
    if (Clock::now() > until) {
      ::kill(server_.pid, SIGKILL);
      ::waitpid(server_.pid, &status, 0);
      Fail(fmt::format("{} did not finish within 30 s of {}", server_.what, strsignal(sig)));
      server_.pid = -1;
      return false;
    }
    std::this_thread::sleep_for(10ms);
  }
  server_.pid = -1;
  if (!kill && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    Fail(fmt::format("{} ended by {} with {}, not a clean exit (see {}/server.log)", server_.what,
                     strsignal(sig), DescribeWaitStatus(status), o_.dir));
    return false;
  }
  return true;
}

// --- the role processes ---

std::vector<std::string> Driver::RoleArgs(const std::string& role, uint64_t seed) const {
  return {o_.program,      "stress",
          "--role",        role,
          "--socket",      socket_,
          "--dir",         o_.dir,
          "--seed",        std::to_string(seed),
          "--chunk-bytes", std::to_string(o_.chunk_bytes),
          "--until-unix",  fmt::format("{:.3f}", until_unix_)};
}

// RoleArgs with what the server and the adversary must know of the run.
std::vector<std::string> Driver::WithIsolation(std::vector<std::string> argv) const {
  if (o_.isolate_clients) argv.push_back("--isolate-clients");
  return argv;
}

void Driver::StartClient(int id) {
  auto argv = RoleArgs("client", o_.seed);
  argv.insert(argv.end(), {"--client-id", std::to_string(id)});
  if (o_.isolate_clients) argv.insert(argv.end(), {"--token", VerifierToken(o_.seed)});
  const pid_t pid = Spawn(argv, fmt::format("{}/client-{}.log", o_.dir, id));
  if (pid < 0) return Fail(fmt::format("cannot start client {}: {}", id, std::strerror(errno)));
  clients_[pid] = {pid, fmt::format("client {}", id), false, id};
  ++r_.client_processes;
}

void Driver::StartAdversary() {
  auto argv = WithIsolation(RoleArgs("adversary", o_.seed));
  if (o_.isolate_clients) argv.insert(argv.end(), {"--token", IntruderToken(o_.seed)});
  const pid_t pid = Spawn(argv, o_.dir + "/adversary.log");
  if (pid < 0) return Fail(fmt::format("cannot start the adversary: {}", std::strerror(errno)));
  clients_[pid] = {pid, "adversary", false, -1};
}

// Collects exited children: a server that died on its own, or a client that saw a wrong byte,
// is a failure. Before the end, clients that ended are replaced.
void Driver::Reap(bool final) {
  int status;
  if (server_.pid > 0 && ::waitpid(server_.pid, &status, WNOHANG) == server_.pid) {
    Fail(fmt::format("{} died on its own: {} (see {}/server.log)", server_.what,
                     DescribeWaitStatus(status), o_.dir));
    server_.pid = -1;
  }
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (::waitpid(it->first, &status, WNOHANG) != it->first) {
      ++it;
      continue;
    }
    const Child c = it->second;
    it = clients_.erase(it);
    JudgeExit(c, status);
    if (!final && NowUnix() < until_unix_ - 1) {
      if (c.client_id >= 0) {
        StartClient(c.client_id);
      } else {
        StartAdversary();
      }
    }
  }
}

void Driver::JudgeExit(const Child& c, int status) {
  const bool exited = WIFEXITED(status);
  if (exited && WEXITSTATUS(status) == kExitWrongByte) {
    Fail(fmt::format("{} was served a wrong byte (see {}/client-{}.log)", c.what, o_.dir,
                     c.client_id));
  } else if (exited && WEXITSTATUS(status) == kExitLeak) {
    Fail(fmt::format("another tenant found the verifying clients' chunks (see {}/adversary.log)",
                     o_.dir));
  } else if (!c.killed_by_us && !(exited && WEXITSTATUS(status) == 0)) {
    Fail(fmt::format("{} ended with {}", c.what, DescribeWaitStatus(status)));
  }
}

// --- between the start and the end ---

// One random disruption (or none): a client killed, a chunk file replaced, a signal storm, the
// server killed or drained and started again.
void Driver::Disrupt() {
  const int action = static_cast<int>(rng_() % 10);
  if (o_.kill_clients && action < 4 && !clients_.empty()) {
    KillClient();
  } else if (action == 6) {
    PlantNonRegularFile();
  } else if (action == 7) {
    SignalStorm();
  } else if (o_.kill_server && action < 6) {
    const bool kill = action == 4;
    kill ? ++r_.server_kills : ++r_.drain_signals;
    if (StopServer(kill)) StartServer();
  }
}

void Driver::KillClient() {
  auto it = std::next(clients_.begin(), static_cast<long>(rng_() % clients_.size()));
  it->second.killed_by_us = true;
  ::kill(it->first, SIGKILL);
  ++r_.client_kills;
}

// Bad luck on the shared directory: a chunk file replaced by a FIFO (whose open would block
// forever, like a hung NFS server) or by a directory. The server must treat either as a miss and
// still stop promptly on SIGTERM.
void Driver::PlantNonRegularFile() {
  std::vector<std::filesystem::path> chunks;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(o_.dir + "/cache", ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec) && it->path().filename().string().size() == 64) {
      chunks.push_back(it->path());
    }
  }
  if (chunks.empty()) return;
  const auto& path = chunks[rng_() % chunks.size()];
  if (::unlink(path.c_str()) != 0) return;
  if (rng_() % 2) {
    if (::mkfifo(path.c_str(), 0644) == 0) ++r_.planted_files;
  } else {
    if (::mkdir(path.c_str(), 0755) == 0) ++r_.planted_files;
  }
}

// Dozens of the signals kvtier serve ignores, back to back: it must go on serving (a death is
// caught by Reap as a server that died on its own).
void Driver::SignalStorm() {
  if (server_.pid <= 0 || server_.what != "kvtier serve") return;
  ++r_.signal_storms;
  for (int i = 0; i < 40; ++i) {
    ::kill(server_.pid, kIgnoredSignals[rng_() % std::size(kIgnoredSignals)]);
    if (i % 8 == 7) std::this_thread::sleep_for(1ms);
  }
}

// --- the end ---

// The roles stop by themselves at until_unix_; a role that has not within 30 s fails the run and
// is killed (and waited for: no process outlives the run).
void Driver::AwaitRoles() {
  auto until = Clock::now() + 30s;
  while (!clients_.empty() && Clock::now() < until) {
    Reap(true);
    std::this_thread::sleep_for(20ms);
  }
  for (auto& [pid, c] : clients_) {
    Fail(fmt::format("{} did not finish in time", c.what));
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  clients_.clear();
}

// Every client is gone: no pin may remain once the server's own work has drained.
void Driver::CheckNoPinLeft() {
  auto until_quiet = Clock::now() + 15s;
  for (;;) {
    auto st = Stats();
    if (!st) return Fail("could not read the server's stats after the clients exited");
    const uint64_t pinned = (*st)["pool"].value("pinned", uint64_t{0});
    const size_t clients = (*st)["clients"].size();  // this driver's own connection included
    if (pinned == 0 && clients <= 1) return;
    if (Clock::now() > until_quiet) {
      return Fail(
          fmt::format("leaked pins: {} slots still pinned and {} clients listed 15 s after "
                      "every client exited:\n{}",
                      pinned, clients, st->dump(2)));
    }
    std::this_thread::sleep_for(100ms);
  }
}

// Nothing on disk may be corrupt: every publish is atomic, SIGKILL or not.
void Driver::CheckCacheDir() {
  auto report = FsckCacheDir(o_.dir + "/cache", {});
  if (!report.ok()) {
    Fail(fmt::format("fsck: {}", report.status().ToString()));
  } else if (report->corrupt > 0) {
    Fail(fmt::format("fsck found {} corrupt chunk files, e.g. {}", report->corrupt,
                     report->findings.empty() ? "?" : report->findings[0].path));
  }
}

void Driver::AddRoleCounts() {
  std::ifstream in(RoleCountsFile(o_.dir));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string role;
    uint64_t a = 0, b = 0;
    fields >> role >> a >> b;
    if (role == "client") {
      ++r_.clients_finished;
      r_.client_ops += a;
      r_.chunks_verified += b;
    } else if (role == "adversary") {
      r_.adversary_attacks += a;
    }
  }
}

ClientOptions Driver::DriverClientOptions() const {
  ClientOptions o;
  o.socket_path = socket_;
  o.ns = StressNamespace();
  o.chunk_bytes = o_.chunk_bytes;
  o.client_name = "stress-driver";
  o.token = o_.isolate_clients ? VerifierToken(o_.seed) : "";
  return o;
}

std::optional<nlohmann::json> Driver::Stats() {
  auto c = Client::Connect(DriverClientOptions());
  if (!c.ok()) return std::nullopt;
  auto text = (*c)->StatsJson();
  if (!text.ok()) return std::nullopt;
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

}  // namespace

StressReport DriveStress(const StressOptions& options) { return Driver(options).Run(); }

}  // namespace kvtier::stress
