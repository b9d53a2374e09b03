// SharedRegions: a region belongs to the engine (uid) that registered it.
#include "server/shared_regions.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

class SharedRegionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    name_ = "/moe-regions-test-" + std::to_string(getpid());
    shm_unlink(name_.c_str());
    const int fd = shm_open(name_.c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, kBytes), 0);
    close(fd);
  }
  void TearDown() override { shm_unlink(name_.c_str()); }

  static constexpr uint64_t kBytes = 4096;
  const uid_t me_ = geteuid();
  const uid_t other_ = geteuid() + 1;
  std::string name_;
  SharedRegions regions_;
};

TEST_F(SharedRegionsTest, OnlyAnEngineWithCredentialsRegistersItsOwnObject) {
  absl::Status s = regions_.Register(name_, kBytes, std::nullopt);  // a TCP caller: no uid
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("--engine_socket"));
  s = regions_.Register(name_, kBytes, other_);  // the object is not that uid's
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(s.message(), HasSubstr("not by the caller"));
  EXPECT_EQ(regions_.size(), 0);
  EXPECT_TRUE(regions_.Register(name_, kBytes, me_).ok());
  EXPECT_EQ(regions_.size(), 1);
}

// Why a name could not be opened decides the code: no such object is NOT_FOUND, a symbolic link
// (refused with O_NOFOLLOW) INVALID_ARGUMENT, naming the field either way.
TEST_F(SharedRegionsTest, AnUnopenableNameIsAnsweredByWhy) {
  absl::Status s = regions_.Register(name_ + "-missing", kBytes, me_);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("name: shm_open"));
  const std::string link = name_ + "-link";
  ASSERT_EQ(symlink(("/dev/shm" + name_).c_str(), ("/dev/shm" + link).c_str()), 0) << std::strerror(errno);
  s = regions_.Register(link, kBytes, me_);
  unlink(("/dev/shm" + link).c_str());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("symbolic link"));
  EXPECT_EQ(regions_.size(), 0);
}

TEST_F(SharedRegionsTest, AnotherCallerCanNeitherReadWriteNorDropTheRegion) {
  ASSERT_TRUE(regions_.Register(name_, kBytes, me_).ok());
  const char rows[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_TRUE(regions_.Write(name_, me_, 16, sizeof rows, rows, "output_region").ok());
  char got[8] = {};
  for (const std::optional<uid_t> caller : {std::optional<uid_t>(other_), std::optional<uid_t>()}) {
    absl::Status s = regions_.Read(name_, caller, 16, sizeof got, got, "hidden_region");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("hidden_region.region"));
    s = regions_.Write(name_, caller, 0, sizeof rows, rows, "output_region");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("output_region.region"));
    s = regions_.CheckRange(name_, caller, 0, sizeof rows, "output_region");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    s = regions_.Unregister(name_, caller);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  }
  EXPECT_THAT(regions_.Read(name_, other_, 0, 8, got, "hidden_region").message(),
              HasSubstr("not registered by this caller"));
  // Nothing written by the refused calls; the owner still reads its rows and drops the region.
  ASSERT_TRUE(regions_.Read(name_, me_, 0, sizeof got, got, "hidden_region").ok());
  EXPECT_EQ(std::string(got, sizeof got), std::string(8, '\0'));
  ASSERT_TRUE(regions_.Read(name_, me_, 16, sizeof got, got, "hidden_region").ok());
  EXPECT_EQ(std::memcmp(got, rows, sizeof rows), 0);
  EXPECT_TRUE(regions_.Unregister(name_, me_).ok());
  EXPECT_EQ(regions_.size(), 0);
}

// At the cap, a region whose object was unlinked (its engine gone without unregistering) makes
// room for a new one; one still linked does not, and below the cap an unlinked region stays.
TEST(SharedRegionsCapTest, UnlinkedRegionsAreDroppedAtTheCap) {
  SharedRegions regions(SharedRegionOptions{"/moe-", 2});
  const uid_t me = geteuid();
  std::vector<std::string> names;
  for (int i = 0; i < 4; ++i) {
    names.push_back("/moe-cap-test-" + std::to_string(getpid()) + "-" + std::to_string(i));
    shm_unlink(names.back().c_str());
    const int fd = shm_open(names.back().c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 64), 0);
    close(fd);
  }
  ASSERT_TRUE(regions.Register(names[0], 64, me).ok());
  ASSERT_TRUE(regions.Register(names[1], 64, me).ok());
  EXPECT_EQ(regions.Register(names[2], 64, me).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_EQ(shm_unlink(names[0].c_str()), 0);  // its engine is gone; the rank still holds it
  char got[8];
  EXPECT_TRUE(regions.Read(names[0], me, 0, 8, got, "hidden_region").ok());  // kept until a Register meets the cap
  EXPECT_TRUE(regions.Register(names[2], 64, me).ok());                      // at the cap: the unlinked one makes room
  EXPECT_EQ(regions.size(), 2);
  EXPECT_EQ(regions.Read(names[0], me, 0, 8, got, "hidden_region").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(regions.Read(names[1], me, 0, 8, got, "hidden_region").ok());
  EXPECT_EQ(regions.Register(names[3], 64, me).code(), absl::StatusCode::kResourceExhausted);
  for (const std::string& n : names) shm_unlink(n.c_str());
}

}  // namespace
}  // namespace moe
