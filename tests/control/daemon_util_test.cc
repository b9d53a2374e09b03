// WriteFileAtomically (rpc/daemon_util.h) publishes through runtime/transport's PublishFile: the
// file a reader polls for appears whole, wherever the path points; "" writes nothing.
#include "rpc/daemon_util.h"

#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include <sys/socket.h>
#include <sys/un.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

TEST(WriteFileAtomicallyTest, WritesWholeFilesAndReplacesThem) {
  const std::string path = absl::StrCat(TempDir(), "/port");
  WriteFileAtomically(path, "4417");
  EXPECT_EQ(Read(path), "4417");
  WriteFileAtomically(path, "80");
  EXPECT_EQ(Read(path), "80");
  EXPECT_NE(access((path + ".tmp").c_str(), F_OK), 0);  // renamed into place
}

TEST(WriteFileAtomicallyTest, RelativePathIsInTheWorkingDirectory) {
  char cwd[4096];
  ASSERT_NE(getcwd(cwd, sizeof(cwd)), nullptr);
  ASSERT_EQ(chdir(TempDir().c_str()), 0);
  WriteFileAtomically("relative_port", "9000");
  EXPECT_EQ(Read(absl::StrCat(TempDir(), "/relative_port")), "9000");
  ASSERT_EQ(chdir(cwd), 0);
}

TEST(WriteFileAtomicallyTest, EmptyPathAndUnwritableDirectoryAreNoOps) {
  WriteFileAtomically("", "1");                                            // nothing to write to, nothing happens
  WriteFileAtomically(absl::StrCat(TempDir(), "/no-such-dir/port"), "1");  // best effort: logged
  EXPECT_NE(access(absl::StrCat(TempDir(), "/no-such-dir").c_str(), F_OK), 0);
}

}  // namespace
// A datagram socket standing in for systemd's NOTIFY_SOCKET: bound at `path` ("@name":
// abstract), with a receive timeout so a missing message fails instead of hanging.
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM, 0);
    sockaddr_un addr{};
    if (path.size() >= sizeof(addr.sun_path)) {
      ADD_FAILURE() << "socket path too long: " << path;
      return;
    }
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    if (path[0] == '@') addr.sun_path[0] = '\0';
    const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size());
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0) << path;
    timeval tv{2, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~NotifySocket() { close(fd_); }
  std::string Next() {
    char buf[512];
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    return n < 0 ? "<nothing>" : std::string(buf, n);
  }

 private:
  int fd_ = -1;
};

TEST(SdNotifyTest, SendsStatesToAPathOrAnAbstractSocketAndTheWatchdogKeepsPinging) {
  // A socket path has at most 107 bytes: TEST_TMPDIR's can be longer.
  const std::string path = absl::StrCat("/tmp/moe-notify-test-", getpid(), ".sock");
  unlink(path.c_str());
  NotifySocket at_path(path);
  SdNotify(path, "READY=1\nSTATUS=serving");
  EXPECT_EQ(at_path.Next(), "READY=1\nSTATUS=serving");
  const std::string abstract = absl::StrCat("@moe-notify-test-", getpid());
  NotifySocket hidden(abstract);
  SdNotify(abstract, "STOPPING=1");
  EXPECT_EQ(hidden.Next(), "STOPPING=1");
  SdNotify("", "READY=1");  // not under systemd: nothing, no crash

  EXPECT_EQ(SdWatchdogInterval("30000000"), absl::Seconds(15));
  EXPECT_EQ(SdWatchdogInterval(nullptr), absl::ZeroDuration());
  EXPECT_EQ(SdWatchdogInterval("-5"), absl::ZeroDuration());
  EXPECT_EQ(SdWatchdogInterval("soon"), absl::ZeroDuration());
  EXPECT_EQ(StartSdWatchdog(path, absl::ZeroDuration()), nullptr);
  {
    auto dog = StartSdWatchdog(path, absl::Milliseconds(20));
    ASSERT_NE(dog, nullptr);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(at_path.Next(), "WATCHDOG=1") << "ping " << i;
  }
  unlink(path.c_str());
}

}  // namespace moe
