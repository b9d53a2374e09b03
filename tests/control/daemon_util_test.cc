// WriteFileAtomically (rpc/daemon_util.h) publishes through runtime/transport's PublishFile: the
// file a reader polls for appears whole, wherever the path points; "" writes nothing.
#include "rpc/daemon_util.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

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
}  // namespace moe
