// Route planning: from physically assigned routes to counts, splits, offsets and orders
// (spec 0x03B, 0x03C1, 0x03C2, 0x07B).
//
// Two halves, matching what one rank can compute on its own:
//   PlanSource      - on the origin rank: split vector in communicator peer-slot order (zero
//                     peers kept), exclusive offsets with sentinel, stable send order by
//                     (destination peer, physical slot id, semantic position).
//   PlanDestination - on the expert rank after the count exchange: receive splits (the
//                     transpose), repack by (local slot, source peer, send position), local
//                     expert offsets.
// PlanCluster composes both over a whole trace (the oracle moectl prints and tests check) and
// records each route's inverse coordinates (send, receive and expert positions).
//
// Cost: linear in routes plus slots (counting sorts). Plans are reusable: vectors keep their
// capacity across calls, so steady-state planning allocates nothing per route.
// Thread-safety: PlanLayout is immutable; plan objects belong to one caller.
#ifndef MOE_RUNTIME_PLAN_ROUTE_PLAN_H_
#define MOE_RUNTIME_PLAN_ROUTE_PLAN_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "runtime/ids.h"
#include "runtime/placement/manifest.h"
#include "runtime/placement/topology.h"
#include "runtime/semantic.h"

namespace moe {

// Slot ordering of one (placement generation, process group): the counting-sort key.
class PlanLayout {
 public:
  static absl::StatusOr<PlanLayout> Create(std::shared_ptr<const PlacementManifest> manifest, ProcessGroup group);

  const PlacementManifest& manifest() const { return *manifest_; }
  const std::shared_ptr<const PlacementManifest>& manifest_ptr() const { return manifest_; }
  const ProcessGroup& group() const { return group_; }
  int num_peers() const { return group_.size(); }
  int num_slots() const { return static_cast<int>(slot_key_.size()); }
  // Key in [0, Q): slots ordered by (peer slot of their rank, slot id). -1 when the slot's rank
  // is outside the group.
  int32_t SlotKey(PhysicalSlotId q) const { return slot_key_[q.value()]; }
  int32_t SlotPeer(PhysicalSlotId q) const { return slot_peer_[q.value()]; }
  // Keys of peer i are [PeerKeyBegin(i), PeerKeyBegin(i + 1)).
  int32_t PeerKeyBegin(int peer) const { return peer_key_begin_[peer]; }

 private:
  std::shared_ptr<const PlacementManifest> manifest_;
  ProcessGroup group_;
  std::vector<int32_t> slot_key_;
  std::vector<int32_t> slot_peer_;
  std::vector<int32_t> peer_key_begin_;  // P + 1
};

struct SourcePlan {
  std::vector<int64_t> send_splits;        // [P], peer-slot order
  std::vector<int64_t> send_offsets;       // [P + 1], exclusive prefix with sentinel R
  std::vector<int32_t> send_order;         // send position -> route index (local list)
  std::vector<int32_t> send_position;      // route index -> send position
  std::vector<PhysicalSlotId> send_slots;  // send position -> physical slot (row metadata)
  std::vector<int32_t> scratch;            // [Q + 1] bucket starts, reused
};

// `route_slots[i]` is the physical slot of this rank's i-th accepted route in semantic order.
// INVALID_ARGUMENT for a slot outside the manifest, FAILED_PRECONDITION for a slot whose rank
// is outside the process group.
absl::Status PlanSource(const PlanLayout& layout, absl::Span<const PhysicalSlotId> route_slots, SourcePlan* plan);

struct DestinationPlan {
  std::vector<int64_t> recv_splits;      // [P], source peer-slot order
  std::vector<int64_t> recv_offsets;     // [P + 1]
  std::vector<int32_t> expert_order;     // expert position -> receive position
  std::vector<int32_t> expert_position;  // receive position -> expert position
  std::vector<int64_t> expert_counts;    // [local slots], manifest local slot order
  std::vector<int64_t> expert_offsets;   // [local slots + 1]
  std::vector<int32_t> scratch;
};

// `received_slots` is the slot metadata of the received rows in arrival order (source-major in
// peer-slot order, each source's segment in its send order). Every slot must live on `self`.
absl::Status PlanDestination(const PlanLayout& layout, Rank self, absl::Span<const int64_t> recv_splits,
                             absl::Span<const PhysicalSlotId> received_slots, DestinationPlan* plan);

// The whole-group plan of one layer step.
struct ClusterPlan {
  int num_ranks = 0;
  int64_t accepted = 0;                              // accepted routes
  std::vector<int64_t> count_matrix;                 // [P * P], (source rank, destination rank)
  std::vector<std::vector<int32_t>> source_routes;   // per rank: local index -> route id
  std::vector<SourcePlan> source;                    // per rank
  std::vector<DestinationPlan> destination;          // per rank
  std::vector<std::vector<int32_t>> receive_routes;  // per rank: receive position -> route id
  // Inverse coordinates per route id; -1 for routes the router dropped.
  std::vector<int32_t> send_position;
  std::vector<int32_t> receive_position;
  std::vector<int32_t> expert_position;
  std::vector<int32_t> destination_rank;

  int64_t Count(Rank source, Rank dest) const { return count_matrix[source.value() * num_ranks + dest.value()]; }
  // Route ids held by local slot order on a destination (expert-major).
  std::vector<int32_t> ExpertRoutes(Rank dest) const;
};

// Verifies the sealed handoff, checks every accepted route against the manifest (0x03A1:
// the slot holds the route's logical expert under a compatible replica; source and destination
// are group members) and plans every rank. `slots[r]` is route r's physical slot (ignored for
// dropped routes). The group must cover exactly the topology's ranks.
absl::StatusOr<ClusterPlan> PlanCluster(const FrozenHandoff& handoff, absl::Span<const PhysicalSlotId> slots,
                                        const PlanLayout& layout, const Topology& topology);

}  // namespace moe

#endif  // MOE_RUNTIME_PLAN_ROUTE_PLAN_H_
