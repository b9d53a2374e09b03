// The spec's executable fixtures (0x02B1, 0x03A1, 0x07A, 0x07B) built from their tables.
#ifndef MOE_TESTS_RUNTIME_FIXTURES_H_
#define MOE_TESTS_RUNTIME_FIXTURES_H_

#include <memory>
#include <string>
#include <vector>

#include "runtime/placement/manifest.h"
#include "runtime/placement/topology.h"
#include "runtime/plan/oracle.h"
#include "runtime/semantic.h"

namespace moe::fixture {

// 0x07A: ranks 0,1 on node-0 (relay 0), ranks 2,3 on node-1 (relay 2).
inline Topology FourRankTwoNode() {
  auto t = Topology::Create(
      {
          RankInfo{Rank(0), TopologyDomainId(0), 0, "nic-0", true},
          RankInfo{Rank(1), TopologyDomainId(0), 1, "nic-0", false},
          RankInfo{Rank(2), TopologyDomainId(1), 0, "nic-1", true},
          RankInfo{Rank(3), TopologyDomainId(1), 1, "nic-1", false},
      },
      {"node-0", "node-1"});
  return *t;
}

inline ProcessGroup IdentityGroup() {
  return ProcessGroup::Identity(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(12), 4);
}

// 0x07B: peer slots 0..3 hold global ranks 2, 0, 3, 1.
inline ProcessGroup PeerOrderGroup() {
  return *ProcessGroup::Create(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(12),
                               {Rank(2), Rank(0), Rank(3), Rank(1)});
}

inline SlotRecord Slot(int q, int expert, int replica, int rank, int node,
                       const std::string& checkpoint = "checkpoint-0042") {
  SlotRecord s;
  s.slot = PhysicalSlotId(q);
  s.name = "q" + std::to_string(q);
  s.expert = LogicalExpertId(expert);
  s.replica = ReplicaId(replica);
  s.rank = Rank(rank);
  s.domain = TopologyDomainId(node);
  s.checkpoint = CheckpointVersion(checkpoint);
  s.parameter_digest = ParameterDigest("expert-" + std::to_string(expert) + "-state-v42");
  return s;
}

inline ManifestOptions Options(int64_t version, int experts = 4) {
  ManifestOptions o;
  o.version = PlacementVersion(version);
  o.process_group = ProcessGroupId("ep-group-0");
  o.epoch = ProcessGroupEpoch(12);
  o.checkpoint = CheckpointVersion("checkpoint-0042");
  o.num_experts = experts;
  return o;
}

// 0x02B1: six slots, experts 0 and 1 replicated.
inline std::vector<SlotRecord> V17Slots() {
  return {Slot(0, 0, 0, 0, 0), Slot(1, 0, 1, 1, 0), Slot(2, 1, 0, 1, 0),
          Slot(3, 1, 1, 2, 1), Slot(4, 2, 0, 2, 1), Slot(5, 3, 0, 3, 1)};
}

inline std::shared_ptr<const PlacementManifest> V17(const Topology& t) {
  return *PlacementManifest::Create(Options(17), V17Slots(), t);
}

// 0x03A1: the eight routes, with the frozen physical assignment.
inline SemanticHandoff EightRoutes() {
  SemanticHandoff h;
  h.scope = ExecutionScopeId(1);
  h.num_experts = 4;
  h.top_k = 2;
  h.num_partitions = 4;
  h.Add(Rank(0), 0, 0, LogicalExpertId(0), 0.65f);  // r00
  h.Add(Rank(0), 0, 1, LogicalExpertId(1), 0.35f);  // r01
  h.Add(Rank(0), 1, 0, LogicalExpertId(0), 0.70f);  // r02
  h.Add(Rank(0), 1, 1, LogicalExpertId(2), 0.30f);  // r03
  h.Add(Rank(1), 0, 0, LogicalExpertId(3), 0.58f);  // r04
  h.Add(Rank(1), 0, 1, LogicalExpertId(0), 0.42f);  // r05
  h.Add(Rank(1), 1, 0, LogicalExpertId(1), 0.55f);  // r06
  h.Add(Rank(1), 1, 1, LogicalExpertId(0), 0.45f);  // r07
  return h;
}

inline std::vector<PhysicalSlotId> EightRouteSlots() {
  std::vector<PhysicalSlotId> s;
  for (int q : {0, 2, 1, 4, 5, 0, 3, 1}) s.push_back(PhysicalSlotId(q));
  return s;
}

inline PartitionRows EightRouteHidden() { return {{1, 10, 100, 2, 20, 200}, {3, 30, 300, 4, 40, 400}, {}, {}}; }

inline std::vector<float> TeachingScales() { return {1, 2, 3, 4}; }

}  // namespace moe::fixture

#endif  // MOE_TESTS_RUNTIME_FIXTURES_H_
