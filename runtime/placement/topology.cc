#include "runtime/placement/topology.h"

#include <algorithm>
#include <cstdlib>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe {

absl::StatusOr<Topology> Topology::Create(std::vector<RankInfo> ranks, std::vector<std::string> node_names) {
  if (ranks.empty()) return absl::InvalidArgumentError("topology.ranks: must not be empty");
  if (node_names.empty()) return absl::InvalidArgumentError("topology.nodes: must not be empty");
  Topology t;
  t.ranks_.resize(ranks.size());
  std::vector<bool> seen(ranks.size(), false);
  for (const RankInfo& info : ranks) {
    const int r = info.rank.value();
    if (r < 0 || r >= static_cast<int>(ranks.size()) || seen[r]) {
      return absl::InvalidArgumentError(
          absl::StrCat("topology.ranks: rank ", r, " is duplicated or outside [0, ", ranks.size(), ")"));
    }
    if (info.node.value() < 0 || info.node.value() >= static_cast<int>(node_names.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("topology.ranks[", r, "].node: unknown domain ", info.node.value()));
    }
    seen[r] = true;
    t.ranks_[r] = info;
  }
  t.node_names_ = std::move(node_names);
  t.members_.assign(t.node_names_.size(), {});
  t.relays_.assign(t.node_names_.size(), Rank(-1));
  for (const RankInfo& info : t.ranks_) {
    t.members_[info.node.value()].push_back(info.rank);
    if (info.node_relay) {
      if (t.relays_[info.node.value()].value() >= 0) {
        return absl::InvalidArgumentError(absl::StrCat("topology: node ", t.node_names_[info.node.value()],
                                                       " has two relays (ranks ", t.relays_[info.node.value()].value(),
                                                       " and ", info.rank.value(), ")"));
      }
      t.relays_[info.node.value()] = info.rank;
    }
  }
  for (size_t n = 0; n < t.members_.size(); ++n) {
    if (t.members_[n].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("topology.nodes: node ", t.node_names_[n], " has no ranks"));
    }
    if (t.relays_[n].value() < 0) t.relays_[n] = t.members_[n].front();
  }
  return t;
}

Topology Topology::SingleNode(int num_ranks) {
  std::vector<RankInfo> ranks;
  for (int r = 0; r < num_ranks; ++r) {
    ranks.push_back(RankInfo{Rank(r), TopologyDomainId(0), r, "nic-0", r == 0});
  }
  auto t = Create(std::move(ranks), {"node-0"});
  if (!t.ok()) std::abort();  // invariant: a single node with dense ranks is always valid
  return *std::move(t);
}

absl::StatusOr<Topology> Topology::FromNodeNames(const std::vector<std::string>& node_of_rank) {
  std::vector<RankInfo> ranks;
  std::vector<std::string> names;
  std::vector<int32_t> next_local;
  for (size_t r = 0; r < node_of_rank.size(); ++r) {
    const std::string& name = node_of_rank[r];
    if (name.empty()) return absl::InvalidArgumentError(absl::StrCat("topology.ranks[", r, "].node: empty"));
    const auto it = std::find(names.begin(), names.end(), name);
    const int node = static_cast<int>(it - names.begin());
    if (it == names.end()) {
      names.push_back(name);
      next_local.push_back(0);
    }
    const int32_t local = next_local[node]++;
    ranks.push_back(RankInfo{Rank(static_cast<int32_t>(r)), TopologyDomainId(node), local, "", local == 0});
  }
  return Create(std::move(ranks), std::move(names));
}

int Topology::FindNode(const std::string& name) const {
  for (size_t i = 0; i < node_names_.size(); ++i) {
    if (node_names_[i] == name) return static_cast<int>(i);
  }
  return -1;
}

absl::StatusOr<ProcessGroup> ProcessGroup::Create(ProcessGroupId id, ProcessGroupEpoch epoch, std::vector<Rank> peers) {
  if (id.empty()) return absl::InvalidArgumentError("process_group.id: must not be empty");
  if (peers.empty()) return absl::InvalidArgumentError("process_group.peers: must not be empty");
  ProcessGroup g;
  g.id_ = std::move(id);
  g.epoch_ = epoch;
  int max_rank = -1;
  for (Rank r : peers) {
    if (r.value() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("process_group.peers: negative rank ", r.value()));
    }
    if (r.value() > ProcessGroup::kMaxGroupRank) {
      // The rank -> slot table is sized by the largest rank.
      return absl::InvalidArgumentError(absl::StrCat("process_group.peers: rank ", r.value(),
                                                     " above the largest group rank ", ProcessGroup::kMaxGroupRank));
    }
    max_rank = std::max(max_rank, r.value());
  }
  g.slot_of_.assign(max_rank + 1, -1);
  for (size_t i = 0; i < peers.size(); ++i) {
    if (g.slot_of_[peers[i].value()] >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("process_group.peers: rank ", peers[i].value(), " appears twice in ", g.id_.value()));
    }
    g.slot_of_[peers[i].value()] = static_cast<int32_t>(i);
  }
  g.peers_ = std::move(peers);
  return g;
}

ProcessGroup ProcessGroup::Identity(ProcessGroupId id, ProcessGroupEpoch epoch, int n) {
  std::vector<Rank> peers;
  for (int r = 0; r < n; ++r) peers.push_back(Rank(r));
  auto g = Create(std::move(id), epoch, std::move(peers));
  if (!g.ok()) std::abort();  // invariant: identity order over 0..n-1 is always valid
  return *std::move(g);
}

PeerSlot ProcessGroup::SlotOf(Rank r) const {
  if (!Contains(r)) std::abort();  // invariant: callers check membership first
  return PeerSlot(slot_of_[r.value()]);
}

namespace {
std::set<int> RankSet(const std::vector<Rank>& ranks) {
  std::set<int> s;
  for (Rank r : ranks) s.insert(r.value());
  return s;
}
}  // namespace

absl::Status ValidateHierarchicalGroups(const Topology& topology, const ProcessGroup& ep,
                                        const std::vector<ProcessGroup>& node_groups, const ProcessGroup& relays) {
  std::set<int> all;
  for (int r = 0; r < topology.num_ranks(); ++r) all.insert(r);
  if (RankSet(ep.peers()) != all) {
    return absl::FailedPreconditionError(
        absl::StrCat("process group ", ep.id().value(), " does not cover exactly the topology's ranks"));
  }
  if (static_cast<int>(node_groups.size()) != topology.num_nodes()) {
    return absl::FailedPreconditionError(
        absl::StrCat("expected one node-local group per node (", topology.num_nodes(), "), got ", node_groups.size()));
  }
  std::set<int> relay_ranks;
  for (int n = 0; n < topology.num_nodes(); ++n) {
    const ProcessGroup& local = node_groups[n];
    const TopologyDomainId node(n);
    if (local.epoch() != ep.epoch()) {
      return absl::FailedPreconditionError(absl::StrCat("process group ", local.id().value(), " has epoch ",
                                                        local.epoch().value(), ", expected ", ep.epoch().value()));
    }
    if (RankSet(local.peers()) != RankSet(topology.MembersOf(node))) {
      return absl::FailedPreconditionError(absl::StrCat("process group ", local.id().value(),
                                                        " crosses the boundary of node ", topology.NodeName(node)));
    }
    if (!local.Contains(topology.RelayOf(node))) {
      return absl::FailedPreconditionError(
          absl::StrCat("relay of node ", topology.NodeName(node), " is not a member of ", local.id().value()));
    }
    relay_ranks.insert(topology.RelayOf(node).value());
  }
  if (relays.epoch() != ep.epoch()) {
    return absl::FailedPreconditionError(absl::StrCat("process group ", relays.id().value(), " has epoch ",
                                                      relays.epoch().value(), ", expected ", ep.epoch().value()));
  }
  if (RankSet(relays.peers()) != relay_ranks) {
    return absl::FailedPreconditionError(
        absl::StrCat("process group ", relays.id().value(), " must contain exactly the node relays"));
  }
  return absl::OkStatus();
}

}  // namespace moe
