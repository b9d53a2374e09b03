// A release bundle's topology (control/bundle.h): ParseBundleTopology names the field it refuses;
// CheckBundleNodes compares the nodes a bundle expects with the ones the ranks serve on.
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "control/bundle.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

json::Json BundleWith(json::Json topology) {
  json::Json b;
  b["topology"] = std::move(topology);
  return b;
}

TEST(BundleTopologyTest, ParsesTheWorldAndTheNodesNamingWhatItRefuses) {
  auto t = ParseBundleTopology(BundleWith({{"world", 3}, {"nodes", {"a", "a", "b"}}}));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->world, 3);
  EXPECT_THAT(t->nodes, testing::ElementsAre("a", "a", "b"));
  auto any = ParseBundleTopology(BundleWith({{"world", 2}}));
  ASSERT_TRUE(any.ok());
  EXPECT_TRUE(any->nodes.empty());

  const auto refused = [](json::Json topology) {
    return ParseBundleTopology(BundleWith(std::move(topology))).status();
  };
  EXPECT_THAT(refused({{"world", 0}}).message(), HasSubstr("topology.world: must be in [1, 4096]"));
  EXPECT_THAT(refused({{"world", 5000}}).message(), HasSubstr("topology.world"));
  EXPECT_THAT(refused({{"world", 3}, {"nodes", {"a", "b"}}}).message(),
              HasSubstr("topology.nodes: not a list of 3 node names"));
  EXPECT_THAT(refused({{"world", 2}, {"nodes", "a,b"}}).message(), HasSubstr("topology.nodes"));
  EXPECT_THAT(refused({{"world", 2}, {"nodes", {"a", ""}}}).message(), HasSubstr("topology.nodes[1]"));
  EXPECT_THAT(refused({{"world", 2}, {"nodes", {"a", 7}}}).message(), HasSubstr("topology.nodes[1]"));
  EXPECT_THAT(refused({{"world", 1}, {"nodes", {std::string(254, 'x')}}}).message(),
              HasSubstr("topology.nodes[0]: must be 1 to 253 characters"));
  EXPECT_EQ(ParseBundleTopology(json::Json::object()).status().code(), absl::StatusCode::kInvalidArgument);
}

// The runtime's expert precision: BF16, FP8 or unstated (any); anything else is named.
TEST(BundleRuntimeTest, DtypeIsBf16OrFp8) {
  const auto runtime = [](const char* dtype) {
    json::Json b;
    b["runtime"] = {{"decode_runner", "kernels"}, {"decode_bucket_tokens", 8}, {"decode_bucket_slot_routes", 16}};
    if (dtype != nullptr) b["runtime"]["dtype"] = dtype;
    return ParseBundleRuntime(b);
  };
  ASSERT_TRUE(runtime("FP8").ok());
  EXPECT_EQ(runtime("FP8")->dtype, "FP8");
  EXPECT_EQ(runtime("BF16")->dtype, "BF16");
  EXPECT_EQ(runtime(nullptr)->dtype, "");
  EXPECT_EQ(runtime("INT4").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(runtime("fp8").status().message(), HasSubstr("runtime.dtype: 'fp8'"));
}

// A coordinate the runtime does not read is refused, naming it, not served as if absent: this
// runtime keeps every expert copy whole on one rank (no expert tensor parallelism, 0x0BE).
TEST(BundleRuntimeTest, UnknownCoordinatesAreRefused) {
  json::Json b;
  b["runtime"] = {{"decode_runner", "kernels"}, {"decode_bucket_tokens", 8}, {"decode_bucket_slot_routes", 16}};
  ASSERT_TRUE(ParseBundleRuntime(b).ok());
  b["runtime"]["etp"] = 2;
  absl::Status s = ParseBundleRuntime(b).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("runtime.etp: unknown member (known: decode_runner, "));
  s = ParseBundleTopology(BundleWith({{"world", 2}, {"process_group_generation", "groups-v20-ep2-etp2"}})).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("topology.process_group_generation: unknown member"));
}

TEST(BundleTopologyTest, NodesAreCheckedRankByRank) {
  BundleTopology t;
  t.world = 3;
  t.nodes = {"a", "a", "b"};
  EXPECT_TRUE(CheckBundleNodes(t, {"a", "a", "b"}).ok());
  absl::Status s = CheckBundleNodes(t, {"a", "c", "b"});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("topology.nodes[1]: the bundle expects node a, rank 1 is on c"));
  EXPECT_THAT(CheckBundleNodes(t, {"a", "a", ""}).message(), HasSubstr("rank 2 is on no node"));
  EXPECT_THAT(CheckBundleNodes(t, {"a", "a"}).message(),
              HasSubstr("topology.world: the bundle expects 3 ranks, the process group has 2"));
  BundleTopology any;
  any.world = 2;
  EXPECT_TRUE(CheckBundleNodes(any, {"x", "y"}).ok());
}

}  // namespace
}  // namespace moe
