#include "control/placement_proto.h"

#include "absl/strings/str_cat.h"

namespace moe {

v1::PlacementManifest ManifestToProto(const PlacementManifest& m, const Topology& topology) {
  v1::PlacementManifest p;
  p.set_version(m.version().value());
  p.set_process_group_id(m.process_group().value());
  p.set_process_group_epoch(m.epoch().value());
  p.set_checkpoint_version(m.checkpoint().value());
  p.set_num_logical_experts(m.num_experts());
  for (const SlotRecord& s : m.slots()) {
    v1::PhysicalSlot* out = p.add_slots();
    out->set_physical_slot_id(s.slot.value());
    out->set_name(s.name);
    out->set_logical_expert_id(s.expert.value());
    out->set_replica_id(s.replica.value());
    out->set_replica_name(s.replica_name);
    out->set_destination_rank(s.rank.value());
    out->set_topology_domain(topology.NodeName(s.domain));
    out->set_checkpoint_version(s.checkpoint.value());
    out->set_parameter_digest(s.parameter_digest.value());
  }
  return p;
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> ManifestFromProto(const v1::PlacementManifest& p,
                                                                           const Topology& topology) {
  if (p.version() <= 0) return absl::InvalidArgumentError("version: must be positive");
  if (p.process_group_id().empty()) return absl::InvalidArgumentError("process_group_id: must not be empty");
  if (p.checkpoint_version().empty()) return absl::InvalidArgumentError("checkpoint_version: must not be empty");
  ManifestOptions o;
  o.version = PlacementVersion(p.version());
  o.process_group = ProcessGroupId(p.process_group_id());
  o.epoch = ProcessGroupEpoch(p.process_group_epoch());
  o.checkpoint = CheckpointVersion(p.checkpoint_version());
  o.num_experts = p.num_logical_experts();
  std::vector<SlotRecord> slots;
  for (int i = 0; i < p.slots_size(); ++i) {
    const v1::PhysicalSlot& s = p.slots(i);
    SlotRecord r;
    r.slot = PhysicalSlotId(s.physical_slot_id());
    r.name = s.name();
    r.expert = LogicalExpertId(s.logical_expert_id());
    r.replica = ReplicaId(s.replica_id());
    r.replica_name = s.replica_name();
    r.rank = Rank(s.destination_rank());
    const int domain = topology.FindNode(s.topology_domain());
    if (domain < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("slots[", i, "].topology_domain: unknown node '", s.topology_domain(), "'"));
    }
    r.domain = TopologyDomainId(domain);
    r.checkpoint = CheckpointVersion(s.checkpoint_version());
    r.parameter_digest = ParameterDigest(s.parameter_digest());
    slots.push_back(std::move(r));
  }
  return PlacementManifest::Create(o, std::move(slots), topology);
}

}  // namespace moe
