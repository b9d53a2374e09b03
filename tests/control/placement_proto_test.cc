#include "rpc/placement_proto.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

TEST(PlacementProtoTest, RoundTripsThroughWireFormat) {
  Topology t = fixture::FourRankTwoNode();
  auto m = fixture::V17(t);
  std::string wire;
  ASSERT_TRUE(ManifestToProto(*m, t).SerializeToString(&wire));
  v1::PlacementManifest parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  auto back = ManifestFromProto(parsed, t);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ((*back)->VersionName(), "placement-v17");
  ASSERT_EQ((*back)->num_slots(), 6);
  for (int q = 0; q < 6; ++q) {
    const SlotRecord& a = m->slot(PhysicalSlotId(q));
    const SlotRecord& b = (*back)->slot(PhysicalSlotId(q));
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.expert, b.expert);
    EXPECT_EQ(a.rank, b.rank);
    EXPECT_EQ(a.domain, b.domain);
    EXPECT_EQ(a.replica_name, b.replica_name);
    EXPECT_EQ(a.parameter_digest, b.parameter_digest);
  }
  EXPECT_TRUE(VerifyForPublish(**back, fixture::IdentityGroup(), t).ok());
}

TEST(PlacementProtoTest, RejectsUnknownDomainAndBadVersion) {
  Topology t = fixture::FourRankTwoNode();
  v1::PlacementManifest p = ManifestToProto(*fixture::V17(t), t);
  p.mutable_slots(2)->set_topology_domain("node-7");
  EXPECT_THAT(std::string(ManifestFromProto(p, t).status().message()),
              ::testing::HasSubstr("slots[2].topology_domain"));
  p = ManifestToProto(*fixture::V17(t), t);
  p.set_version(0);
  EXPECT_EQ(ManifestFromProto(p, t).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe
