#include "runtime/transport/file_rendezvous.h"

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "tests/transport/process_harness.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(FileRendezvousTest, PublishedFilesComeBackInTheOrderAsked) {
  const std::string dir = testing::FreshDir("rendezvous");
  ASSERT_TRUE(PublishFile(dir, "1.addr", "host-b:2").ok());
  ASSERT_TRUE(PublishFile(dir, "0.addr", "host-a:1").ok());
  auto got = AwaitFiles(dir, {"0.addr", "1.addr"}, absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(*got, ElementsAre("host-a:1", "host-b:2"));
}

TEST(FileRendezvousTest, BinaryContentsSurviveWhole) {
  const std::string dir = testing::FreshDir("rendezvous");
  const std::string id("\0\x01\xff\n\r\0id", 8);
  ASSERT_TRUE(PublishFile(dir, "nccl.id", id).ok());
  auto got = AwaitFiles(dir, {"nccl.id"}, absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)[0], id);
}

TEST(FileRendezvousTest, WaitsForAPeerThatPublishesLater) {
  const std::string dir = testing::FreshDir("rendezvous");
  ASSERT_TRUE(PublishFile(dir, "0.addr", "a").ok());
  std::thread peer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_TRUE(PublishFile(dir, "1.addr", "b").ok());
  });
  auto got = AwaitFiles(dir, {"0.addr", "1.addr"}, absl::Seconds(30));
  peer.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(*got, ElementsAre("a", "b"));
}

TEST(FileRendezvousTest, TimeoutNamesEveryMissingMember) {
  const std::string dir = testing::FreshDir("rendezvous");
  ASSERT_TRUE(PublishFile(dir, "1.addr", "b").ok());
  std::ofstream(dir + "/3.addr");  // empty: not yet published
  auto got = AwaitFiles(dir, {"0.addr", "1.addr", "2.addr", "3.addr"}, absl::Milliseconds(30));
  ASSERT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(got.status().message(), HasSubstr("0.addr, 2.addr, 3.addr not published in " + dir));
  EXPECT_THAT(got.status().message(), Not(HasSubstr("1.addr")));
}

TEST(FileRendezvousTest, PublishingIntoAMissingDirectoryFails) {
  const std::string dir = testing::FreshDir("rendezvous") + "/absent";
  EXPECT_EQ(PublishFile(dir, "0.addr", "a").code(), absl::StatusCode::kUnavailable);
}

TEST(FileRendezvousTest, RendezvousAddressesPublishesAndGathersTheGroup) {
  const std::string dir = testing::FreshDir("rendezvous");
  ASSERT_TRUE(PublishFile(dir, "0.addr", "10.0.0.1:7").ok());
  auto got = RendezvousAddresses(dir, 1, 2, "10.0.0.2:8", absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(*got, ElementsAre("10.0.0.1:7", "10.0.0.2:8"));
}

}  // namespace
}  // namespace moe
