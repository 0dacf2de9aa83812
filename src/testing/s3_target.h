// Where tests find the loopback S3 server that scripts/s3-server.sh starts: the bucket's URL
// ($KVTIER_TEST_S3_URL) with the standard AWS_* variables for the endpoint and credentials.
// Tests that need it are skipped without it, unless $KVTIER_REQUIRE_S3=1 (the test command sets
// it): then they fail, so a suite that was promised S3 cannot pass without it.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "kvtier/io.h"

namespace kvtier::testing {

inline bool S3Required() {
  const char* r = std::getenv("KVTIER_REQUIRE_S3");
  return r != nullptr && std::string(r) == "1";
}

inline std::string EnvOr(const char* name, const char* fallback = "") {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

// A fresh prefix in the test bucket (s3://BUCKET/PREFIX-RANDOM), removed afterwards.
class S3TempDir {
 public:
  S3TempDir(const std::string& bucket_url, const std::string& prefix) {
    std::random_device rd;
    url_ = fmt::format("{}/{}-{:08x}{:08x}", bucket_url, prefix, rd(), rd());
    S3EnvOptions o;
    o.url = bucket_url;
    auto env = NewS3Env(o);
    if (!env.ok()) {
      error_ = env.status().ToString();
      return;
    }
    env_ = std::move(*env);
  }
  ~S3TempDir() {
    if (env_ != nullptr) (void)RemoveTree(*env_, url_);
  }
  S3TempDir(const S3TempDir&) = delete;
  S3TempDir& operator=(const S3TempDir&) = delete;

  bool ok() const { return env_ != nullptr; }
  const std::string& error() const { return error_; }
  const std::string& url() const { return url_; }
  // An env over the bucket, for checks from the side.
  Env& env() const { return *env_; }

 private:
  std::string url_, error_;
  std::unique_ptr<Env> env_;
};

// A fresh prefix in the test server's bucket, or null: not configured (a failure when
// required) or the server refuses (a failure). Use KVTIER_S3_TEST_DIR below.
inline std::unique_ptr<S3TempDir> S3TestDir(const std::string& prefix) {
  const std::string url = EnvOr("KVTIER_TEST_S3_URL");
  if (url.empty() || EnvOr("AWS_ENDPOINT_URL").empty()) {
    if (S3Required()) {
      ADD_FAILURE() << "KVTIER_REQUIRE_S3=1 but KVTIER_TEST_S3_URL / AWS_ENDPOINT_URL are not set "
                       "(eval \"$(scripts/s3-server.sh env)\")";
    }
    return nullptr;
  }
  auto dir = std::make_unique<S3TempDir>(url, prefix);
  if (!dir->ok()) {
    ADD_FAILURE() << "the S3 test server refuses: " << dir->error();
    return nullptr;
  }
  return dir;
}

}  // namespace kvtier::testing

// Declares `var`, a S3TempDir in the test server's bucket; skips the test when no server is
// configured (fails when one is required), returns when the server refuses.
#define KVTIER_S3_TEST_DIR(var, prefix)                                           \
  auto var = ::kvtier::testing::S3TestDir(prefix);                                \
  if (!var) {                                                                     \
    if (!::kvtier::testing::S3Required() && !::testing::Test::HasFailure()) {     \
      GTEST_SKIP() << "no S3 test server (eval \"$(scripts/s3-server.sh env)\")"; \
    }                                                                             \
    return;                                                                       \
  }
