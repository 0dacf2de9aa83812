// The NFS env against a real NFS server on loopback (scripts/nfs-server.sh): every Env and File
// operation, checked from the server's side through the export's local directory.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "kvtier/io.h"
#include "testing/nfs_target.h"

namespace kvtier {
namespace {

std::vector<uint8_t> Pattern(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::string ReadLocal(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::unique_ptr<Env> MustEnv(const std::string& url, int connections = 2) {
  NfsEnvOptions o;
  o.url = url;
  o.connections = connections;
  auto env = NewNfsEnv(o);
  EXPECT_TRUE(env.ok()) << env.status().ToString();
  return env.ok() ? std::move(*env) : nullptr;
}

TEST(NfsUrlTest, MalformedUrlsAreRefusedWithTheReason) {
  for (const char* url : {"nfs://", "nfs:///export", "nfs://host", "nfs://host:2049/export",
                          "nfs://host/export?version=4", "http://host/export"}) {
    NfsEnvOptions o;
    o.url = url;
    auto env = NewNfsEnv(o);
    ASSERT_FALSE(env.ok()) << url;
    EXPECT_EQ(env.status().code(), StatusCode::kInvalidArgument) << env.status().ToString();
    EXPECT_NE(env.status().message().find(url), std::string::npos) << env.status().ToString();
  }
  EXPECT_TRUE(IsNfsUrl("nfs://h/e"));
  EXPECT_FALSE(IsNfsUrl("/mnt/nfs"));
}

TEST(NfsEnvTest, UnreachableServerIsUnavailable) {
  NfsEnvOptions o;
  o.url = "nfs://127.0.0.3/export";  // loopback, but nothing listens there
  o.rpc_timeout = std::chrono::seconds(2);
  auto start = std::chrono::steady_clock::now();
  auto env = NewNfsEnv(o);
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), StatusCode::kUnavailable) << env.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

TEST(NfsEnvTest, AnExportTheServerDoesNotHaveIsNotFound) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-env");  // a server is there
  const std::string url = dir->url();
  const std::string server = url.substr(0, url.find('/', 6));  // nfs://host
  NfsEnvOptions o;
  o.url = server + "/no-such-export/kv";
  auto env = NewNfsEnv(o);
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), StatusCode::kNotFound) << env.status().ToString();
}

TEST(NfsEnvTest, FilesRoundTripAndTheServerSeesTheSameBytes) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-env");
  auto env = MustEnv(dir->url());
  ASSERT_NE(env, nullptr);
  EXPECT_NE(env->io_engine_name().find("nfs"), std::string::npos);

  // Several pieces (the server's wsize is at most 1 MiB) and a length that is not a multiple of
  // anything, so the last piece is short.
  const size_t n = (5u << 20) + 12345;
  auto data = Pattern(n, 7);
  const std::string path = dir->url() + "/a/b/file";
  ASSERT_TRUE(env->CreateDirs(dir->url() + "/a/b").ok());
  ASSERT_TRUE(env->CreateDirs(dir->url() + "/a/b").ok());  // exists already: fine
  {
    OpenOptions w;
    w.write = w.create = w.exclusive = true;
    auto f = env->Open(path, w);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_TRUE((*f)->direct());
    IoOp op = IoOp::Write(0, data);
    ASSERT_TRUE(WriteExact(**f, {&op, 1}).ok());
    ASSERT_TRUE((*f)->Sync().ok());
    auto size = (*f)->Size();
    ASSERT_TRUE(size.ok());
    EXPECT_EQ(*size, n);
  }
  EXPECT_EQ(ReadLocal(dir->local() + "/a/b/file"), std::string(data.begin(), data.end()));

  // Exclusive create of an existing file fails; without exclusive it opens.
  OpenOptions w;
  w.write = w.create = w.exclusive = true;
  EXPECT_FALSE(env->Open(path, w).ok());

  // Read back in two ops, one of them past the end of the file (a short result, not an error).
  auto f = env->Open(path, OpenOptions{});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  std::vector<uint8_t> a(3u << 20), b(4u << 20);
  IoOp ops[2] = {IoOp::Read(0, a), IoOp::Read(3u << 20, b)};
  ASSERT_TRUE((*f)->Submit(ops).ok());
  EXPECT_EQ(ops[0].result, static_cast<int64_t>(a.size()));
  EXPECT_EQ(ops[1].result, static_cast<int64_t>(n - (3u << 20)));
  EXPECT_TRUE(std::equal(a.begin(), a.end(), data.begin()));
  EXPECT_TRUE(std::equal(b.begin(), b.begin() + (n - a.size()), data.begin() + a.size()));
  // ReadExact past the end is "unexpected end of file".
  IoOp past = IoOp::Read(0, b);
  std::vector<uint8_t> big(n + 4096);
  past = IoOp::Read(0, big);
  EXPECT_EQ(ReadExact(**f, {&past, 1}).code(), StatusCode::kCorruption);

  // Written on the server's side, read over NFS.
  std::ofstream(dir->local() + "/local-file", std::ios::binary) << "written by the server's host";
  auto g = env->Open(dir->url() + "/local-file", OpenOptions{});
  ASSERT_TRUE(g.ok());
  std::vector<uint8_t> buf(28);
  IoOp r = IoOp::Read(0, buf);
  ASSERT_TRUE(ReadExact(**g, {&r, 1}).ok());
  EXPECT_EQ(std::string(buf.begin(), buf.end()), "written by the server's host");
}

TEST(NfsEnvTest, MetadataOperations) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-env");
  auto env = MustEnv(dir->url(), 3);
  ASSERT_NE(env, nullptr);
  const std::string d = dir->url() + "/x/y/z";
  ASSERT_TRUE(env->CreateDirs(d).ok());
  EXPECT_TRUE(std::filesystem::is_directory(dir->local() + "/x/y/z"));

  OpenOptions w;
  w.write = w.create = true;
  ASSERT_TRUE(env->Open(d + "/one.tmp", w).ok());
  ASSERT_TRUE(env->Rename(d + "/one.tmp", d + "/one").ok());
  EXPECT_TRUE(std::filesystem::exists(dir->local() + "/x/y/z/one"));
  EXPECT_EQ(env->Stat(d + "/one.tmp").status().code(), StatusCode::kNotFound);
  auto info = env->Stat(d + "/one");
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->is_regular);
  EXPECT_FALSE(info->is_directory);
  EXPECT_GT(info->mtime_ns, 0);
  auto dinfo = env->Stat(d);
  ASSERT_TRUE(dinfo.ok());
  EXPECT_TRUE(dinfo->is_directory);

  auto list = env->List(dir->url() + "/x/y");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "z");
  EXPECT_EQ((*list)[0].type, DirEntry::Type::kDirectory);
  list = env->List(d);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].type, DirEntry::Type::kFile);

  EXPECT_TRUE(env->SyncDir(d).ok());
  EXPECT_FALSE(env->RemoveDir(d).ok());  // not empty
  ASSERT_TRUE(env->Unlink(d + "/one").ok());
  EXPECT_EQ(env->Unlink(d + "/one").code(), StatusCode::kNotFound);
  ASSERT_TRUE(env->RemoveDir(d).ok());
  EXPECT_FALSE(std::filesystem::exists(dir->local() + "/x/y/z"));

  EXPECT_EQ(env->Open(dir->url() + "/absent", OpenOptions{}).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(env->List(dir->url() + "/absent").status().code(), StatusCode::kNotFound);
  // Paths outside the mounted export are refused, not resolved somewhere else.
  EXPECT_EQ(env->Stat("nfs://127.0.0.1/elsewhere/x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(env->Stat("/tmp").status().code(), StatusCode::kInvalidArgument);
}

TEST(NfsEnvTest, OnlyRegularFilesOpen) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-env");
  auto env = MustEnv(dir->url());
  ASSERT_NE(env, nullptr);
  std::filesystem::create_directory(dir->local() + "/adir");
  ASSERT_EQ(::mkfifo((dir->local() + "/afifo").c_str(), 0644), 0);
  EXPECT_EQ(env->Open(dir->url() + "/adir", OpenOptions{}).status().code(),
            StatusCode::kInvalidArgument);
  auto fifo = env->Open(dir->url() + "/afifo", OpenOptions{});
  ASSERT_FALSE(fifo.ok());
  EXPECT_EQ(fifo.status().code(), StatusCode::kInvalidArgument) << fifo.status().ToString();
  auto list = env->List(dir->url());
  ASSERT_TRUE(list.ok());
  for (const DirEntry& e : *list) {
    if (e.name == "afifo") {
      EXPECT_EQ(e.type, DirEntry::Type::kOther);
    }
  }
}

TEST(NfsEnvTest, AFileRemovedByAnotherHostIsAMissNotWrongData) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-env");
  auto env = MustEnv(dir->url());
  ASSERT_NE(env, nullptr);
  auto data = Pattern(1u << 20, 3);
  std::ofstream(dir->local() + "/f", std::ios::binary)
      .write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  auto f = env->Open(dir->url() + "/f", OpenOptions{});
  ASSERT_TRUE(f.ok());
  std::filesystem::remove(dir->local() + "/f");  // "another host" evicts it
  std::vector<uint8_t> buf(data.size());
  IoOp op = IoOp::Read(0, buf);
  Status s = ReadExact(**f, {&op, 1});
  // The server may still serve the open handle (it holds the inode) or answer ESTALE (a miss):
  // either the right bytes or NotFound, never anything else.
  if (s.ok()) {
    EXPECT_EQ(buf, data);
  } else {
    EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  }
}

TEST(NfsEnvTest, ManyThreadsOnFewConnections) {
  KVTIER_NFS_TEST_DIR(dir, "nfs-env");
  auto env = MustEnv(dir->url(), 2);
  ASSERT_NE(env, nullptr);
  constexpr int kThreads = 6, kFiles = 8;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kFiles; ++i) {
        auto data = Pattern((256u << 10) + 1000 * i, t * 100 + i);
        std::string path = fmt::format("{}/t{}-{}", dir->url(), t, i);
        OpenOptions w;
        w.write = w.create = true;
        auto f = env->Open(path, w);
        if (!f.ok()) {
          ++failures;
          continue;
        }
        IoOp op = IoOp::Write(0, data);
        if (!WriteExact(**f, {&op, 1}).ok() || !(*f)->Sync().ok()) {
          ++failures;
          continue;
        }
        f->reset();
        auto g = env->Open(path, OpenOptions{});
        std::vector<uint8_t> back(data.size());
        IoOp r = IoOp::Read(0, back);
        if (!g.ok() || !ReadExact(**g, {&r, 1}).ok() || back != data) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  auto list = env->List(dir->url());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), static_cast<size_t>(kThreads * kFiles));
}

TEST(NfsEnvTest, OpenEnvForPathPicksTheEnv) {
  auto local = OpenEnvForPath("/tmp");
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(local->env, Env::Default());
  EXPECT_EQ(local->owned, nullptr);
  KVTIER_NFS_TEST_DIR(dir, "nfs-env");
  auto nfs = OpenEnvForPath(dir->url() + "/not/yet/made", nullptr, 1);
  ASSERT_TRUE(nfs.ok()) << nfs.status().ToString();
  EXPECT_NE(nfs->owned, nullptr);
  EXPECT_TRUE(nfs->env->CreateDirs(dir->url() + "/not/yet/made").ok());
  EXPECT_TRUE(std::filesystem::is_directory(dir->local() + "/not/yet/made"));
}

}  // namespace
}  // namespace kvtier
