#include "runtime/placement/default_placement.h"

#include "absl/strings/str_cat.h"

#include "runtime/checkpoint/expert_checkpoint.h"

namespace moe {

Topology TwoNodeTopology(int num_ranks) {
  const int nodes = num_ranks >= 2 ? 2 : 1;
  const int per_node = (num_ranks + nodes - 1) / nodes;
  std::vector<RankInfo> ranks;
  std::vector<std::string> names;
  for (int n = 0; n < nodes; ++n) names.push_back(absl::StrCat("node-", n));
  for (int r = 0; r < num_ranks; ++r) {
    ranks.push_back(RankInfo{Rank(r), TopologyDomainId(r / per_node), r % per_node, absl::StrCat("nic-", r / per_node),
                             r % per_node == 0});
  }
  return *Topology::Create(std::move(ranks), std::move(names));
}

ProcessGroup LocalClusterGroup(int num_ranks, int64_t epoch) {
  return ProcessGroup::Identity(ProcessGroupId("ep-group-0"), ProcessGroupEpoch(epoch), num_ranks);
}

absl::StatusOr<CheckpointIdentity> IdentityFromMetadata(const std::map<std::string, std::string>& md, int num_experts) {
  auto ckpt = md.find(checkpoint_keys::kVersion);
  if (ckpt == md.end()) return absl::FailedPreconditionError("checkpoint metadata: no 'checkpoint' version");
  CheckpointIdentity id;
  id.version = ckpt->second;
  id.digests.resize(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    auto digest = md.find(checkpoint_keys::Digest(e));
    id.digests[e].push_back(digest == md.end() ? "" : digest->second);
  }
  return id;
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> PlacementFromAssignment(
    PlacementVersion version, int num_experts, const std::vector<std::pair<int, int>>& expert_rank,
    const Topology& topology, const ProcessGroup& group, const std::map<std::string, std::string>& md) {
  auto id = IdentityFromMetadata(md, num_experts);
  if (!id.ok()) return id.status();
  return PlacementFromAssignment(version, num_experts, expert_rank, topology, group, *id);
}

namespace {

// The slots of one assignment. `layer_index` < 0: a slot's digests cover every layer of the
// checkpoint (its per-layer digests and their CombinedDigest; the expert digest of a single-layer
// checkpoint); >= 0: the expert's digest in that layer alone (a per-layer slot table).
absl::StatusOr<std::vector<SlotRecord>> AssignmentSlots(int num_experts,
                                                        const std::vector<std::pair<int, int>>& expert_rank,
                                                        const std::vector<int>& replica_ranks, const Topology& topology,
                                                        const CheckpointIdentity& id, int layer_index) {
  if (!replica_ranks.empty() && replica_ranks.size() != expert_rank.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica_ranks: ", replica_ranks.size(), " for ", expert_rank.size(), " slots"));
  }
  if (static_cast<int>(id.digests.size()) < num_experts) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint has ", id.digests.size(), " experts, the placement ", num_experts));
  }
  std::vector<SlotRecord> slots;
  std::map<int, int> replicas;  // copies placed so far, per expert
  for (const auto& [e, rank] : expert_rank) {
    if (rank < 0 || rank >= topology.num_ranks()) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slots.size(), ": rank ", rank, " outside the topology"));
    }
    if (e < 0 || e >= num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slots.size(), ": expert ", e, " outside the checkpoint"));
    }
    SlotRecord s;
    s.slot = PhysicalSlotId(static_cast<int32_t>(slots.size()));
    s.name = absl::StrCat("q", slots.size());
    s.expert = LogicalExpertId(e);
    // (PlacementManifest::Create checks that each expert's replica ids are 0..m_e-1.)
    s.replica = ReplicaId(replica_ranks.empty() ? replicas[e]++ : replica_ranks[slots.size()]);
    s.rank = Rank(rank);
    s.domain = topology.NodeOf(Rank(rank));
    s.checkpoint = CheckpointVersion(id.version);
    if (layer_index >= 0) {
      s.parameter_digest = ParameterDigest(id.digests[e].at(layer_index));
    } else if (id.layers.empty()) {
      if (id.digests[e].empty() || id.digests[e][0].empty()) {
        return absl::FailedPreconditionError(absl::StrCat("checkpoint has no digest for expert ", e));
      }
      s.parameter_digest = ParameterDigest(id.digests[e][0]);
    } else {
      const std::string combined = CombinedDigest(id.digests[e]);
      if (!combined.empty()) s.layer_digests = id.digests[e];
      s.parameter_digest = ParameterDigest(combined);
    }
    slots.push_back(std::move(s));
  }
  return slots;
}

ManifestOptions OptionsFor(PlacementVersion version, int num_experts, const ProcessGroup& group,
                           const CheckpointIdentity& id) {
  ManifestOptions o;
  o.version = version;
  o.process_group = group.id();
  o.epoch = group.epoch();
  o.checkpoint = CheckpointVersion(id.version);
  o.num_experts = num_experts;
  o.layers = id.layers;
  return o;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const PlacementManifest>> PlacementFromAssignment(
    PlacementVersion version, int num_experts, const std::vector<std::pair<int, int>>& expert_rank,
    const Topology& topology, const ProcessGroup& group, const CheckpointIdentity& id,
    const std::vector<int>& replica_ranks) {
  auto slots = AssignmentSlots(num_experts, expert_rank, replica_ranks, topology, id, -1);
  if (!slots.ok()) return slots.status();
  return PlacementManifest::Create(OptionsFor(version, num_experts, group, id), *std::move(slots), topology);
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> LayeredPlacementFromAssignment(
    PlacementVersion version, int num_experts, const std::vector<std::vector<std::pair<int, int>>>& expert_rank,
    const Topology& topology, const ProcessGroup& group, const CheckpointIdentity& id,
    const std::vector<std::vector<int>>& replica_ranks) {
  if (!replica_ranks.empty() && replica_ranks.size() != expert_rank.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica_ranks: ", replica_ranks.size(), " tables for ", expert_rank.size(), " layers"));
  }
  if (id.layers.empty() || expert_rank.size() != id.layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("placement: ", expert_rank.size(), " per-layer assignments for a ",
                                                   id.layers.size(), "-layer checkpoint"));
  }
  std::vector<std::vector<SlotRecord>> tables;
  for (size_t i = 0; i < expert_rank.size(); ++i) {
    static const std::vector<int> kSlotOrder;
    auto slots = AssignmentSlots(num_experts, expert_rank[i], replica_ranks.empty() ? kSlotOrder : replica_ranks[i],
                                 topology, id, static_cast<int>(i));
    if (!slots.ok()) {
      return absl::Status(slots.status().code(), absl::StrCat("layer ", id.layers[i], ": ", slots.status().message()));
    }
    tables.push_back(*std::move(slots));
  }
  return PlacementManifest::CreateLayered(OptionsFor(version, num_experts, group, id), std::move(tables), topology);
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> DefaultPlacement(
    PlacementVersion version, int num_experts, int extra_replicas, const Topology& topology, const ProcessGroup& group,
    const std::map<std::string, std::string>& md) {
  auto id = IdentityFromMetadata(md, num_experts);
  if (!id.ok()) return id.status();
  return DefaultPlacement(version, num_experts, extra_replicas, topology, group, *id);
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> DefaultPlacement(PlacementVersion version, int num_experts,
                                                                          int extra_replicas, const Topology& topology,
                                                                          const ProcessGroup& group,
                                                                          const CheckpointIdentity& md) {
  const int p = topology.num_ranks();
  std::vector<std::pair<int, int>> expert_rank;
  for (int e = 0; e < num_experts; ++e) expert_rank.emplace_back(e, e % p);
  for (int i = 0; i < extra_replicas; ++i) {
    const int e = i % num_experts;
    expert_rank.emplace_back(e, (e % p + p / 2 + i / num_experts) % p);
  }
  return PlacementFromAssignment(version, num_experts, expert_rank, topology, group, md);
}

}  // namespace moe
