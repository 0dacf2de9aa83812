#include "kvtier/status.h"

#include <gtest/gtest.h>

#include <cerrno>

namespace kvtier {
namespace {

TEST(StatusTest, OkIsCheapAndEmpty) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_FALSE(s.retryable());
}

TEST(StatusTest, CarriesCodeMessageAndRetry) {
  Status s = Status::Rejected("queue full");
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.IsRejected());
  EXPECT_TRUE(s.retryable());
  EXPECT_EQ(s.ToString(), "Rejected: queue full");
  EXPECT_EQ(s.WithContext("store").ToString(), "Rejected: store: queue full");
  EXPECT_TRUE(s.WithContext("store").retryable());
}

TEST(StatusTest, FromErrnoMapsCommonErrors) {
  EXPECT_EQ(Status::FromErrno(ENOSPC, "write").code(), StatusCode::kNoSpace);
  EXPECT_EQ(Status::FromErrno(ENOENT, "open").code(), StatusCode::kNotFound);
  EXPECT_EQ(Status::FromErrno(EIO, "read").code(), StatusCode::kIOError);
  EXPECT_NE(Status::FromErrno(EIO, "read").message().find("read"), std::string::npos);
}

Result<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  KVTIER_ASSIGN_OR_RETURN(int h, Half(x));
  return Half(h);
}

TEST(ResultTest, ValueOrStatus) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), StatusCode::kInvalidArgument);
  // An OK status without a value is itself a bug, reported as such.
  Result<int> r(Status::Ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

// value() of an error is a bug of the caller: it ends the process naming the error, never
// throws a bad_variant_access someone might catch.
TEST(ResultDeathTest, ValueOfAnErrorEndsTheProcessNamingIt) {
  Result<int> r = Status::NotFound("no chunk 42 here");
  EXPECT_DEATH((void)r.value(), "value\\(\\) of a Result that holds an error: .*no chunk 42 here");
}

}  // namespace
}  // namespace kvtier
