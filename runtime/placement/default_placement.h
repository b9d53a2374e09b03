// A deterministic placement for local clusters and tests: logical expert e on rank e % P, plus
// `extra_replicas` copies of experts 0, 1, ... on the rank half the group away (another node in
// a two-node topology). Parameter digests come from the checkpoint's metadata.
#ifndef MOE_RUNTIME_PLACEMENT_DEFAULT_PLACEMENT_H_
#define MOE_RUNTIME_PLACEMENT_DEFAULT_PLACEMENT_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/placement/manifest.h"

namespace moe {

absl::StatusOr<std::shared_ptr<const PlacementManifest>> DefaultPlacement(
    PlacementVersion version, int num_experts, int extra_replicas, const Topology& topology, const ProcessGroup& group,
    const std::map<std::string, std::string>& checkpoint_metadata);

absl::StatusOr<std::shared_ptr<const PlacementManifest>> DefaultPlacement(PlacementVersion version, int num_experts,
                                                                          int extra_replicas, const Topology& topology,
                                                                          const ProcessGroup& group,
                                                                          const CheckpointIdentity& checkpoint);

// A manifest from (logical expert, rank) per physical slot, in slot order; replica ids are
// `replica_ranks` (EPLB's phyrank per slot, 0x08C3: each expert's copies numbered 0..m_e-1 in
// any slot order) or, when it is empty, count the copies of each expert in slot order. Checkpoint version, layers and
// digests come from the checkpoint: a single-layer slot carries the expert's digest (FAILED_PRECONDITION when the
// metadata has none); a multi-layer slot its per-layer digests and their CombinedDigest, both
// empty when the checkpoint records none (the ranks then check nothing across each other).
// EPLB's phy2log becomes a placement this way (slot q on rank q / (Q / P)).
absl::StatusOr<std::shared_ptr<const PlacementManifest>> PlacementFromAssignment(
    PlacementVersion version, int num_experts, const std::vector<std::pair<int, int>>& expert_rank,
    const Topology& topology, const ProcessGroup& group, const CheckpointIdentity& checkpoint,
    const std::vector<int>& replica_ranks = {});
absl::StatusOr<std::shared_ptr<const PlacementManifest>> PlacementFromAssignment(
    PlacementVersion version, int num_experts, const std::vector<std::pair<int, int>>& expert_rank,
    const Topology& topology, const ProcessGroup& group, const std::map<std::string, std::string>& md);

// One assignment per MoE layer of the checkpoint (EPLB's phy2log per layer, in the order of
// checkpoint.layers): a per-layer generation (PlacementManifest::CreateLayered), each slot with
// its expert's digest in its layer. Every layer must put slot q on the same rank.
absl::StatusOr<std::shared_ptr<const PlacementManifest>> LayeredPlacementFromAssignment(
    PlacementVersion version, int num_experts, const std::vector<std::vector<std::pair<int, int>>>& expert_rank,
    const Topology& topology, const ProcessGroup& group, const CheckpointIdentity& checkpoint,
    const std::vector<std::vector<int>>& replica_ranks = {});

// The identity of a single-file checkpoint from its metadata (FAILED_PRECONDITION without a
// version).
absl::StatusOr<CheckpointIdentity> IdentityFromMetadata(const std::map<std::string, std::string>& md, int num_experts);

// The process group moe-rankd forms: "ep-group-0" at `epoch`, peer slot i = rank i.
ProcessGroup LocalClusterGroup(int num_ranks, int64_t epoch);

// P ranks on two nodes of P / 2 (one node when P == 1); the first rank of a node is its relay.
Topology TwoNodeTopology(int num_ranks);

}  // namespace moe

#endif  // MOE_RUNTIME_PLACEMENT_DEFAULT_PLACEMENT_H_
