#include "runtime/plan/route_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

#include "runtime/status.h"

namespace moe {

absl::StatusOr<PlanLayout> PlanLayout::Create(std::shared_ptr<const PlacementManifest> manifest, ProcessGroup group) {
  if (manifest == nullptr) return absl::InvalidArgumentError("manifest: null");
  if (manifest->process_group() != group.id() || manifest->epoch() != group.epoch()) {
    return absl::FailedPreconditionError(
        absl::StrCat(manifest->VersionName(), " is bound to ", manifest->process_group().value(), " epoch ",
                     manifest->epoch().value(), ", not ", group.id().value(), " epoch ", group.epoch().value()));
  }
  PlanLayout l;
  const int q_count = manifest->num_slots();
  const int p_count = group.size();
  l.slot_key_.assign(q_count, -1);
  l.slot_peer_.assign(q_count, -1);
  l.peer_key_begin_.assign(p_count + 1, 0);
  // Count slots per peer, then assign keys in (peer, slot id) order: a counting pass.
  for (int q = 0; q < q_count; ++q) {
    const Rank r = manifest->slot(PhysicalSlotId(q)).rank;
    if (group.Contains(r)) {
      l.slot_peer_[q] = group.SlotOf(r).value();
      ++l.peer_key_begin_[l.slot_peer_[q] + 1];
    }
  }
  for (int p = 0; p < p_count; ++p) l.peer_key_begin_[p + 1] += l.peer_key_begin_[p];
  std::vector<int32_t> next(l.peer_key_begin_.begin(), l.peer_key_begin_.end() - 1);
  for (int q = 0; q < q_count; ++q) {
    if (l.slot_peer_[q] >= 0) l.slot_key_[q] = next[l.slot_peer_[q]]++;
  }
  l.manifest_ = std::move(manifest);
  l.group_ = std::move(group);
  return l;
}

absl::Status PlanSource(const PlanLayout& layout, absl::Span<const PhysicalSlotId> route_slots, SourcePlan* plan) {
  const int q_count = layout.num_slots();
  const int p_count = layout.num_peers();
  const int32_t n = static_cast<int32_t>(route_slots.size());
  std::vector<int32_t>& bucket = plan->scratch;
  bucket.assign(q_count + 1, 0);

  // Phase 1: histogram over slot keys.
  for (int32_t i = 0; i < n; ++i) {
    const int q = route_slots[i].value();
    if (q < 0 || q >= q_count) {
      return absl::InvalidArgumentError(
          absl::StrCat("route ", i, ": physical slot ", q, " outside [0, ", q_count, ")"));
    }
    const int32_t key = layout.SlotKey(route_slots[i]);
    if (key < 0) {
      return absl::FailedPreconditionError(absl::StrCat("route ", i, ": slot ",
                                                        layout.manifest().slot(route_slots[i]).name, " lives on rank ",
                                                        layout.manifest().slot(route_slots[i]).rank.value(),
                                                        ", outside process group ", layout.group().id().value()));
    }
    ++bucket[key + 1];
  }
  // Phase 2: exclusive prefix over keys; peer splits are sums of contiguous key ranges.
  for (int k = 0; k < q_count; ++k) bucket[k + 1] += bucket[k];
  plan->send_splits.resize(p_count);
  plan->send_offsets.resize(p_count + 1);
  for (int p = 0; p < p_count; ++p) {
    plan->send_offsets[p] = bucket[layout.PeerKeyBegin(p)];
    plan->send_splits[p] = bucket[layout.PeerKeyBegin(p + 1)] - bucket[layout.PeerKeyBegin(p)];
  }
  plan->send_offsets[p_count] = n;
  // Phase 3: stable scatter. Routes arrive in semantic order, so equal keys keep it.
  plan->send_order.resize(n);
  plan->send_position.resize(n);
  plan->send_slots.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t pos = bucket[layout.SlotKey(route_slots[i])]++;
    plan->send_order[pos] = i;
    plan->send_position[i] = pos;
    plan->send_slots[pos] = route_slots[i];
  }
  return absl::OkStatus();
}

absl::Status PlanDestination(const PlanLayout& layout, Rank self, absl::Span<const int64_t> recv_splits,
                             absl::Span<const PhysicalSlotId> received_slots, DestinationPlan* plan) {
  const PlacementManifest& m = layout.manifest();
  const int p_count = layout.num_peers();
  if (static_cast<int>(recv_splits.size()) != p_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("recv_splits: ", recv_splits.size(), " entries for a group of ", p_count));
  }
  plan->recv_splits.assign(recv_splits.begin(), recv_splits.end());
  plan->recv_offsets.resize(p_count + 1);
  plan->recv_offsets[0] = 0;
  for (int p = 0; p < p_count; ++p) {
    if (recv_splits[p] < 0) return absl::InvalidArgumentError(absl::StrCat("recv_splits[", p, "]: negative"));
    plan->recv_offsets[p + 1] = plan->recv_offsets[p] + recv_splits[p];
  }
  const int32_t n = static_cast<int32_t>(received_slots.size());
  if (plan->recv_offsets[p_count] != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("recv_splits sum to ", plan->recv_offsets[p_count], " but ", n, " rows were received"));
  }
  const auto local = m.LocalSlots(self);
  const int l_count = static_cast<int>(local.size());
  std::vector<int32_t>& bucket = plan->scratch;
  bucket.assign(l_count + 1, 0);
  for (int32_t i = 0; i < n; ++i) {
    const int q = received_slots[i].value();
    if (q < 0 || q >= m.num_slots() || m.slot(received_slots[i]).rank != self) {
      return absl::FailedPreconditionError(
          absl::StrCat("received row ", i, ": physical slot ", q, " is not resident on rank ", self.value()));
    }
    ++bucket[m.LocalIndex(received_slots[i]) + 1];
  }
  plan->expert_counts.resize(l_count);
  plan->expert_offsets.resize(l_count + 1);
  for (int l = 0; l < l_count; ++l) {
    plan->expert_counts[l] = bucket[l + 1];
    bucket[l + 1] += bucket[l];
  }
  for (int l = 0; l <= l_count; ++l) plan->expert_offsets[l] = bucket[l];
  // Arrival order is (source peer, send position); a stable pass by local slot gives
  // (local slot, source peer, send position).
  plan->expert_order.resize(n);
  plan->expert_position.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t pos = bucket[m.LocalIndex(received_slots[i])]++;
    plan->expert_order[pos] = i;
    plan->expert_position[i] = pos;
  }
  return absl::OkStatus();
}

std::vector<int32_t> ClusterPlan::ExpertRoutes(Rank dest) const {
  const DestinationPlan& d = destination[dest.value()];
  std::vector<int32_t> out(d.expert_order.size());
  for (size_t e = 0; e < out.size(); ++e) out[e] = receive_routes[dest.value()][d.expert_order[e]];
  return out;
}

namespace {

// Route checks against the immutable manifest, then grouping by source in semantic order:
// fills the count matrix, destination ranks and per-source routes of `plan`, and each source's
// slots in `source_slots`.
absl::Status GroupBySource(const SemanticHandoff& h, absl::Span<const PhysicalSlotId> slots, const PlanLayout& layout,
                           const Topology& topology, ClusterPlan& plan,
                           std::vector<std::vector<PhysicalSlotId>>& source_slots) {
  const PlacementManifest& m = layout.manifest();
  const ProcessGroup& g = layout.group();
  const int p_count = plan.num_ranks;
  for (int32_t r = 0; r < h.size(); ++r) {
    if (!h.admitted[r]) continue;
    const Rank src = h.origin[r];
    if (!topology.HasRank(src) || !g.Contains(src)) {
      return absl::FailedPreconditionError(
          absl::StrCat("route ", r, ": source rank ", src.value(), " is not a member of ", g.id().value()));
    }
    const int q = slots[r].value();
    if (q < 0 || q >= m.num_slots()) {
      return absl::InvalidArgumentError(
          absl::StrCat("route ", r, ": physical slot ", q, " is not in ", m.VersionName()));
    }
    const Incompatibility why = CheckCompatible(h.expert[r], slots[r], m, g, topology);
    if (why != Incompatibility::kNone) {
      return absl::FailedPreconditionError(absl::StrCat("route ", r, " (logical expert ", h.expert[r].value(),
                                                        ") -> slot ", m.slot(slots[r]).name, ": ",
                                                        IncompatibilityName(why)));
    }
    const Rank dst = m.slot(slots[r]).rank;
    plan.destination_rank[r] = dst.value();
    ++plan.count_matrix[src.value() * p_count + dst.value()];
    plan.source_routes[src.value()].push_back(r);
    source_slots[src.value()].push_back(slots[r]);
    ++plan.accepted;
  }
  return absl::OkStatus();
}

// Receive side: rank u receives, from each source peer i in peer-slot order, that source's
// segment for u's peer slot.
absl::Status PlanReceives(const PlanLayout& layout, ClusterPlan& plan) {
  const ProcessGroup& g = layout.group();
  const int p_count = plan.num_ranks;
  std::vector<int64_t> recv_splits(p_count);
  std::vector<PhysicalSlotId> received;
  for (int u = 0; u < p_count; ++u) {
    const int u_peer = g.SlotOf(Rank(u)).value();
    received.clear();
    auto& routes = plan.receive_routes[u];
    for (int i = 0; i < p_count; ++i) {
      const int s = g.RankAt(PeerSlot(i)).value();
      const SourcePlan& sp = plan.source[s];
      recv_splits[i] = sp.send_splits[u_peer];
      for (int64_t pos = sp.send_offsets[u_peer]; pos < sp.send_offsets[u_peer + 1]; ++pos) {
        received.push_back(sp.send_slots[pos]);
        routes.push_back(plan.source_routes[s][sp.send_order[pos]]);
      }
    }
    RETURN_IF_ERROR(PlanDestination(layout, Rank(u), recv_splits, received, &plan.destination[u]));
    for (size_t pos = 0; pos < routes.size(); ++pos) {
      plan.receive_position[routes[pos]] = static_cast<int32_t>(pos);
      plan.expert_position[routes[pos]] = plan.destination[u].expert_position[pos];
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ClusterPlan> PlanCluster(const FrozenHandoff& handoff, absl::Span<const PhysicalSlotId> slots,
                                        const PlanLayout& layout, const Topology& topology) {
  RETURN_IF_ERROR(VerifyFrozen(handoff));
  const SemanticHandoff& h = handoff.routes;
  const PlacementManifest& m = layout.manifest();
  const ProcessGroup& g = layout.group();
  const int p_count = topology.num_ranks();
  if (static_cast<int32_t>(slots.size()) != h.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("physical_slot: ", slots.size(), " entries for ", h.size(), " routes"));
  }
  if (h.num_experts != m.num_experts()) {
    return absl::FailedPreconditionError(absl::StrCat("handoff names ", h.num_experts, " logical experts, ",
                                                      m.VersionName(), " holds ", m.num_experts()));
  }

  // Route checks come first so a slot outside the group is reported as such (clause 3).
  ClusterPlan plan;
  plan.num_ranks = p_count;
  plan.count_matrix.assign(static_cast<size_t>(p_count) * p_count, 0);
  plan.source_routes.assign(p_count, {});
  plan.source.resize(p_count);
  plan.destination.resize(p_count);
  plan.receive_routes.assign(p_count, {});
  plan.send_position.assign(h.size(), -1);
  plan.receive_position.assign(h.size(), -1);
  plan.expert_position.assign(h.size(), -1);
  plan.destination_rank.assign(h.size(), -1);
  std::vector<std::vector<PhysicalSlotId>> source_slots(p_count);
  RETURN_IF_ERROR(GroupBySource(h, slots, layout, topology, plan, source_slots));

  if (g.size() != p_count) {
    return absl::FailedPreconditionError(absl::StrCat("process group ", g.id().value(), " has ", g.size(),
                                                      " peers but the topology has ", p_count, " ranks"));
  }
  if (h.num_partitions != p_count) {
    // Partition i is rank i's input; a rank with no rows keeps its (empty) partition (0x03A1).
    return absl::FailedPreconditionError(
        absl::StrCat("handoff names ", h.num_partitions, " partitions, the topology has ", p_count, " ranks"));
  }
  for (int r = 0; r < p_count; ++r) {
    if (!g.Contains(Rank(r))) {
      // 0x07G: the group's ranks are the topology's.
      return absl::FailedPreconditionError(
          absl::StrCat("process group ", g.id().value(), " does not hold rank ", r, " of the topology"));
    }
  }
  for (int s = 0; s < p_count; ++s) {
    RETURN_IF_ERROR(PlanSource(layout, source_slots[s], &plan.source[s]));
    for (size_t i = 0; i < plan.source_routes[s].size(); ++i) {
      plan.send_position[plan.source_routes[s][i]] = plan.source[s].send_position[i];
    }
  }
  RETURN_IF_ERROR(PlanReceives(layout, plan));
  return plan;
}

}  // namespace moe
