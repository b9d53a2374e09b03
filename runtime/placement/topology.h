// Topology and process groups (spec 0x07A, 0x07B, 0x07G).
//
// Topology: which node (domain) and GPU-local rank every global rank has, and which rank is
// its node's relay. ProcessGroup: a communicator membership epoch with an explicit peer-slot
// order; split vectors are indexed by peer slot, never by global rank.
//
// Both are immutable after Create() and safe to share across threads.
#ifndef MOE_RUNTIME_PLACEMENT_TOPOLOGY_H_
#define MOE_RUNTIME_PLACEMENT_TOPOLOGY_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/ids.h"

namespace moe {

struct RankInfo {
  Rank rank;
  TopologyDomainId node;
  int32_t local_rank = 0;   // GPU-local rank inside the node
  std::string nic;          // NIC identity ("nic-0"), may be empty
  bool node_relay = false;  // relay of its node in hierarchical schedules
};

class Topology {
 public:
  // `ranks` must list ranks 0..N-1 exactly once each. `node_names[i]` names domain i.
  static absl::StatusOr<Topology> Create(std::vector<RankInfo> ranks, std::vector<std::string> node_names);
  // One node, every rank on it (rank 0 relay).
  static Topology SingleNode(int num_ranks);
  // The topology a process group forms from its members' declarations: rank r on the node named
  // node_of_rank[r] (its host name, or what it was told). Nodes are numbered in the order they
  // first appear by rank, GPU-local ranks count up by rank within a node, and each node's first
  // rank is its relay. INVALID_ARGUMENT naming the rank for an empty name.
  static absl::StatusOr<Topology> FromNodeNames(const std::vector<std::string>& node_of_rank);

  int num_ranks() const { return static_cast<int>(ranks_.size()); }
  int num_nodes() const { return static_cast<int>(node_names_.size()); }
  bool HasRank(Rank r) const { return r.value() >= 0 && r.value() < num_ranks(); }
  const RankInfo& info(Rank r) const { return ranks_[r.value()]; }
  TopologyDomainId NodeOf(Rank r) const { return ranks_[r.value()].node; }
  const std::string& NodeName(TopologyDomainId d) const { return node_names_[d.value()]; }
  // The relay rank of a node; the first rank of the node when none is marked.
  Rank RelayOf(TopologyDomainId node) const { return relays_[node.value()]; }
  const std::vector<Rank>& MembersOf(TopologyDomainId node) const { return members_[node.value()]; }
  // Domain id by name, or -1.
  int FindNode(const std::string& name) const;

 private:
  std::vector<RankInfo> ranks_;
  std::vector<std::string> node_names_;
  std::vector<Rank> relays_;
  std::vector<std::vector<Rank>> members_;
};

class ProcessGroup {
 public:
  // The largest global rank a group may hold (the controller forms worlds of at most 4096).
  static constexpr int kMaxGroupRank = 65535;
  // `peers[i]` is the global rank stored at peer slot i. Ranks must be distinct and in
  // [0, kMaxGroupRank].
  static absl::StatusOr<ProcessGroup> Create(ProcessGroupId id, ProcessGroupEpoch epoch, std::vector<Rank> peers);
  // Identity peer order over ranks 0..n-1.
  static ProcessGroup Identity(ProcessGroupId id, ProcessGroupEpoch epoch, int n);

  const ProcessGroupId& id() const { return id_; }
  ProcessGroupEpoch epoch() const { return epoch_; }
  int size() const { return static_cast<int>(peers_.size()); }
  // pi_G(i): global rank at peer slot i.
  Rank RankAt(PeerSlot i) const { return peers_[i.value()]; }
  bool Contains(Rank r) const {
    return r.value() >= 0 && r.value() < static_cast<int>(slot_of_.size()) && slot_of_[r.value()] >= 0;
  }
  // Peer slot of a member rank; CHECK-fails for non-members (callers test Contains first).
  PeerSlot SlotOf(Rank r) const;
  const std::vector<Rank>& peers() const { return peers_; }

 private:
  ProcessGroupId id_;
  ProcessGroupEpoch epoch_;
  std::vector<Rank> peers_;
  std::vector<int32_t> slot_of_;  // global rank -> peer slot, -1 if not a member
};

// Checks the process-group construction of 0x07G against a topology: the full EP group covers
// every rank; each node-local group equals its node's members and contains the node relay;
// the relay group is exactly the set of node relays; all groups share the EP group's epoch.
absl::Status ValidateHierarchicalGroups(const Topology& topology, const ProcessGroup& ep,
                                        const std::vector<ProcessGroup>& node_groups, const ProcessGroup& relays);

}  // namespace moe

#endif  // MOE_RUNTIME_PLACEMENT_TOPOLOGY_H_
