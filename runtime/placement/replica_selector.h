// Replica selection: one compatible physical slot per accepted route (spec 0x01D1, 0x08H).
//
// The router chose the logical expert; a selector only chooses among rho_v(e), filtered by the
// four-clause compatibility predicate. Every selector assigns each accepted route to exactly one
// compatible slot, never changes the logical expert or the gate, and fails the whole call
// (FAILED_PRECONDITION naming the route and expert) when an expert has no compatible slot.
//
//   kLocalityFirst: min (route class of origin -> slot rank, predicted + assigned rank load, slot)
//   kLeastLoad:     min (predicted + assigned slot load, slot)
//   kRoundRobin:    per-expert cursor over the compatible slots (state kept across calls)
//   kHash:          hash(scope, origin rank, token, route slot) over the compatible slots
//
// Thread-safety: a selector is owned by one planning thread (round-robin keeps a cursor).
#ifndef MOE_RUNTIME_PLACEMENT_REPLICA_SELECTOR_H_
#define MOE_RUNTIME_PLACEMENT_REPLICA_SELECTOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

#include "runtime/placement/manifest.h"
#include "runtime/semantic.h"

namespace moe {

enum class SelectorPolicy { kLocalityFirst, kLeastLoad, kRoundRobin, kHash };
const char* SelectorPolicyName(SelectorPolicy p);
absl::StatusOr<SelectorPolicy> ParseSelectorPolicy(const std::string& name);

class ReplicaSelector {
 public:
  static std::unique_ptr<ReplicaSelector> Create(SelectorPolicy policy);
  virtual ~ReplicaSelector() = default;
  virtual SelectorPolicy policy() const = 0;

  // Fills `out[r]` for every accepted route r (dropped routes get -1). `predicted_rank_load`
  // (optional, [P]) seeds the load-aware policies.
  virtual absl::Status Select(const SemanticHandoff& routes, const PlacementManifest& manifest,
                              const ProcessGroup& group, const Topology& topology,
                              absl::Span<const int64_t> predicted_rank_load, absl::Span<PhysicalSlotId> out) = 0;
};

}  // namespace moe

#endif  // MOE_RUNTIME_PLACEMENT_REPLICA_SELECTOR_H_
