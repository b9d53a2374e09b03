#include "runtime/status.h"

#include <cerrno>

#include "gtest/gtest.h"

namespace moe {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("x must be even");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int h, Half(x));
  ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

absl::Status Check(int x) {
  RETURN_IF_ERROR(Half(x));
  return absl::OkStatus();
}

TEST(StatusTest, AssignOrReturnPropagates) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Check(2).ok());
  EXPECT_FALSE(Check(3).ok());
}

TEST(StatusTest, ErrnoErrorNamesCodeAndExpression) {
  absl::Status s = ErrnoError(ENOENT, "open(path)", "f.cc", 12);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("ENOENT"), std::string::npos);
  EXPECT_NE(s.message().find("open(path)"), std::string::npos);
  EXPECT_NE(s.message().find("f.cc:12"), std::string::npos);
}

TEST(StatusTest, FirstErrorWins) {
  absl::Status first;
  UpdateFirstError(&first, absl::OkStatus());
  UpdateFirstError(&first, absl::InternalError("a"));
  UpdateFirstError(&first, absl::UnavailableError("b"));
  EXPECT_EQ(first.message(), "a");
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

TEST(ExitCodeTest, OneMappingForEveryBinary) {
  EXPECT_EQ(ExitCode(absl::OkStatus()), 0);
  for (const absl::Status& usage :
       {absl::InvalidArgumentError("x"), absl::FailedPreconditionError("x"), absl::NotFoundError("x"),
        absl::AlreadyExistsError("x"), absl::OutOfRangeError("x")}) {
    EXPECT_EQ(ExitCode(usage), kExitUsage) << usage;
  }
  for (const absl::Status& failure :
       {absl::UnavailableError("x"), absl::InternalError("x"), absl::UnauthenticatedError("x"),
        absl::DeadlineExceededError("x"), absl::PermissionDeniedError("x"), absl::AbortedError("x")}) {
    EXPECT_EQ(ExitCode(failure), kExitFailure) << failure;
  }
}

TEST(CheckDeathTest, BrokenInvariantAbortsNamingIt) {
  MOE_CHECK(1 + 1 == 2, "arithmetic");
  EXPECT_DEATH(MOE_CHECK(2 + 2 == 5, "slots sum"), "invariant violated: 2 \\+ 2 == 5: slots sum");
  EXPECT_DEATH(MOE_CHECK(false), "status_test.cc:[0-9]+: invariant violated: false");
}

}  // namespace
}  // namespace moe
