// The S3 env against a real S3-compatible server on loopback (scripts/s3-server.sh: moto, which
// verifies every request's SigV4 signature and the session token), and through S3FaultFront for
// the answers that server never gives (throttling, clock skew, a hang).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <set>

#include "kvtier/io.h"
#include "testing/s3_fault_front.h"
#include "testing/s3_target.h"

namespace kvtier {
namespace {

using testing::EnvOr;
using Clock = std::chrono::steady_clock;

std::vector<uint8_t> Pattern(size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::unique_ptr<Env> MustEnv(S3EnvOptions o) {
  auto env = NewS3Env(o);
  EXPECT_TRUE(env.ok()) << env.status().ToString();
  return env.ok() ? std::move(*env) : nullptr;
}

S3EnvOptions Options(const std::string& url) {
  S3EnvOptions o;
  o.url = url;
  o.connections = 8;
  o.part_bytes = 5u << 20;
  return o;
}

Status WriteFile(Env& env, const std::string& path, std::span<const uint8_t> data,
                 bool sync = true) {
  OpenOptions o;
  o.write = o.create = o.truncate = true;
  KVTIER_ASSIGN_OR_RETURN(auto f, env.Open(path, o));
  IoOp op = IoOp::Write(0, data);
  KVTIER_RETURN_IF_ERROR(WriteExact(*f, std::span<IoOp>(&op, 1)));
  return sync ? f->Sync() : Status::Ok();
}

Result<std::vector<uint8_t>> ReadFile(Env& env, const std::string& path, size_t n,
                                      uint64_t offset = 0) {
  KVTIER_ASSIGN_OR_RETURN(auto f, env.Open(path, OpenOptions{}));
  std::vector<uint8_t> out(n);
  IoOp op = IoOp::Read(offset, out);
  KVTIER_RETURN_IF_ERROR(ReadExact(*f, std::span<IoOp>(&op, 1)));
  return out;
}

TEST(S3UrlTest, MalformedUrlsAreRefusedWithTheReason) {
  for (const char* url :
       {"s3://", "s3://ab", "s3://Upper/x", "s3://b_ucket", "s3://bucket?x=1", "http://bucket/x"}) {
    S3EnvOptions o;
    o.url = url;
    auto env = NewS3Env(o);
    ASSERT_FALSE(env.ok()) << url;
    EXPECT_EQ(env.status().code(), StatusCode::kInvalidArgument) << env.status().ToString();
    EXPECT_NE(env.status().message().find(url), std::string::npos) << env.status().ToString();
  }
  EXPECT_TRUE(IsS3Url("s3://b/k"));
  EXPECT_FALSE(IsS3Url("/mnt/s3"));
  EXPECT_TRUE(IsRemoteUrl("s3://b/k"));
  S3EnvOptions o = Options("s3://bucket/kv");
  o.access_key_id = "AKIAX";
  o.secret_access_key = "x";
  o.addressing = "sideways";
  EXPECT_EQ(NewS3Env(o).status().code(), StatusCode::kInvalidArgument);
  o.addressing = "path";
  o.part_bytes = 1u << 20;  // below S3's minimum part
  EXPECT_EQ(NewS3Env(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(S3EnvTest, NoCredentialsIsRefusedWithTheVariablesToSet) {
  const std::string id = EnvOr("AWS_ACCESS_KEY_ID"), secret = EnvOr("AWS_SECRET_ACCESS_KEY");
  unsetenv("AWS_ACCESS_KEY_ID");
  unsetenv("AWS_SECRET_ACCESS_KEY");
  auto env = NewS3Env(Options("s3://bucket/kv"));
  if (!id.empty()) setenv("AWS_ACCESS_KEY_ID", id.c_str(), 1);
  if (!secret.empty()) setenv("AWS_SECRET_ACCESS_KEY", secret.c_str(), 1);
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(env.status().message().find("AWS_ACCESS_KEY_ID"), std::string::npos);
}

TEST(S3EnvTest, UnreachableEndpointIsUnavailableQuickly) {
  S3EnvOptions o = Options("s3://bucket/kv");
  o.endpoint = "http://127.0.0.3:9";  // loopback, nothing listens
  o.access_key_id = "AKIAX";
  o.secret_access_key = "x";
  o.request_timeout = std::chrono::seconds(3);
  const auto start = Clock::now();
  auto env = NewS3Env(o);
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), StatusCode::kUnavailable) << env.status().ToString();
  EXPECT_NE(env.status().message().find("no S3 server answers"), std::string::npos);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(4));
}

TEST(S3EnvTest, WrongCredentialsAndMissingBucketSayWhatIsWrong) {
  KVTIER_S3_TEST_DIR(dir, "creds");
  S3EnvOptions o = Options(dir->url());
  o.secret_access_key = EnvOr("AWS_SECRET_ACCESS_KEY") + "x";
  auto env = NewS3Env(o);
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(env.status().message().find("SignatureDoesNotMatch"), std::string::npos)
      << env.status().ToString();
  EXPECT_NE(env.status().message().find("AWS_SECRET_ACCESS_KEY"), std::string::npos);

  o = Options(dir->url());
  o.access_key_id = "AKIAUNKNOWNUNKNOWN00";
  env = NewS3Env(o);
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(env.status().message().find("InvalidAccessKeyId"), std::string::npos)
      << env.status().ToString();

  env = NewS3Env(Options("s3://kvtier-no-such-bucket/kv"));
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), StatusCode::kNotFound) << env.status().ToString();
  EXPECT_NE(env.status().message().find("bucket does not exist"), std::string::npos);
}

TEST(S3EnvTest, SessionCredentialsAreSignedWithTheirToken) {
  KVTIER_S3_TEST_DIR(dir, "session");
  const std::string id = EnvOr("KVTIER_TEST_S3_SESSION_ACCESS_KEY_ID");
  if (id.empty()) GTEST_SKIP() << "the test server gave no session credentials";
  S3EnvOptions o = Options(dir->url());
  o.access_key_id = id;
  o.secret_access_key = EnvOr("KVTIER_TEST_S3_SESSION_SECRET_ACCESS_KEY");
  o.session_token = EnvOr("KVTIER_TEST_S3_SESSION_TOKEN");
  auto env = MustEnv(o);
  ASSERT_NE(env, nullptr);
  auto data = Pattern(1000, 1);
  ASSERT_TRUE(WriteFile(*env, dir->url() + "/f", data).ok());
  auto back = ReadFile(*env, dir->url() + "/f", data.size());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, data);

  o.session_token += "x";
  auto bad = NewS3Env(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kPermissionDenied) << bad.status().ToString();
}

TEST(S3EnvTest, FilesAreObjectsAndPrefixesAreDirectories) {
  KVTIER_S3_TEST_DIR(dir, "tree");
  auto env = MustEnv(Options(dir->url()));
  ASSERT_NE(env, nullptr);
  EXPECT_TRUE(env->publishes_at_sync());
  const std::string root = dir->url();
  ASSERT_TRUE(env->CreateDirs(root + "/a/b").ok());
  auto small = Pattern(4096 + 17, 2);
  ASSERT_TRUE(WriteFile(*env, root + "/a/b/one", small).ok());
  ASSERT_TRUE(WriteFile(*env, root + "/a/two", small).ok());
  ASSERT_TRUE(WriteFile(*env, root + "/top", small).ok());

  auto info = env->Stat(root + "/a/b/one");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->is_regular);
  EXPECT_EQ(info->size, small.size());
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  EXPECT_LT(std::abs(now_ns - info->mtime_ns), int64_t{120} * 1000000000);
  auto d = env->Stat(root + "/a");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->is_directory);
  EXPECT_TRUE(env->Stat(root + "/nothing").status().IsNotFound());

  auto top = env->List(root);
  ASSERT_TRUE(top.ok()) << top.status().ToString();
  std::set<std::pair<std::string, DirEntry::Type>> names;
  for (const DirEntry& e : *top) names.insert({e.name, e.type});
  EXPECT_EQ(names, (std::set<std::pair<std::string, DirEntry::Type>>{
                       {"a", DirEntry::Type::kDirectory}, {"top", DirEntry::Type::kFile}}));

  auto tree = env->ListTree(root);
  ASSERT_TRUE(tree.ok()) << tree.status().ToString();
  std::set<std::string> paths;
  for (const TreeEntry& e : *tree) {
    paths.insert(e.path);
    EXPECT_EQ(e.info.size, small.size());
    EXPECT_GT(e.info.mtime_ns, 0);
  }
  EXPECT_EQ(paths, (std::set<std::string>{"a/b/one", "a/two", "top"}));

  ASSERT_TRUE(env->Rename(root + "/top", root + "/a/moved").ok());
  EXPECT_TRUE(env->Stat(root + "/top").status().IsNotFound());
  auto moved = ReadFile(*env, root + "/a/moved", small.size());
  ASSERT_TRUE(moved.ok());
  EXPECT_EQ(*moved, small);

  // Listings of several pages (three objects and a prefix per page here).
  S3EnvOptions paged = Options(dir->url());
  paged.list_page_keys = 3;
  auto penv = MustEnv(paged);
  ASSERT_NE(penv, nullptr);
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(WriteFile(*penv, fmt::format("{}/many/f{}", root, i), small).ok());
  }
  auto many = penv->List(root + "/many");
  ASSERT_TRUE(many.ok()) << many.status().ToString();
  EXPECT_EQ(many->size(), 8u);
  auto deep = penv->ListTree(root);
  ASSERT_TRUE(deep.ok());
  EXPECT_EQ(deep->size(), 11u);
  RemovedCounts many_counts;
  ASSERT_TRUE(RemoveTree(*penv, root + "/many", &many_counts).ok());
  EXPECT_EQ(many_counts.files, 8u);

  ASSERT_TRUE(env->Unlink(root + "/a/moved").ok());
  EXPECT_TRUE(env->Unlink(root + "/a/moved").ok());  // S3 cannot tell: documented
  RemovedCounts counts;
  ASSERT_TRUE(RemoveTree(*env, root, &counts).ok());
  EXPECT_EQ(counts.files, 2u);
  EXPECT_EQ(counts.bytes, 2 * small.size());
  EXPECT_TRUE(env->ListTree(root)->empty());
}

TEST(S3EnvTest, ReadsAreRangedGetsInParallelAndEndOfFileIsShort) {
  KVTIER_S3_TEST_DIR(dir, "reads");
  auto env = MustEnv(Options(dir->url()));
  ASSERT_NE(env, nullptr);
  const std::string path = dir->url() + "/big";
  auto data = Pattern((12u << 20) + 4097, 3);  // three parts of 5 MiB, the last one short
  ASSERT_TRUE(WriteFile(*env, path, data).ok());

  auto f = env->Open(path, OpenOptions{});
  ASSERT_TRUE(f.ok());
  std::vector<uint8_t> head(4096), body(data.size() - 4096);
  std::vector<IoOp> ops = {IoOp::Read(0, head), IoOp::Read(4096, body)};
  struct Recorder final : IoObserver {
    std::vector<std::pair<size_t, uint64_t>> seen;
    bool submitted = false;
    void Submitted() override { submitted = true; }
    void Progress(size_t op, uint64_t bytes) override { seen.push_back({op, bytes}); }
  } recorder;
  ASSERT_TRUE((*f)->Submit(ops, &recorder).ok());
  EXPECT_EQ(ops[0].result, 4096);
  EXPECT_EQ(ops[1].result, static_cast<int64_t>(body.size()));
  EXPECT_TRUE(std::equal(head.begin(), head.end(), data.begin()));
  EXPECT_TRUE(std::equal(body.begin(), body.end(), data.begin() + 4096));
  EXPECT_TRUE(recorder.submitted);
  uint64_t last = 0;  // each op's progress only grows, and ends at its length
  for (auto [op, bytes] : recorder.seen) {
    if (op != 1) continue;
    EXPECT_GT(bytes, last);
    last = bytes;
  }
  EXPECT_EQ(last, body.size());
  auto size = (*f)->Size();
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, data.size());

  // Past the end: a short read, then ReadExact says "unexpected end of file".
  std::vector<uint8_t> over(8192);
  IoOp tail = IoOp::Read(data.size() - 100, over);
  ASSERT_TRUE((*f)->Submit(std::span<IoOp>(&tail, 1)).ok());
  EXPECT_EQ(tail.result, 100);
  EXPECT_EQ(ReadFile(*env, path, 8192, data.size() - 100).status().code(), StatusCode::kCorruption);
  // A missing object opens (nothing is sent) and its first read is NotFound.
  auto missing = ReadFile(*env, dir->url() + "/absent", 10);
  EXPECT_TRUE(missing.status().IsNotFound()) << missing.status().ToString();
}

TEST(S3EnvTest, LargeFilesGoUpInParallelPartsAndUnsyncedFilesNeverAppear) {
  KVTIER_S3_TEST_DIR(dir, "multipart");
  S3EnvOptions o = Options(dir->url());
  o.multipart_threshold = 6u << 20;
  auto env = MustEnv(o);
  ASSERT_NE(env, nullptr);
  auto data = Pattern((17u << 20) + 5, 4);  // four parts
  Status written = WriteFile(*env, dir->url() + "/mp", data);
  ASSERT_TRUE(written.ok()) << written.ToString();
  auto back = ReadFile(*env, dir->url() + "/mp", data.size());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(*back == data);

  ASSERT_TRUE(WriteFile(*env, dir->url() + "/unsynced", data, /*sync=*/false).ok());
  EXPECT_TRUE(env->Stat(dir->url() + "/unsynced").status().IsNotFound());
  // Rewritten in place (no truncation): the old content is the starting point.
  {
    OpenOptions w;
    w.write = true;
    auto f = env->Open(dir->url() + "/mp", w);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    uint8_t x[3] = {1, 2, 3};
    IoOp op = IoOp::Write(10, x);
    ASSERT_TRUE(WriteExact(**f, std::span<IoOp>(&op, 1)).ok());
    ASSERT_TRUE((*f)->Sync().ok());
  }
  back = ReadFile(*env, dir->url() + "/mp", data.size());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  data[10] = 1, data[11] = 2, data[12] = 3;
  EXPECT_TRUE(*back == data);
  OpenOptions ex;
  ex.write = ex.create = ex.exclusive = true;
  EXPECT_FALSE(env->Open(dir->url() + "/mp", ex).ok());
}

TEST(S3EnvTest, BorrowedBuffersAreUploadedInPlaceOrCopiedWhenTheyLeaveGaps) {
  KVTIER_S3_TEST_DIR(dir, "borrow");
  S3EnvOptions o = Options(dir->url());
  o.multipart_threshold = 5u << 20;  // the tiled file goes up in parts cut across the buffers
  auto env = MustEnv(o);
  ASSERT_NE(env, nullptr);
  auto head = Pattern(4096, 7), body = Pattern((6u << 20) + 3, 8);
  OpenOptions w;
  w.write = w.create = w.truncate = w.buffers_outlive_file = true;
  {  // written out of order, tiling the file: uploaded from the two buffers
    auto f = env->Open(dir->url() + "/tiled", w);
    ASSERT_TRUE(f.ok());
    std::vector<IoOp> ops = {IoOp::Write(4096, body), IoOp::Write(0, head)};
    ASSERT_TRUE(WriteExact(**f, ops).ok());
    ASSERT_TRUE((*f)->Sync().ok());
  }
  std::vector<uint8_t> whole(head);
  whole.insert(whole.end(), body.begin(), body.end());
  auto back = ReadFile(*env, dir->url() + "/tiled", whole.size());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(*back == whole);
  {  // a gap (preallocated, never written): copied, the gap zero
    auto f = env->Open(dir->url() + "/gap", w);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->Preallocate(8192 + 100).ok());
    IoOp op = IoOp::Write(8192, std::span<const uint8_t>(body).first(100));
    ASSERT_TRUE(WriteExact(**f, std::span<IoOp>(&op, 1)).ok());
    ASSERT_TRUE((*f)->Sync().ok());
  }
  back = ReadFile(*env, dir->url() + "/gap", 8192 + 100);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(std::all_of(back->begin(), back->begin() + 8192, [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(std::equal(back->begin() + 8192, back->end(), body.begin()));
}

class S3FaultTest : public testing::S3FaultFixture {
 protected:
  S3EnvOptions FrontOptions(const std::string& url,
                            std::chrono::milliseconds timeout = std::chrono::seconds(2)) {
    S3EnvOptions o = S3FaultFixture::FrontOptions(url, timeout);
    o.connections = 8;
    o.part_bytes = 5u << 20;
    return o;
  }
};

TEST_F(S3FaultTest, ThrottlingIsRetriedWithBackoffAndReportedWhenItPersists) {
  KVTIER_S3_TEST_DIR(dir, "throttle");
  // A deadline that leaves the PUT after three refusals' backoff time on a slow machine
  // (retries, not the deadline, end a throttling that persists).
  auto env = MustEnv(FrontOptions(dir->url(), std::chrono::seconds(10)));
  ASSERT_NE(env, nullptr);
  auto data = Pattern(100000, 5);
  front_->Inject(testing::S3FaultFront::Mode::kSlowDown, 3);
  const int before = front_->requests();
  ASSERT_TRUE(WriteFile(*env, dir->url() + "/t", data).ok());
  EXPECT_EQ(front_->injected(), 3);
  EXPECT_EQ(front_->requests() - before, 4);  // three refusals, then the PUT
  auto back = ReadFile(*env, dir->url() + "/t", data.size());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, data);

  front_->Inject(testing::S3FaultFront::Mode::kSlowDown);  // for good
  const auto start = Clock::now();
  Status s = WriteFile(*env, dir->url() + "/t2", data);
  // Four retries (about 1 s of backoff); the bound is generous for a loaded machine.
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("SlowDown"), std::string::npos) << s.ToString();
  auto read = ReadFile(*env, dir->url() + "/t", data.size());
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().code(), StatusCode::kNotFound);  // an error, not a miss
}

TEST_F(S3FaultTest, SkewedClockIsRefusedWithTheReason) {
  KVTIER_S3_TEST_DIR(dir, "skew");
  front_->Inject(testing::S3FaultFront::Mode::kSkewedClock);
  auto env = NewS3Env(FrontOptions(dir->url()));
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(env.status().message().find("RequestTimeTooSkewed"), std::string::npos);
  EXPECT_NE(env.status().message().find("clock"), std::string::npos) << env.status().ToString();
}

TEST_F(S3FaultTest, AHungServerCostsARequestItsDeadlineNotMore) {
  KVTIER_S3_TEST_DIR(dir, "hang");
  auto env = MustEnv(FrontOptions(dir->url()));
  ASSERT_NE(env, nullptr);
  auto data = Pattern(10000, 6);
  ASSERT_TRUE(WriteFile(*env, dir->url() + "/h", data).ok());
  // Hangs far longer than the 2 s deadline (until the next Inject), so that a read that waits
  // for the answer cannot pass for one that gave up at its deadline, however loaded the machine.
  front_->Inject(testing::S3FaultFront::Mode::kHang, -1, std::chrono::seconds(60));
  const auto start = Clock::now();
  auto read = ReadFile(*env, dir->url() + "/h", data.size());
  const auto took = Clock::now() - start;
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), StatusCode::kIOError) << read.status().ToString();
  EXPECT_NE(read.status().message().find("timed out"), std::string::npos)
      << read.status().ToString();
  EXPECT_GE(took, std::chrono::milliseconds(1900));
  EXPECT_LT(took, std::chrono::seconds(20));
  front_->Inject(testing::S3FaultFront::Mode::kPass);  // releases the hung request too
  auto again = ReadFile(*env, dir->url() + "/h", data.size());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, data);
}

}  // namespace
}  // namespace kvtier
