#include "runtime/placement/replica_selector.h"

#include <limits>

#include "absl/strings/str_cat.h"

#include "runtime/hash.h"

namespace moe {

const char* SelectorPolicyName(SelectorPolicy p) {
  switch (p) {
    case SelectorPolicy::kLocalityFirst:
      return "locality-first";
    case SelectorPolicy::kLeastLoad:
      return "least-load";
    case SelectorPolicy::kRoundRobin:
      return "round-robin";
    case SelectorPolicy::kHash:
      return "hash";
  }
  return "unknown";
}

absl::StatusOr<SelectorPolicy> ParseSelectorPolicy(const std::string& name) {
  for (SelectorPolicy p : {SelectorPolicy::kLocalityFirst, SelectorPolicy::kLeastLoad, SelectorPolicy::kRoundRobin,
                           SelectorPolicy::kHash}) {
    if (name == SelectorPolicyName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("selector: unknown policy '", name, "' (locality-first, least-load, round-robin, hash)"));
}

namespace {

class SelectorBase : public ReplicaSelector {
 public:
  explicit SelectorBase(SelectorPolicy policy) : policy_(policy) {}
  SelectorPolicy policy() const override { return policy_; }

  absl::Status Select(const SemanticHandoff& routes, const PlacementManifest& manifest, const ProcessGroup& group,
                      const Topology& topology, absl::Span<const int64_t> predicted_rank_load,
                      absl::Span<PhysicalSlotId> out) override {
    if (static_cast<int32_t>(out.size()) != routes.size()) {
      return absl::InvalidArgumentError(absl::StrCat("out: ", out.size(), " entries for ", routes.size(), " routes"));
    }
    if (!predicted_rank_load.empty() && static_cast<int>(predicted_rank_load.size()) != topology.num_ranks()) {
      return absl::InvalidArgumentError("predicted_rank_load: one entry per rank required");
    }
    // Compatible candidates per expert, computed once per call (E + Q work), with each
    // candidate's rank and node in flat arrays so the per-route loop touches no SlotRecord.
    const int e_count = manifest.num_experts();
    cand_begin_.assign(e_count + 1, 0);
    cand_.clear();
    cand_rank_.clear();
    cand_node_.clear();
    for (int e = 0; e < e_count; ++e) {
      for (PhysicalSlotId q : manifest.SlotsOf(LogicalExpertId(e))) {
        if (!Compatible(LogicalExpertId(e), q, manifest, group, topology)) continue;
        cand_.push_back(q);
        cand_rank_.push_back(manifest.slot(q).rank.value());
        cand_node_.push_back(topology.NodeOf(manifest.slot(q).rank).value());
      }
      cand_begin_[e + 1] = static_cast<int32_t>(cand_.size());
    }
    rank_load_.assign(topology.num_ranks(), 0);
    for (size_t r = 0; r < predicted_rank_load.size(); ++r) rank_load_[r] = predicted_rank_load[r];
    slot_load_.assign(manifest.num_slots(), 0);
    if (cursor_.size() != static_cast<size_t>(e_count)) cursor_.assign(e_count, 0);

    const int32_t n_routes = routes.size();
    for (int32_t r = 0; r < n_routes; ++r) {
      if (!routes.admitted[r]) {
        out[r] = PhysicalSlotId(-1);
        continue;
      }
      const int e = routes.expert[r].value();
      if (e < 0 || e >= e_count) {
        return absl::InvalidArgumentError(
            absl::StrCat("routes[", r, "].logical_expert: ", e, " outside [0, ", e_count, ")"));
      }
      const int32_t begin = cand_begin_[e];
      const int32_t n = cand_begin_[e + 1] - begin;
      if (n == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("route ", r, ": no compatible slot holds logical expert ", e, " in ", manifest.VersionName()));
      }
      // NOTE: a single compatible copy leaves no choice under any policy; round-robin still
      // advances its cursor so its sequence does not depend on the fast path.
      const int32_t i = n == 1 ? (policy_ == SelectorPolicy::kRoundRobin ? (++cursor_[e], begin) : begin)
                               : Choose(routes, r, topology, begin, n);
      out[r] = cand_[i];
      ++slot_load_[cand_[i].value()];
      ++rank_load_[cand_rank_[i]];
    }
    return absl::OkStatus();
  }

 private:
  // Index into cand_ of the chosen slot.
  int32_t Choose(const SemanticHandoff& routes, int32_t r, const Topology& topology, int32_t begin, int32_t n) {
    switch (policy_) {
      case SelectorPolicy::kLocalityFirst: {
        const int origin = routes.origin[r].value();
        const int origin_node = topology.HasRank(routes.origin[r]) ? topology.NodeOf(routes.origin[r]).value() : -1;
        int32_t best = begin;
        int best_class = 3;
        int64_t best_load = 0;
        for (int32_t i = begin; i < begin + n; ++i) {
          const int cls = cand_rank_[i] == origin ? 0 : (cand_node_[i] == origin_node ? 1 : 2);
          const int64_t load = rank_load_[cand_rank_[i]];
          // Candidates are in (replica, slot) order; ties on (class, load) keep the lower slot id.
          if (cls < best_class ||
              (cls == best_class && (load < best_load || (load == best_load && cand_[i] < cand_[best])))) {
            best = i;
            best_class = cls;
            best_load = load;
          }
        }
        return best;
      }
      case SelectorPolicy::kLeastLoad: {
        int32_t best = begin;
        for (int32_t i = begin + 1; i < begin + n; ++i) {
          const int64_t a = slot_load_[cand_[i].value()];
          const int64_t b = slot_load_[cand_[best].value()];
          if (a < b || (a == b && cand_[i] < cand_[best])) best = i;
        }
        return best;
      }
      case SelectorPolicy::kRoundRobin: {
        const int e = routes.expert[r].value();
        return begin + static_cast<int32_t>(cursor_[e]++ % static_cast<uint64_t>(n));
      }
      case SelectorPolicy::kHash: {
        const uint64_t key =
            SplitMix64((static_cast<uint64_t>(routes.scope.value()) << 48) ^
                       (static_cast<uint64_t>(routes.origin[r].value()) << 32) ^
                       (static_cast<uint64_t>(routes.token[r]) << 8) ^ static_cast<uint64_t>(routes.route_slot[r]));
        return begin + static_cast<int32_t>(key % static_cast<uint64_t>(n));
      }
    }
    return begin;
  }

  SelectorPolicy policy_;
  std::vector<int32_t> cand_begin_;
  std::vector<PhysicalSlotId> cand_;
  std::vector<int32_t> cand_rank_;
  std::vector<int32_t> cand_node_;
  std::vector<int64_t> rank_load_;
  std::vector<int64_t> slot_load_;
  std::vector<uint64_t> cursor_;
};

}  // namespace

std::unique_ptr<ReplicaSelector> ReplicaSelector::Create(SelectorPolicy policy) {
  return std::make_unique<SelectorBase>(policy);
}

}  // namespace moe
