#include "strata/core/status.h"

#include <cerrno>

#include <gtest/gtest.h>

namespace strata {
namespace {

Result<int> half_of(int x) {
  if (x % 2 != 0) return InvalidArgument("odd");
  return x / 2;
}

Result<int> quarter_of(int x) {
  STRATA_ASSIGN_OR_RETURN(int half, half_of(x));
  STRATA_ASSIGN_OR_RETURN(int quarter, half_of(half));
  return quarter;
}

Status check_even(int x) {
  STRATA_RETURN_IF_ERROR(half_of(x).status());
  return Status::Ok();
}

TEST(Status, OkAndErrorCarryCodeAndMessage) {
  EXPECT_TRUE(Status::Ok().ok());
  Status s = IoError("read /x at offset 4096");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.to_string(), "IoError: read /x at offset 4096");
}

TEST(Status, ContextIsPrepended) {
  Status s = DataLoss("checksum mismatch").with_context("tensor 7");
  EXPECT_EQ(s.message(), "tensor 7: checksum mismatch");
  EXPECT_TRUE(s.is_data_loss());
  EXPECT_TRUE(Status::Ok().with_context("x").ok());
}

TEST(Status, ErrnoMapping) {
  EXPECT_TRUE(ErrnoStatus(EAGAIN, "submit").retryable());
  EXPECT_EQ(ErrnoStatus(ENOSPC, "write").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoStatus(EIO, "read").code(), StatusCode::kIoError);
  EXPECT_NE(ErrnoStatus(ENOENT, "open /nope").message().find("open /nope"), std::string::npos);
}

TEST(Status, ErrnoIsCarriedThroughContext) {
  const Status refused = ErrnoStatus(EINVAL, "write '/x' at offset 0");
  EXPECT_EQ(refused.system_errno(), EINVAL);
  EXPECT_EQ(refused.with_context("checkpoint").system_errno(), EINVAL);            // const&
  EXPECT_EQ(ErrnoStatus(EIO, "read").with_context("layer 3").system_errno(), EIO);  // &&
  EXPECT_EQ(refused.with_context("checkpoint").message().rfind("checkpoint: write '/x'", 0), 0u);
  // Not from a system call: no errno, whatever the message says.
  EXPECT_EQ(InvalidArgument("write '/x': Invalid argument (errno 22)").system_errno(), 0);
  EXPECT_EQ(Status::Ok().system_errno(), 0);
}

TEST(Result, PropagatesThroughMacros) {
  EXPECT_EQ(*quarter_of(8), 2);
  EXPECT_FALSE(quarter_of(6).ok());
  EXPECT_EQ(quarter_of(6).status().message(), "odd");
  EXPECT_TRUE(check_even(4).ok());
  EXPECT_EQ(check_even(3).code(), StatusCode::kInvalidArgument);
}

TEST(ResultDeathTest, ValueOfErrorAborts) {
  EXPECT_DEATH((void)half_of(3).value(), "odd");
}

TEST(CheckDeathTest, FailsInEveryBuild) {
  EXPECT_DEATH(STRATA_CHECK(1 + 1 == 3, "arithmetic broke"), "arithmetic broke");
}

}  // namespace
}  // namespace strata
