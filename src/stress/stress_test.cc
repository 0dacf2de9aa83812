// RunStress on short runs against real servers: the `kvtier` binary's `serve`, and the server
// role in processes of its own (isolated clients, faults injected); a server that cannot start;
// options it refuses before starting anything.
#include "stress/stress.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "testing/temp_dir.h"

namespace kvtier::stress {
namespace {

namespace fs = std::filesystem;

// Two seconds: the driver disrupts nothing in the last three of a run, so a run this short
// starts one server and keeps it. A small file tier keeps the end's check of every file short.
StressOptions Short(const std::string& program, bool kvtier_serve) {
  StressOptions o;
  o.seconds = 2;
  o.l2_mb = 4;
  o.seed = 20240611;
  o.clients = 2;
  o.program = program;
  o.kvtier_serve = kvtier_serve;
  return o;
}

// What every run that passed must agree on, whatever its schedule.
void ExpectPassedAndConsistent(const StressOptions& o, const StressReport& r) {
  EXPECT_TRUE(r.passed()) << r.failure << "\n(logs in " << r.dir << ")";
  EXPECT_EQ(r.seed, o.seed);
  EXPECT_EQ(r.server_starts, 1 + r.server_kills + r.drain_signals);
  EXPECT_LE(r.faulty_starts, r.server_starts);
  EXPECT_GE(r.client_processes, o.clients);
  EXPECT_LE(r.clients_finished, r.client_processes);
  EXPECT_GT(r.client_ops, 0u);
  EXPECT_GT(r.chunks_verified, 0u);
  EXPECT_GT(r.adversary_attacks, 0u);
  EXPECT_GE(r.seconds, o.seconds);
}

TEST(Stress, ShortRunAgainstKvtierServe) {
#ifndef KVTIER_BINARY
  GTEST_SKIP() << "this build makes no kvtier binary";
#else
  StressOptions o = Short(KVTIER_BINARY, true);
  o.fault_rate = 0;  // never the fault-injecting server: every start is kvtier serve
  uint64_t started_seed = 0;
  std::string started_dir;
  o.on_start = [&](uint64_t seed, const std::string& dir) {
    started_seed = seed;
    started_dir = dir;
    EXPECT_TRUE(fs::is_directory(dir));
  };
  auto r = RunStress(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectPassedAndConsistent(o, *r);
  EXPECT_EQ(r->server_starts, 1);
  EXPECT_EQ(r->faulty_starts, 0);
  EXPECT_EQ(r->client_kills, 0);
  EXPECT_EQ(r->client_processes, 2);
  EXPECT_EQ(r->clients_finished, 2);  // none killed: both ran to the end and said so
  EXPECT_EQ(started_seed, o.seed);
  EXPECT_EQ(r->dir, started_dir);
  // The temporary directory of a run that passed is gone.
  EXPECT_TRUE(r->dir_removed);
  EXPECT_FALSE(fs::exists(r->dir));
  EXPECT_EQ(StressSummaryLine(*r),
            fmt::format("kvtier stress: 1 server starts (0 fault-injecting), 0 server SIGKILLs, 0 "
                        "drain signals, 0 signal storms, 0 client SIGKILLs, {} chunk files "
                        "replaced by a FIFO or directory, {:.0f} s",
                        r->planted_files, r->seconds));
#endif
}

// The server role (the in-process server, faults on half of its starts), as the stress command
// alone runs it, with isolated clients: the adversary also attacks as another tenant.
TEST(Stress, ShortIsolatedRunAgainstTheServerRole) {
#if defined(KVTIER_STRESS_BINARY)
  const std::string program = KVTIER_STRESS_BINARY;
#elif defined(KVTIER_BINARY)
  const std::string program = KVTIER_BINARY;
#else
  GTEST_SKIP() << "this build makes no program with the stress command";
  const std::string program;
#endif
  testing::TempDir tmp("stress-test");
  StressOptions o = Short(program, false);
  o.dir = tmp.Sub("run");  // made by the run, kept after it
  o.isolate_clients = true;
  o.fault_rate = 0.05;
  auto r = RunStress(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectPassedAndConsistent(o, *r);
  EXPECT_EQ(r->dir, o.dir);
  EXPECT_FALSE(r->dir_removed);
  EXPECT_TRUE(fs::exists(o.dir + "/server.log"));
  EXPECT_TRUE(fs::exists(o.dir + "/tenants"));
  EXPECT_EQ(fs::status(o.dir + "/tenants").permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
}

// A server that exits at once fails the run, which keeps its directory for the post-mortem.
TEST(Stress, AServerThatDoesNotStartFailsTheRunAndKeepsItsDirectory) {
  StressOptions o = Short("/bin/false", true);
  o.fault_rate = 0;
  auto r = RunStress(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->passed());
  EXPECT_NE(r->failure.find("kvtier serve did not start: exit status 1"), std::string::npos)
      << r->failure;
  EXPECT_EQ(r->server_starts, 1);
  EXPECT_EQ(r->client_processes, 0);
  EXPECT_FALSE(r->dir_removed);
  EXPECT_TRUE(fs::exists(r->dir + "/server.log"));
  std::error_code ec;
  fs::remove_all(r->dir, ec);
}

// Each refused option names its flag, and nothing is made or started.
TEST(Stress, BadOptionsAreRefusedNamingTheirFlag) {
  testing::TempDir tmp("stress-test");
  struct Case {
    const char* flag;
    void (*set)(StressOptions&);
  };
  const Case cases[] = {
      {"--seconds", [](StressOptions& o) { o.seconds = 0; }},
      {"--seconds", [](StressOptions& o) { o.seconds = std::nan(""); }},
      {"--clients", [](StressOptions& o) { o.clients = 0; }},
      {"--chunk-bytes", [](StressOptions& o) { o.chunk_bytes = 0; }},
      {"--l1-mb", [](StressOptions& o) { o.l1_mb = 0; }},
      {"--l2-mb", [](StressOptions& o) { o.l2_mb = -1; }},
      {"--fault-rate", [](StressOptions& o) { o.fault_rate = 1.5; }},
      {"--fault-rate", [](StressOptions& o) { o.fault_rate = -0.1; }},
      {"--dir", [](StressOptions& o) { o.dir += "/" + std::string(120, 'd'); }},
      {"cannot be run", [](StressOptions& o) { o.program = "/nonexistent/kvtier"; }},
  };
  for (const Case& c : cases) {
    StressOptions o = Short("/bin/true", true);
    o.dir = tmp.Sub("never-made");
    c.set(o);
    Status s = ValidateStressOptions(o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.flag;
    EXPECT_NE(s.message().find(c.flag), std::string::npos) << s.message();
    auto r = RunStress(o);
    ASSERT_FALSE(r.ok()) << c.flag;
    EXPECT_EQ(r.status().message(), s.message());
    EXPECT_FALSE(fs::exists(tmp.Sub("never-made"))) << c.flag;
  }
  EXPECT_TRUE(ValidateStressOptions(Short("/bin/true", true)).ok());
}

TEST(Stress, ADirThatCannotBeMadeIsAnErrorNotAnAbort) {
  testing::TempDir tmp("stress-test");
  std::ofstream(tmp.Sub("file")) << "a file, not a directory\n";
  StressOptions o = Short("/bin/true", true);
  o.dir = tmp.Sub("file/run");
  auto r = RunStress(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIOError);
  EXPECT_NE(r.status().message().find("cannot make --dir " + o.dir), std::string::npos)
      << r.status().message();
}

TEST(Stress, AnUnknownRoleIsRefused) {
  StressRoleOptions role;
  role.role = "bogus";
  auto rc = RunStressRole(StressOptions{}, role);
  ASSERT_FALSE(rc.ok());
  EXPECT_EQ(rc.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rc.status().message(), "unknown --role bogus");
}

TEST(Stress, StartLine) {
  StressOptions o;
  o.seconds = 45;
  EXPECT_EQ(StressStartLine(o, 42, "/tmp/x"),
            "kvtier stress: seed 42, 45 s, 3 clients, dir /tmp/x");
}

}  // namespace
}  // namespace kvtier::stress
