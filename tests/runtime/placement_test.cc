#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "runtime/exec/dispatch_handle.h"
#include "runtime/placement/manifest.h"
#include "runtime/placement/registry.h"
#include "tests/runtime/fixtures.h"

namespace moe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ManifestTest, ReplicaSetsAndLocalOrder) {
  Topology t = fixture::FourRankTwoNode();
  auto m = fixture::V17(t);
  EXPECT_EQ(m->VersionName(), "placement-v17");
  EXPECT_THAT(m->SlotsOf(LogicalExpertId(0)), ElementsAre(PhysicalSlotId(0), PhysicalSlotId(1)));
  EXPECT_THAT(m->SlotsOf(LogicalExpertId(1)), ElementsAre(PhysicalSlotId(2), PhysicalSlotId(3)));
  EXPECT_THAT(m->LocalSlots(Rank(1)), ElementsAre(PhysicalSlotId(1), PhysicalSlotId(2)));
  EXPECT_EQ(m->LocalIndex(PhysicalSlotId(2)), 1);
  EXPECT_EQ(m->slot(PhysicalSlotId(1)).replica_name, "e0-r1");
  EXPECT_EQ(m->FindSlot("q4"), 4);
  EXPECT_TRUE(VerifyForPublish(*m, fixture::IdentityGroup(), t).ok());
}

// Topology as data (spec 0x07A): the group's node names, one per global rank, in the order the
// nodes were first seen; each node's first rank is its relay.
TEST(TopologyTest, FromNodeNamesGroupsRanksByTheirHosts) {
  auto t = Topology::FromNodeNames({"host-b", "host-a", "host-b", "host-c"});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->num_ranks(), 4);
  EXPECT_EQ(t->num_nodes(), 3);
  EXPECT_EQ(t->NodeName(t->NodeOf(Rank(0))), "host-b");
  EXPECT_EQ(t->NodeOf(Rank(0)), t->NodeOf(Rank(2)));
  EXPECT_NE(t->NodeOf(Rank(0)), t->NodeOf(Rank(1)));
  EXPECT_NE(t->NodeOf(Rank(1)), t->NodeOf(Rank(3)));
  EXPECT_THAT(t->MembersOf(t->NodeOf(Rank(2))), ElementsAre(Rank(0), Rank(2)));
  EXPECT_EQ(t->info(Rank(2)).local_rank, 1);
  EXPECT_EQ(t->RelayOf(t->NodeOf(Rank(2))), Rank(0));
  EXPECT_EQ(t->FindNode("host-c"), t->NodeOf(Rank(3)).value());
  auto empty = Topology::FromNodeNames({"host-a", ""});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(empty.status().message()), HasSubstr("topology.ranks[1].node"));
}

// 0x07I's topology mistakes, refused naming what is wrong: a rank listed twice (one rank in two
// nodes), a rank on a node that does not exist, and two relays on one node.
TEST(TopologyTest, ARankInTwoNodesAndTwoRelaysOnANodeAreRefused) {
  const auto info = [](int r, int node, bool relay) {
    RankInfo i;
    i.rank = Rank(r);
    i.node = TopologyDomainId(node);
    i.node_relay = relay;
    return i;
  };
  ASSERT_TRUE(Topology::Create({info(0, 0, true), info(1, 1, true)}, {"a", "b"}).ok());
  auto twice = Topology::Create({info(0, 0, true), info(0, 1, true)}, {"a", "b"});
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(twice.status().message()), HasSubstr("rank 0 is duplicated"));
  auto nowhere = Topology::Create({info(0, 0, true), info(1, 2, false)}, {"a", "b"});
  EXPECT_THAT(std::string(nowhere.status().message()), HasSubstr("topology.ranks[1].node: unknown domain 2"));
  auto relays = Topology::Create({info(0, 0, true), info(1, 0, true)}, {"a"});
  EXPECT_EQ(relays.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(relays.status().message()), HasSubstr("node a has two relays (ranks 0 and 1)"));
}

// A group's rank -> slot table is sized by its largest rank: one past kMaxGroupRank is refused
// naming the field, not a table of gigabytes.
TEST(TopologyTest, AGroupRankPastTheLimitIsRefused) {
  auto huge = ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(1), {Rank(0), Rank(2147483647)});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("process_group.peers: rank 2147483647"));
  auto largest = ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(1),
                                      {Rank(0), Rank(ProcessGroup::kMaxGroupRank)});
  ASSERT_TRUE(largest.ok()) << largest.status();
  EXPECT_TRUE(largest->Contains(Rank(ProcessGroup::kMaxGroupRank)));
}

// A new epoch rebinds a generation (PlacementManifest::Rebound): the epoch and every slot's node
// follow the group; slots on a lost rank stay while each expert keeps a copy on a member, and an
// expert left without one refuses the epoch, naming it.
TEST(ManifestTest, ReboundFollowsTheEpochAndRefusesAnExpertLeftWithoutACopy) {
  auto v17 = fixture::V17(fixture::FourRankTwoNode());
  const Topology hosts = *Topology::FromNodeNames({"host-a", "host-b", "host-b", "host-c"});
  auto all =
      ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(13), {Rank(0), Rank(1), Rank(2), Rank(3)});
  auto r = v17->Rebound(*all, hosts);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->epoch().value(), 13);
  EXPECT_EQ((*r)->slot(PhysicalSlotId(2)).domain, hosts.NodeOf(Rank(1)));  // rank 1 moved to host-b
  EXPECT_EQ((*r)->slot(PhysicalSlotId(5)).domain, hosts.NodeOf(Rank(3)));

  // Rank 1 lost: experts 0 and 1 keep their copies on ranks 0 and 2.
  auto without1 =
      ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(14), {Rank(0), Rank(2), Rank(3)});
  auto survivors = v17->Rebound(*without1, hosts);
  ASSERT_TRUE(survivors.ok()) << survivors.status();
  EXPECT_EQ((*survivors)->num_slots(), 6);

  // Rank 3 lost: expert 3's only copy was there.
  auto without3 =
      ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(15), {Rank(0), Rank(1), Rank(2)});
  auto refused = v17->Rebound(*without3, hosts);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("logical expert 3 has no replica"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("epoch 15"));
}

TEST(ManifestTest, StructuralErrorsNameTheField) {
  Topology t = fixture::FourRankTwoNode();
  auto slots = fixture::V17Slots();
  slots[2].slot = PhysicalSlotId(1);
  EXPECT_THAT(std::string(PlacementManifest::Create(fixture::Options(17), slots, t).status().message()),
              HasSubstr("physical_slot_id"));
  slots = fixture::V17Slots();
  slots[0].rank = Rank(9);
  EXPECT_THAT(std::string(PlacementManifest::Create(fixture::Options(17), slots, t).status().message()),
              HasSubstr("destination_rank"));
  slots = fixture::V17Slots();
  slots[0].expert = LogicalExpertId(4);
  EXPECT_THAT(std::string(PlacementManifest::Create(fixture::Options(17), slots, t).status().message()),
              HasSubstr("logical_expert_id"));
  // 2^31 - 2 experts would size the expert tables at gigabytes a layer.
  ManifestOptions huge = fixture::Options(17);
  huge.num_experts = 2147483646;
  const absl::Status s = PlacementManifest::Create(huge, fixture::V17Slots(), t).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("placement.num_experts"));
}

// 0x01D1: the four clauses reject four different failures.
TEST(ManifestTest, CompatibilityPredicateHasFourClauses) {
  Topology t = fixture::FourRankTwoNode();
  ProcessGroup g = fixture::IdentityGroup();
  auto slots = fixture::V17Slots();
  slots[1].checkpoint = CheckpointVersion("checkpoint-0041");  // stale replica of expert 0
  slots[3].domain = TopologyDomainId(0);                       // rank 2 is on node-1
  auto m = *PlacementManifest::Create(fixture::Options(17), slots, t);
  EXPECT_EQ(CheckCompatible(LogicalExpertId(0), PhysicalSlotId(0), *m, g, t), Incompatibility::kNone);
  EXPECT_EQ(CheckCompatible(LogicalExpertId(1), PhysicalSlotId(0), *m, g, t), Incompatibility::kWrongExpert);
  EXPECT_EQ(CheckCompatible(LogicalExpertId(0), PhysicalSlotId(1), *m, g, t), Incompatibility::kStaleCheckpoint);
  EXPECT_EQ(CheckCompatible(LogicalExpertId(1), PhysicalSlotId(3), *m, g, t), Incompatibility::kDomainMismatch);
  ProcessGroup three =
      *ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(12), {Rank(0), Rank(1), Rank(2)});
  EXPECT_EQ(CheckCompatible(LogicalExpertId(3), PhysicalSlotId(5), *m, three, t), Incompatibility::kRankOutsideGroup);
  EXPECT_THAT(std::string(VerifyForPublish(*m, g, t).message()), HasSubstr("q1"));
}

TEST(ManifestTest, PublishRequiresEqualReplicaDigests) {
  Topology t = fixture::FourRankTwoNode();
  auto slots = fixture::V17Slots();
  slots[3].parameter_digest = ParameterDigest("expert-1-state-v41");
  auto m = *PlacementManifest::Create(fixture::Options(17), slots, t);
  auto s = VerifyForPublish(*m, fixture::IdentityGroup(), t);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("parameter digest"));
}

// 0x08B: every logical expert has at least one copy; a generation where one has none would
// publish and then fail every step that routes to it, so publishing refuses it, naming it.
TEST(ManifestTest, PublishRequiresACopyOfEveryLogicalExpert) {
  Topology t = fixture::FourRankTwoNode();
  auto slots = fixture::V17Slots();
  slots.pop_back();  // q5, expert 3's only copy
  auto m = PlacementManifest::Create(fixture::Options(17), slots, t);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ((*m)->num_experts(), 4);
  auto s = VerifyForPublish(**m, fixture::IdentityGroup(), t);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("logical expert 3 has no slot"));
}

std::shared_ptr<const PlacementManifest> Version(int64_t v) {
  Topology t = fixture::FourRankTwoNode();
  return *PlacementManifest::Create(fixture::Options(v), fixture::V17Slots(), t);
}

InverseCoordinates Inverse() {
  InverseCoordinates inv;
  inv.token = {0, 0, 1};
  inv.gate = {0.5f, 0.25f, 1.0f};
  inv.num_tokens = 2;
  return inv;
}

absl::Status DriveToExpertOutput(DispatchHandle* h) {
  if (auto s = h->BindPlan(Inverse()); !s.ok()) return s;
  if (auto s = h->MarkDispatchInFlight(); !s.ok()) return s;
  if (auto s = h->MarkExpertRowsReady(); !s.ok()) return s;
  return h->MarkExpertOutputReady();
}

// 0x02B3: the eight-step dispatch/combine generation fence.
TEST(GenerationFenceTest, EightStepFence) {
  GenerationRegistry registry;
  ProcessGroup g = fixture::IdentityGroup();
  FrozenHandoff handoff = *Freeze(fixture::EightRoutes());
  // 1. placement-v17 is active
  ASSERT_TRUE(registry.Prepare(Version(17)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(17)).ok());
  EXPECT_EQ(*registry.State(PlacementVersion(17)), GenerationState::kActive);
  // 2. dispatch-h17 acquires one v17 generation reference
  auto h17 = *DispatchHandle::Acquire(HandleId(17), handoff, &registry, g);
  EXPECT_EQ(h17->placement_version(), PlacementVersion(17));
  EXPECT_EQ(registry.Refcount(PlacementVersion(17)), 1);
  ASSERT_TRUE(DriveToExpertOutput(h17.get()).ok());
  // 3. placement-v18 becomes active for new dispatches; 4. v17 enters DRAINING
  ASSERT_TRUE(registry.Prepare(Version(18)).ok());
  EXPECT_EQ(*registry.State(PlacementVersion(18)), GenerationState::kPrepared);
  ASSERT_TRUE(registry.Activate(PlacementVersion(18)).ok());
  EXPECT_EQ(registry.ActiveVersion(), 18);
  EXPECT_EQ(*registry.State(PlacementVersion(17)), GenerationState::kDraining);
  auto h18 = *DispatchHandle::Acquire(HandleId(18), handoff, &registry, g);
  EXPECT_EQ(h18->placement_version(), PlacementVersion(18));  // new work goes to v18
  // 5. retirement of v17 is denied: refcount = 1
  EXPECT_FALSE(registry.CanRetire(PlacementVersion(17)));
  absl::Status denied = registry.Retire(PlacementVersion(17));
  EXPECT_EQ(denied.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(denied.message()), HasSubstr("refcount = 1"));
  // 6. combine uses dispatch-h17 and v17 metadata (a v18 executor is refused)
  std::vector<float> rows = {1, 2, 3, 4, 5, 6}, out(4, 0.0f);
  EXPECT_EQ(CombineAndRelease(h17.get(), registry, PlacementVersion(18), rows, 2, absl::MakeSpan(out)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(h17->state(), HandleState::kExpertOutputReady);
  EXPECT_THAT(out, ElementsAre(0, 0, 0, 0));
  // 7. the handle releases its generation reference
  ASSERT_TRUE(CombineAndRelease(h17.get(), registry, PlacementVersion(17), rows, 2, absl::MakeSpan(out)).ok());
  EXPECT_THAT(out, ElementsAre(0.5f + 0.75f, 1.0f + 1.0f, 5, 6));
  EXPECT_EQ(h17->state(), HandleState::kReleasable);
  EXPECT_EQ(registry.Refcount(PlacementVersion(17)), 0);
  // 8. retirement of v17 is now allowed
  EXPECT_TRUE(registry.CanRetire(PlacementVersion(17)));
  EXPECT_TRUE(registry.Retire(PlacementVersion(17)).ok());
  EXPECT_EQ(*registry.State(PlacementVersion(17)), GenerationState::kRetired);
  EXPECT_FALSE(registry.RequireLive(PlacementVersion(17)).ok());
  EXPECT_FALSE(registry.Activate(PlacementVersion(17)).ok());
  // The active generation cannot retire.
  EXPECT_FALSE(registry.Retire(PlacementVersion(18)).ok());
}

TEST(DispatchHandleTest, LifetimeIsEnforced) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(17)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(17)).ok());
  FrozenHandoff handoff = *Freeze(fixture::EightRoutes());
  auto h = *DispatchHandle::Acquire(HandleId(1), handoff, &registry, fixture::IdentityGroup());
  std::vector<float> rows(6, 1.0f), out(4, 0.0f);
  // combine before dispatch completes
  ASSERT_TRUE(h->BindPlan(Inverse()).ok());
  ASSERT_TRUE(h->MarkDispatchInFlight().ok());
  absl::Status early = CombineAndRelease(h.get(), registry, PlacementVersion(17), rows, 2, absl::MakeSpan(out));
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(early.message()), HasSubstr("dispatch_in_flight"));
  ASSERT_TRUE(h->MarkExpertRowsReady().ok());
  ASSERT_TRUE(h->MarkExpertOutputReady().ok());
  ASSERT_TRUE(CombineAndRelease(h.get(), registry, PlacementVersion(17), rows, 2, absl::MakeSpan(out)).ok());
  // double combine
  absl::Status twice = CombineAndRelease(h.get(), registry, PlacementVersion(17), rows, 2, absl::MakeSpan(out));
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(twice.message()), HasSubstr("already past"));
  EXPECT_FALSE(h->Release().ok());
  EXPECT_EQ(registry.Refcount(PlacementVersion(17)), 0);
}

// A finished step's handle, Reset, is refilled by the next Acquire (the executor keeps one as a
// spare: no allocation a step): Reset releases its generation reference, and the refilled
// handle starts over (state, id, version, no inverse) on the generation active now.
TEST(DispatchHandleTest, ResetHandleIsRefilledByTheNextAcquire) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(17)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(17)).ok());
  FrozenHandoff handoff = *Freeze(fixture::EightRoutes());
  auto h = *DispatchHandle::Acquire(HandleId(1), handoff, &registry, fixture::IdentityGroup());
  ASSERT_TRUE(DriveToExpertOutput(h.get()).ok());
  EXPECT_EQ(registry.Refcount(PlacementVersion(17)), 1);
  h->Reset();  // a step that ended without its combine: the reference goes with the reset
  EXPECT_EQ(registry.Refcount(PlacementVersion(17)), 0);
  EXPECT_EQ(h->state(), HandleState::kRouterOutput);
  EXPECT_TRUE(h->inverse().token.empty());
  ASSERT_TRUE(registry.Prepare(Version(18)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(18)).ok());
  const DispatchHandle* object = h.get();
  auto again = DispatchHandle::Acquire(HandleId(2), handoff, &registry, fixture::IdentityGroup(), std::move(h));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->get(), object);
  EXPECT_EQ((*again)->id(), HandleId(2));
  EXPECT_EQ((*again)->placement_version(), PlacementVersion(18));
  EXPECT_EQ((*again)->state(), HandleState::kRouterOutput);
  EXPECT_EQ(registry.Refcount(PlacementVersion(18)), 1);
  EXPECT_TRUE(registry.CanRetire(PlacementVersion(17)));
  // A spare that was not reset loses its old reference when refilled.
  auto third = DispatchHandle::Acquire(HandleId(3), handoff, &registry, fixture::IdentityGroup(), std::move(*again));
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(registry.Refcount(PlacementVersion(18)), 1);
  EXPECT_EQ((*third)->id(), HandleId(3));
}

TEST(DispatchHandleTest, RejectsMutatedHandoffAndForeignEpoch) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(17)).ok());
  FrozenHandoff handoff = *Freeze(fixture::EightRoutes());
  EXPECT_EQ(DispatchHandle::Acquire(HandleId(1), handoff, &registry, fixture::IdentityGroup()).status().code(),
            absl::StatusCode::kUnavailable);  // nothing active yet
  ASSERT_TRUE(registry.Activate(PlacementVersion(17)).ok());
  ProcessGroup rebuilt = ProcessGroup::Identity(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(13), 4);
  EXPECT_EQ(DispatchHandle::Acquire(HandleId(2), handoff, &registry, rebuilt).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.Refcount(PlacementVersion(17)), 0);  // the failed acquire left no reference
  handoff.routes.gate[0] = 0.9f;
  EXPECT_EQ(DispatchHandle::Acquire(HandleId(3), handoff, &registry, fixture::IdentityGroup()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(DispatchHandleTest, AbandonedHandleDoesNotPinTheGeneration) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(17)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(17)).ok());
  {
    auto h =
        *DispatchHandle::Acquire(HandleId(5), *Freeze(fixture::EightRoutes()), &registry, fixture::IdentityGroup());
    EXPECT_EQ(registry.Refcount(PlacementVersion(17)), 1);
  }
  EXPECT_EQ(registry.Refcount(PlacementVersion(17)), 0);
}

TEST(RegistryTest, RollbackReactivatesDrainingGeneration) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(17)).ok());
  ASSERT_TRUE(registry.Prepare(Version(18)).ok());
  EXPECT_EQ(registry.Prepare(Version(18)).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.Activate(PlacementVersion(17)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(18)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(17)).ok());  // rollback
  EXPECT_EQ(*registry.State(PlacementVersion(18)), GenerationState::kDraining);
  ASSERT_TRUE(registry.StopDispatch(PlacementVersion(17)).ok());
  EXPECT_EQ(registry.ActiveVersion(), -1);
  EXPECT_EQ(registry.List().size(), 2u);
}

// Once the group re-formed (Rebind), a manifest bound to an earlier epoch is refused: it was
// verified against the group before, and registering it now would serve a stale binding.
TEST(RegistryTest, PrepareAfterARebindNeedsTheNewEpoch) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(17)).ok());
  const std::shared_ptr<const PlacementManifest> old18 = Version(18);
  const Topology hosts = *Topology::FromNodeNames({"host-a", "host-b", "host-b", "host-c"});
  auto epoch13 =
      ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(13), {Rank(0), Rank(1), Rank(2), Rank(3)});
  ASSERT_TRUE(epoch13.ok());
  ASSERT_NE(old18->epoch().value(), 13);
  ASSERT_TRUE(registry.Rebind(*epoch13, hosts).ok());
  const absl::Status stale = registry.Prepare(old18);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(stale.message()), HasSubstr("re-formed as epoch 13"));
  EXPECT_EQ(registry.State(PlacementVersion(18)).status().code(), absl::StatusCode::kNotFound);
  auto bound = old18->Rebound(*epoch13, hosts);
  ASSERT_TRUE(bound.ok()) << bound.status();
  EXPECT_TRUE(registry.Prepare(*bound).ok());
}

// A dispatch handle in flight pins its generation's binding (0x0CB: G_dispatch = G_combine): the
// group cannot re-form under it. Rebind is refused naming the generation, and leaves every
// manifest on its old epoch; once the handle is released it succeeds.
TEST(RegistryTest, RebindWaitsForHandlesInFlight) {
  GenerationRegistry registry;
  ASSERT_TRUE(registry.Prepare(Version(17)).ok());
  ASSERT_TRUE(registry.Activate(PlacementVersion(17)).ok());
  const int64_t before = registry.RequireLive(PlacementVersion(17)).value()->epoch().value();
  const Topology hosts = *Topology::FromNodeNames({"host-a", "host-b", "host-b", "host-c"});
  auto epoch13 =
      ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(13), {Rank(0), Rank(1), Rank(2), Rank(3)});
  ASSERT_TRUE(epoch13.ok());
  ASSERT_NE(before, 13);
  auto lease = registry.AcquireActive(HandleId(7));
  ASSERT_TRUE(lease.ok()) << lease.status();
  const absl::Status held = registry.Rebind(*epoch13, hosts);
  EXPECT_EQ(held.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(held.message()), HasSubstr("placement-v17: 1 dispatch handles still hold it"));
  EXPECT_EQ(registry.RequireLive(PlacementVersion(17)).value()->epoch().value(), before);
  ASSERT_TRUE(lease->Release().ok());
  ASSERT_TRUE(registry.Rebind(*epoch13, hosts).ok());
  EXPECT_EQ(registry.RequireLive(PlacementVersion(17)).value()->epoch().value(), 13);
}

// A prepared generation that never served is forgotten whole; one that served, or a trial holds,
// is not.
TEST(RegistryTest, DiscardForgetsOnlyAPreparedGenerationNoOneHolds) {
  GenerationRegistry registry;
  EXPECT_EQ(registry.Discard(PlacementVersion(5)).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry.Prepare(Version(5)).ok());
  ASSERT_TRUE(registry.Prepare(Version(6)).ok());
  ASSERT_TRUE(registry.Discard(PlacementVersion(5)).ok());
  EXPECT_EQ(registry.State(PlacementVersion(5)).status().code(), absl::StatusCode::kNotFound);
  ASSERT_EQ(registry.List().size(), 1u);
  ASSERT_TRUE(registry.Prepare(Version(5)).ok());  // the version may be prepared again
  {
    auto trial = registry.AcquireTrial(PlacementVersion(6), HandleId(1));
    ASSERT_TRUE(trial.ok()) << trial.status();
    EXPECT_EQ(registry.Discard(PlacementVersion(6)).code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(trial->Release().ok());
  }
  ASSERT_TRUE(registry.Activate(PlacementVersion(6)).ok());
  const absl::Status active = registry.Discard(PlacementVersion(6));
  EXPECT_EQ(active.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(active.message()), testing::HasSubstr("ACTIVE"));
  ASSERT_TRUE(registry.Activate(PlacementVersion(5)).ok());  // 6 drains
  EXPECT_EQ(registry.Discard(PlacementVersion(6)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*registry.State(PlacementVersion(6)), GenerationState::kDraining);
}

}  // namespace
}  // namespace moe
