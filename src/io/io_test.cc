#include "kvtier/io.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include "io/fault_injection_env.h"
#include "testing/temp_dir.h"

namespace kvtier {
namespace {

void FillRandom(std::span<uint8_t> buf, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= buf.size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(buf.data() + i, &v, 8);
  }
}

std::unique_ptr<Env> MakeEnv(IoEngineKind kind, size_t max_request = 1 << 20) {
  PosixEnvOptions o;
  o.engine = kind;
  o.max_request_bytes = max_request;
  o.max_write_request_bytes = max_request;
  o.queue_depth = 4;
  auto env = NewPosixEnv(o);
  EXPECT_TRUE(env.ok()) << env.status().ToString();
  return std::move(env).value();
}

class EngineTest : public ::testing::TestWithParam<IoEngineKind> {};

TEST_P(EngineTest, DirectWriteThenReadManyPiecesInFlight) {
  testing::TempDir dir;
  auto env = MakeEnv(GetParam(), 256 << 10);
  EXPECT_EQ(env->io_engine_name(), GetParam() == IoEngineKind::kIoUring ? "io_uring" : "threads");
  const std::string path = dir.Sub("f");
  AlignedBuffer a(3 << 20), b(4096), back_a(3 << 20), back_b(4096);
  FillRandom(a.span(), 1);
  FillRandom(b.span(), 2);
  {
    OpenOptions o;
    o.write = o.create = o.exclusive = o.direct = true;
    auto f = env->Open(path, o);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_TRUE((*f)->direct()) << "the test directory must be on a filesystem with O_DIRECT";
    std::vector<IoOp> ops = {IoOp::Write(4096, a.span()), IoOp::Write(0, b.span())};
    ASSERT_TRUE(WriteExact(**f, ops).ok());
    ASSERT_TRUE((*f)->Sync().ok());
    EXPECT_EQ(*(*f)->Size(), (3u << 20) + 4096);
  }
  OpenOptions ro;
  ro.direct = true;
  auto f = env->Open(path, ro);
  ASSERT_TRUE(f.ok());
  std::vector<IoOp> ops = {IoOp::Read(0, back_b.span()), IoOp::Read(4096, back_a.span())};
  ASSERT_TRUE(ReadExact(**f, ops).ok());
  EXPECT_EQ(std::memcmp(a.data(), back_a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(b.data(), back_b.data(), b.size()), 0);

  // Past the end: a clear corruption status, not a hang or a crash.
  AlignedBuffer more(8192);
  IoOp past = IoOp::Read((3u << 20), more.span());
  Status s = ReadExact(**f, std::span<IoOp>(&past, 1));
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();

  // O_DIRECT on ext4 enforces alignment: an unaligned buffer is an error, never a silent bounce.
  IoOp unaligned = IoOp::Read(0, std::span<uint8_t>(more.data() + 1, 4096));
  s = ReadExact(**f, std::span<IoOp>(&unaligned, 1));
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_EQ(env->direct_fallbacks(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Engines, EngineTest,
                         ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kThreadPool),
                         [](const auto& info) {
                           return std::string(info.param == IoEngineKind::kIoUring ? "IoUring"
                                                                                   : "Threads");
                         });

TEST(EnvTest, MetadataOperations) {
  testing::TempDir dir;
  Env* env = Env::Default();
  ASSERT_TRUE(env->CreateDirs(dir.Sub("a/b/c")).ok());
  ASSERT_TRUE(env->CreateDirs(dir.Sub("a/b/c")).ok());  // already there: fine
  OpenOptions o;
  o.write = o.create = true;
  ASSERT_TRUE(env->Open(dir.Sub("a/b/c/x"), o).ok());
  o.exclusive = true;
  EXPECT_FALSE(env->Open(dir.Sub("a/b/c/x"), o).ok());
  EXPECT_TRUE(env->Open(dir.Sub("nope/x"), OpenOptions{}).status().IsNotFound());
  ASSERT_TRUE(env->Rename(dir.Sub("a/b/c/x"), dir.Sub("a/b/c/y")).ok());
  auto list = env->List(dir.Sub("a/b/c"));
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "y");
  EXPECT_EQ((*list)[0].type, DirEntry::Type::kFile);
  auto info = env->Stat(dir.Sub("a/b/c/y"));
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->is_regular);
  EXPECT_GT(info->mtime_ns, 0);
  EXPECT_TRUE(env->Stat(dir.Sub("a/b/c/x")).status().IsNotFound());
  EXPECT_TRUE(env->SyncDir(dir.Sub("a/b/c")).ok());
  EXPECT_FALSE(env->RemoveDir(dir.Sub("a/b/c")).ok());  // not empty
  ASSERT_TRUE(env->Unlink(dir.Sub("a/b/c/y")).ok());
  EXPECT_TRUE(env->Unlink(dir.Sub("a/b/c/y")).IsNotFound());
  EXPECT_TRUE(env->RemoveDir(dir.Sub("a/b/c")).ok());
  EXPECT_TRUE(env->List(dir.Sub("missing")).status().IsNotFound());
  EXPECT_EQ(ParseIoEngineKind("io_uring").value(), IoEngineKind::kIoUring);
  EXPECT_FALSE(ParseIoEngineKind("aio").ok());
}

TEST(EnvTest, ExclusiveDirectCreateIsDirectAndStillExclusive) {
  testing::TempDir dir;
  auto env = MakeEnv(IoEngineKind::kThreadPool);
  OpenOptions o;
  o.write = o.create = o.exclusive = o.direct = true;
  auto f = env->Open(dir.Sub("f"), o);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE((*f)->direct()) << "the test directory must be on a filesystem with O_DIRECT";
  // O_DIRECT is really on the descriptor (set after the create): an unaligned write is refused.
  AlignedBuffer buf(8192);
  IoOp unaligned = IoOp::Write(0, std::span<uint8_t>(buf.data() + 1, 4096));
  EXPECT_EQ(WriteExact(**f, std::span<IoOp>(&unaligned, 1)).code(), StatusCode::kIOError);
  IoOp aligned = IoOp::Write(0, buf.span());
  EXPECT_TRUE(WriteExact(**f, std::span<IoOp>(&aligned, 1)).ok());
  auto again = env->Open(dir.Sub("f"), o);  // the file exists: an exclusive create fails
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find(std::strerror(EEXIST)), std::string::npos)
      << again.status().ToString();
  EXPECT_EQ(env->direct_fallbacks(), 0u);
}

// Where a filesystem refuses O_DIRECT, Linux's open(O_CREAT|O_EXCL|O_DIRECT) creates the file
// and then fails with EINVAL; an exclusive create must still succeed there (buffered), once,
// and fail on a file that existed before it. ramfs has no direct I/O, and a user namespace may
// mount one: a child process does, runs the checks and exits with the number of the first one
// that failed. Skipped where the kernel or the sandbox allows no such mount.
TEST(EnvTest, ExclusiveCreateWhereTheFilesystemRefusesODirect) {
  testing::TempDir dir;
  const std::string mnt = dir.Sub("ramfs");
  ASSERT_EQ(::mkdir(mnt.c_str(), 0755), 0);
  constexpr int kSkip = 77;
  const uid_t uid = ::geteuid();
  const gid_t gid = ::getegid();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto write_file = [](const char* path, const std::string& text) {
      int fd = ::open(path, O_WRONLY | O_CLOEXEC);
      if (fd < 0) return false;
      bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
      ::close(fd);
      return ok;
    };
    if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) ::_exit(kSkip);
    (void)write_file("/proc/self/setgroups", "deny");
    if (!write_file("/proc/self/uid_map", fmt::format("0 {} 1", uid)) ||
        !write_file("/proc/self/gid_map", fmt::format("0 {} 1", gid))) {
      ::_exit(kSkip);
    }
    (void)::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr);
    if (::mount("none", mnt.c_str(), "ramfs", 0, nullptr) != 0) ::_exit(kSkip);
    // Only where the kernel shows the behaviour under test (ramfs may one day gain direct I/O).
    const std::string probe = mnt + "/probe";
    int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EINVAL || ::access(probe.c_str(), F_OK) != 0) ::_exit(kSkip);

    PosixEnvOptions eo;
    eo.engine = IoEngineKind::kThreadPool;
    auto env = NewPosixEnv(eo);
    if (!env.ok()) ::_exit(1);
    OpenOptions o;
    o.write = o.create = o.exclusive = o.direct = true;
    auto f = (*env)->Open(mnt + "/f", o);
    if (!f.ok()) ::_exit(2);  // without the fix: EEXIST, on the file this very call created
    if ((*f)->direct()) ::_exit(3);
    if ((*env)->direct_fallbacks() != 1) ::_exit(4);
    AlignedBuffer data(4096), back(4096);
    FillRandom(data.span(), 7);
    IoOp w = IoOp::Write(0, data.span());
    if (!WriteExact(**f, std::span<IoOp>(&w, 1)).ok()) ::_exit(5);
    IoOp r = IoOp::Read(0, back.span());
    if (!ReadExact(**f, std::span<IoOp>(&r, 1)).ok()) ::_exit(6);
    if (std::memcmp(data.data(), back.data(), data.size()) != 0) ::_exit(7);
    f->reset();
    // The file existed before these calls: EEXIST, with O_DIRECT asked for or not.
    auto again = (*env)->Open(mnt + "/f", o);
    if (again.ok() || again.status().message().find(std::strerror(EEXIST)) == std::string::npos) {
      ::_exit(8);
    }
    o.direct = false;
    if ((*env)->Open(mnt + "/f", o).ok()) ::_exit(9);
    auto probe_again = (*env)->Open(probe, o);  // left by the probe's failed open
    if (probe_again.ok()) ::_exit(10);
    ::_exit(0);
  }
  // A bounded wait: a child of a process with threads could, in principle, block on a lock.
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 3000 && (done = ::waitpid(child, &status, WNOHANG)) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "the child did not finish within 30 s";
  }
  ASSERT_EQ(done, child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died, status " << status;
  if (WEXITSTATUS(status) == kSkip) GTEST_SKIP() << "no ramfs mount in a user namespace here";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "check " << WEXITSTATUS(status) << " failed in the child (see the test's _exit codes)";
}

TEST(EnvTest, RejectsBadOptions) {
  PosixEnvOptions o;
  o.queue_depth = 0;
  EXPECT_FALSE(NewPosixEnv(o).ok());
  o = {};
  o.max_request_bytes = 1000;
  EXPECT_FALSE(NewPosixEnv(o).ok());
}

// Writes `data` at offset 0 of a new file through `env`, O_DIRECT.
Status WriteFile(Env* env, const std::string& path, const AlignedBuffer& data, bool sync) {
  OpenOptions o;
  o.write = o.create = o.direct = true;
  KVTIER_ASSIGN_OR_RETURN(auto f, env->Open(path, o));
  IoOp op = IoOp::Write(0, data.span());
  KVTIER_RETURN_IF_ERROR(WriteExact(*f, std::span<IoOp>(&op, 1)));
  return sync ? f->Sync() : Status::Ok();
}

Status ReadFile(Env* env, const std::string& path, const AlignedBuffer& out) {
  OpenOptions o;
  o.direct = true;
  KVTIER_ASSIGN_OR_RETURN(auto f, env->Open(path, o));
  IoOp op = IoOp::Read(0, out.span());
  return ReadExact(*f, std::span<IoOp>(&op, 1));
}

TEST(FaultInjectionTest, ShortTransfersAreCompletedByTheExactHelpers) {
  testing::TempDir dir;
  auto base = MakeEnv(IoEngineKind::kAuto, 64 << 10);
  FaultInjectionOptions fo;
  fo.short_read = fo.short_write = 1.0;
  FaultInjectionEnv env(base.get(), fo);
  AlignedBuffer data(1 << 20), back(1 << 20);
  FillRandom(data.span(), 3);
  ASSERT_TRUE(WriteFile(&env, dir.Sub("f"), data, true).ok());
  ASSERT_TRUE(ReadFile(&env, dir.Sub("f"), back).ok());
  EXPECT_EQ(std::memcmp(data.data(), back.data(), data.size()), 0);
  EXPECT_GT(env.counters().short_reads, 0u);
  EXPECT_GT(env.counters().short_writes, 0u);
}

TEST(FaultInjectionTest, ErrorsBecomeStatuses) {
  testing::TempDir dir;
  AlignedBuffer data(64 << 10), back(64 << 10);
  FaultInjectionOptions fo;
  fo.no_space = 1.0;
  FaultInjectionEnv env(Env::Default(), fo);
  EXPECT_EQ(WriteFile(&env, dir.Sub("f"), data, true).code(), StatusCode::kNoSpace);
  fo = {};
  fo.write_error = 1.0;
  env.SetOptions(fo);
  EXPECT_EQ(WriteFile(&env, dir.Sub("f"), data, true).code(), StatusCode::kIOError);
  fo = {};
  fo.sync_error = 1.0;
  env.SetOptions(fo);
  EXPECT_EQ(WriteFile(&env, dir.Sub("f"), data, true).code(), StatusCode::kIOError);
  env.SetEnabled(false);
  ASSERT_TRUE(WriteFile(&env, dir.Sub("f"), data, true).ok());
  env.SetEnabled(true);
  fo = {};
  fo.read_error = 1.0;
  env.SetOptions(fo);
  EXPECT_EQ(ReadFile(&env, dir.Sub("f"), back).code(), StatusCode::kIOError);
  fo = {};
  fo.metadata_error = 1.0;
  env.SetOptions(fo);
  EXPECT_EQ(ReadFile(&env, dir.Sub("f"), back).code(), StatusCode::kIOError);
  EXPECT_FALSE(env.Rename(dir.Sub("f"), dir.Sub("g")).ok());
  EXPECT_FALSE(env.List(dir.path()).ok());
  auto c = env.counters();
  EXPECT_EQ(c.no_space, 1u);
  EXPECT_EQ(c.write_errors, 1u);
  EXPECT_EQ(c.sync_errors, 1u);
  EXPECT_EQ(c.read_errors, 1u);
  EXPECT_EQ(c.metadata_errors, 3u);
}

TEST(FaultInjectionTest, BitFlipChangesExactlyOneBit) {
  testing::TempDir dir;
  FaultInjectionOptions fo;
  fo.bit_flip = 1.0;
  fo.seed = 7;
  FaultInjectionEnv env(Env::Default(), fo);
  AlignedBuffer data(16 << 10), back(16 << 10);
  FillRandom(data.span(), 4);
  ASSERT_TRUE(WriteFile(&env, dir.Sub("f"), data, true).ok());
  ASSERT_TRUE(ReadFile(&env, dir.Sub("f"), back).ok());
  int bits = 0;
  for (size_t i = 0; i < data.size(); ++i)
    bits += __builtin_popcount(data.data()[i] ^ back.data()[i]);
  EXPECT_EQ(bits, 1);
}

TEST(FaultInjectionTest, SameSeedSameFaults) {
  testing::TempDir dir;
  auto run = [&](uint64_t seed) {
    FaultInjectionOptions fo;
    fo.seed = seed;
    fo.read_error = 0.3;
    FaultInjectionEnv env(Env::Default(), fo);
    env.SetEnabled(false);
    AlignedBuffer data(4096);
    EXPECT_TRUE(WriteFile(&env, dir.Sub("s"), data, true).ok());
    env.SetEnabled(true);
    std::string pattern;
    for (int i = 0; i < 64; ++i) pattern += ReadFile(&env, dir.Sub("s"), data).ok() ? '.' : 'x';
    return pattern;
  };
  EXPECT_EQ(run(11), run(11));
  EXPECT_NE(run(11), run(12));
}

TEST(FaultInjectionTest, CrashDropsUnsyncedDataAndEntries) {
  testing::TempDir dir;
  FaultInjectionEnv env(Env::Default(), FaultInjectionOptions{});
  AlignedBuffer data(8192), back(8192);
  FillRandom(data.span(), 5);
  // Synced data in a synced directory survives.
  ASSERT_TRUE(WriteFile(&env, dir.Sub("durable"), data, true).ok());
  // A durable name whose later writes were not synced loses those writes.
  ASSERT_TRUE(WriteFile(&env, dir.Sub("torn"), data, true).ok());
  ASSERT_TRUE(env.SyncDir(dir.path()).ok());
  // Synced data whose name was never made durable disappears.
  ASSERT_TRUE(WriteFile(&env, dir.Sub("unnamed"), data, true).ok());
  {
    OpenOptions o;
    o.write = o.direct = true;
    auto f = env.Open(dir.Sub("torn"), o);
    ASSERT_TRUE(f.ok());
    AlignedBuffer other(4096);
    FillRandom(other.span(), 6);
    IoOp op = IoOp::Write(4096, other.span());
    ASSERT_TRUE(WriteExact(**f, std::span<IoOp>(&op, 1)).ok());
  }
  ASSERT_TRUE(env.SimulateCrash().ok());
  ASSERT_TRUE(ReadFile(Env::Default(), dir.Sub("durable"), back).ok());
  EXPECT_EQ(std::memcmp(data.data(), back.data(), data.size()), 0);
  EXPECT_TRUE(Env::Default()->Stat(dir.Sub("unnamed")).status().IsNotFound());
  ASSERT_TRUE(ReadFile(Env::Default(), dir.Sub("torn"), back).ok());
  EXPECT_EQ(std::memcmp(data.data(), back.data(), 4096), 0);
  std::vector<uint8_t> zeros(4096, 0);
  EXPECT_EQ(std::memcmp(back.data() + 4096, zeros.data(), 4096), 0);
}

}  // namespace
}  // namespace kvtier
