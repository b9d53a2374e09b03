#include "rpc/placement_proto.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "runtime/placement/default_placement.h"
#include "runtime/placement/migration.h"
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

// Four experts in MoE layers 3 and 5, each with a digest per layer.
CheckpointIdentity TwoLayers() {
  CheckpointIdentity id;
  id.version = "checkpoint-0042";
  id.layers = {3, 5};
  for (int e = 0; e < 4; ++e) id.digests.push_back({"d3-" + std::to_string(e), "d5-" + std::to_string(e)});
  return id;
}

// A per-layer generation: every layer's table crosses the wire; the digest covers each table
// (a change in one layer's slot changes it); a table for the wrong layer is refused.
TEST(PlacementProtoTest, PerLayerTablesRoundTripAndAreDigested) {
  Topology t = fixture::FourRankTwoNode();
  const ProcessGroup g = fixture::IdentityGroup();
  const CheckpointIdentity id = TwoLayers();
  const std::vector<std::vector<std::pair<int, int>>> a = {{{0, 0}, {1, 1}, {2, 2}, {3, 3}},
                                                           {{3, 0}, {2, 1}, {1, 2}, {0, 3}}};
  auto m = LayeredPlacementFromAssignment(PlacementVersion(9), 4, a, t, g, id);
  ASSERT_TRUE(m.ok()) << m.status();
  const v1::PlacementManifest p = ManifestToProto(**m, t);
  ASSERT_EQ(p.layer_slots_size(), 2);
  EXPECT_EQ(p.layer_slots(1).layer(), 5);
  EXPECT_EQ(p.layer_slots(1).slots(0).logical_expert_id(), 3);
  EXPECT_EQ(p.layer_slots(1).slots(0).parameter_digest(), "d5-3");
  auto back = ManifestFromProto(p, t);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE((*back)->per_layer());
  EXPECT_EQ((*back)->ForLayer(5)->slot(PhysicalSlotId(0)).expert.value(), 3);
  EXPECT_EQ((*back)->ForLayer(3)->slot(PhysicalSlotId(0)).expert.value(), 0);
  EXPECT_EQ(PlacementDigest(**back), PlacementDigest(**m));
  // A new process-group epoch on other hosts (PlacementManifest::Rebound) is the same placement.
  auto rebound = (*m)->Rebound(
      *ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(40), {Rank(3), Rank(1), Rank(0), Rank(2)}),
      *Topology::FromNodeNames({"host-a", "host-b", "host-c", "host-d"}));
  ASSERT_TRUE(rebound.ok()) << rebound.status();
  EXPECT_EQ((*rebound)->epoch().value(), 40);
  EXPECT_EQ(PlacementDigest(**rebound), PlacementDigest(**m));
  // Another expert in one layer's table: another digest.
  auto other =
      LayeredPlacementFromAssignment(PlacementVersion(9), 4, {a[0], {{3, 0}, {2, 1}, {0, 2}, {1, 3}}}, t, g, id);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(PlacementDigest(**other), PlacementDigest(**m));
  // A table labelled with another layer, or one table short.
  v1::PlacementManifest wrong = p;
  wrong.mutable_layer_slots(1)->set_layer(4);
  EXPECT_THAT(std::string(ManifestFromProto(wrong, t).status().message()),
              ::testing::HasSubstr("layer_slots[1].layer"));
  wrong = p;
  wrong.mutable_layer_slots()->RemoveLast();
  EXPECT_EQ(ManifestFromProto(wrong, t).status().code(), absl::StatusCode::kInvalidArgument);
}

// The 0x08F plan per layer: from a shared table to per-layer tables, a copy is retained only in
// the layers where its slot keeps the expert, and the peak is the sum of the layers' peaks.
TEST(LayeredMigrationTest, RetainsPerLayerAndSumsPeaks) {
  Topology t = fixture::FourRankTwoNode();
  const ProcessGroup g = fixture::IdentityGroup();
  const CheckpointIdentity id = TwoLayers();
  const std::vector<std::pair<int, int>> same = {{0, 0}, {1, 1}, {2, 2}, {3, 3}};
  auto shared = PlacementFromAssignment(PlacementVersion(1), 4, same, t, g, id);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_FALSE((*shared)->per_layer());
  auto layered =
      LayeredPlacementFromAssignment(PlacementVersion(2), 4, {same, {{1, 0}, {0, 1}, {2, 2}, {3, 3}}}, t, g, id);
  ASSERT_TRUE(layered.ok()) << layered.status();
  auto plan = PlanLayeredMigration(**shared, **layered, t, 100);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->per_layer.size(), 2u);
  EXPECT_EQ(plan->per_layer[0].retained_copies, 4);  // layer 3 keeps every slot's expert
  EXPECT_EQ(plan->per_layer[1].retained_copies, 2);  // layer 5 swaps experts 0 and 1
  EXPECT_EQ(plan->per_layer[1].cross_node_copies + plan->per_layer[1].same_node_copies, 2);
  EXPECT_EQ(plan->total.retained_copies, 6);
  EXPECT_EQ(plan->total.peak_bytes, plan->per_layer[0].peak_bytes + plan->per_layer[1].peak_bytes);
  // Different layers: nothing migrates.
  CheckpointIdentity fewer = id;
  fewer.layers = {3};
  for (auto& d : fewer.digests) d.resize(1);
  auto one = PlacementFromAssignment(PlacementVersion(3), 4, same, t, g, fewer);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(PlanLayeredMigration(**shared, **one, t, 100).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace moe
