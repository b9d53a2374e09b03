// CudaBackend::Load refuses a libmoe_cuda.so of another plugin interface (tests/server/
// fake_cuda_plugin.cc), naming both versions, instead of calling through its vtables.
#include "server/cuda_backend.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

std::vector<std::string> g_plugins;  // newer, older (no version entry point), same version

TEST(CudaBackendTest, APluginOfAnotherInterfaceIsRefused) {
  ASSERT_EQ(g_plugins.size(), 3u);
  auto newer = CudaBackend::Load(g_plugins[0]);
  ASSERT_FALSE(newer.ok());
  EXPECT_EQ(newer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(newer.status().message()),
              ::testing::HasSubstr("plugin interface " + std::to_string(kCudaPluginAbi + 1)));
  auto older = CudaBackend::Load(g_plugins[1]);
  ASSERT_FALSE(older.ok());
  EXPECT_THAT(std::string(older.status().message()), ::testing::HasSubstr("plugin interface 0"));
  // The same version passes the check and is refused for what it lacks.
  auto same = CudaBackend::Load(g_plugins[2]);
  ASSERT_FALSE(same.ok());
  EXPECT_THAT(std::string(same.status().message()), ::testing::HasSubstr("entry points missing"));
  EXPECT_FALSE(CudaBackend::Load("/nonexistent/libmoe_cuda.so").ok());
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  moe::g_plugins.assign(argv + 1, argv + argc);
  return RUN_ALL_TESTS();
}
