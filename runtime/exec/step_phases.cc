#include "runtime/exec/step_phases.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "runtime/hash.h"
#include "runtime/status.h"

namespace moe {

const char* StepPhaseName(StepPhase phase) {
  static constexpr const char* kNames[kNumStepPhases] = {"validate", "acquire", "plan",    "agree",  "dispatch",
                                                         "experts",  "return",  "combine", "release"};
  const int i = static_cast<int>(phase);
  return i >= 0 && i < kNumStepPhases ? kNames[i] : "unknown";
}

absl::Status ValidateStepShape(const LayerStepInput& in) {
  if (in.tokens < 0) return absl::InvalidArgumentError("hidden: negative token count");
  if (in.k <= 0) return absl::InvalidArgumentError("topk_ids: k must be positive");
  if (in.d <= 0) return absl::InvalidArgumentError("hidden: d must be positive");
  if (in.tokens > 0 && (in.hidden == nullptr || in.topk_ids == nullptr || in.topk_weights == nullptr)) {
    return absl::InvalidArgumentError("hidden / topk_ids / topk_weights: missing");
  }
  if (in.rows_on_device && in.tokens > 0 && in.output == nullptr) {
    return absl::InvalidArgumentError("output: rows on the device need an output buffer on the device");
  }
  return absl::OkStatus();
}

absl::Status RouteInputError(int64_t i, int k, int32_t e, float gate, int num_experts) {
  if (e < 0 || e >= num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_ids[", i / k, "][", i % k, "]: expert ", e, " outside [0, ", num_experts, ")"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("topk_weights[", i / k, "][", i % k, "]: ", gate, " is NaN, infinite or negative"));
}

absl::Status RouteInputError(const LayerStepInput& in, int64_t i, int num_experts) {
  return RouteInputError(i, in.k, in.topk_ids[i], in.topk_weights[i], num_experts);
}

absl::Status ValidateStepInput(const LayerStepInput& in, int num_experts) {
  RETURN_IF_ERROR(ValidateStepShape(in));
  for (int64_t i = 0; i < in.tokens * in.k; ++i) {
    if (in.admitted != nullptr && in.admitted[i] == 0) continue;
    const int32_t e = in.topk_ids[i];
    const float g = in.topk_weights[i];
    if (e < 0 || e >= num_experts || !std::isfinite(g) || g < 0) return RouteInputError(in, i, num_experts);
  }
  return absl::OkStatus();
}

std::optional<std::vector<int32_t>> StaticSlotChoice(const PlacementManifest& m, const ProcessGroup& group,
                                                     const Topology& topology, Rank me, SelectorPolicy policy) {
  // Round-robin keeps a cursor per expert across steps, which a step planned elsewhere would not
  // advance.
  if (policy == SelectorPolicy::kRoundRobin) return std::nullopt;
  const int e_count = m.num_experts();
  const int my_node = topology.HasRank(me) ? topology.NodeOf(me).value() : -1;
  std::vector<int32_t> choice(e_count, -1);
  for (int e = 0; e < e_count; ++e) {
    // The best route class's candidates: the lowest slot id among them, unless they span ranks
    // (then the selector breaks the tie by the step's running load per rank).
    int best = -1, best_class = 3, best_rank = -1, candidates = 0;
    bool spans_ranks = false;
    for (PhysicalSlotId q : m.SlotsOf(LogicalExpertId(e))) {
      if (!Compatible(LogicalExpertId(e), q, m, group, topology)) continue;
      ++candidates;
      const Rank r = m.slot(q).rank;
      const int cls = r == me ? 0 : (topology.NodeOf(r).value() == my_node ? 1 : 2);
      if (cls < best_class) {
        best = q.value();
        best_class = cls;
        best_rank = r.value();
        spans_ranks = false;
      } else if (cls == best_class) {
        spans_ranks = spans_ranks || r.value() != best_rank;
        best = std::min(best, q.value());
      }
    }
    if (candidates > 1 && (policy != SelectorPolicy::kLocalityFirst || spans_ranks)) return std::nullopt;
    choice[e] = best;
  }
  return choice;
}

absl::StatusOr<FrozenHandoff> SealRoutes(const LayerStepInput& in, Rank rank, int num_experts, int num_partitions,
                                         SemanticHandoff* reuse) {
  SemanticHandoff h;
  if (reuse != nullptr) {
    h.origin.swap(reuse->origin);
    h.token.swap(reuse->token);
    h.route_slot.swap(reuse->route_slot);
    h.expert.swap(reuse->expert);
    h.gate.swap(reuse->gate);
    h.admitted.swap(reuse->admitted);
  }
  h.scope = ExecutionScopeId(static_cast<int64_t>(in.step_id));
  h.num_experts = num_experts;
  h.top_k = in.k;
  h.num_partitions = num_partitions;
  // The columns filled in place, token-major (what SemanticHandoff::Add would append, without a
  // size check and a push per column per route).
  const size_t n = static_cast<size_t>(in.tokens) * static_cast<size_t>(in.k);
  h.origin.assign(n, rank);
  h.token.resize(n);
  h.route_slot.resize(n);
  h.expert.resize(n);
  h.gate.resize(n);
  h.admitted.resize(n);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int j = 0; j < in.k; ++j) {
      const int64_t i = t * in.k + j;
      const bool admitted = in.admitted == nullptr || in.admitted[i] != 0;
      h.token[i] = static_cast<int32_t>(t);
      h.route_slot[i] = j;
      h.expert[i] = LogicalExpertId(admitted ? in.topk_ids[i] : 0);
      h.gate[i] = admitted ? in.topk_weights[i] : 0.0f;
      h.admitted[i] = admitted ? 1 : 0;
    }
  }
  return Freeze(std::move(h));
}

void AcceptRoutes(const SemanticHandoff& routes, absl::Span<const PhysicalSlotId> slots, std::vector<int32_t>* ids,
                  std::vector<PhysicalSlotId>* accepted) {
  ids->clear();
  accepted->clear();
  for (int32_t r = 0; r < routes.size(); ++r) {
    if (!routes.admitted[r]) continue;
    ids->push_back(r);
    accepted->push_back(slots[r]);
  }
}

uint64_t GraphManifestWord(int64_t rank_tokens, int64_t slot_routes, bool graphs, DecodeRunner runner, int64_t k,
                           int64_t d) {
  uint64_t word = SplitMix64(static_cast<uint64_t>(rank_tokens));
  word = SplitMix64(word ^ static_cast<uint64_t>(slot_routes));
  word = SplitMix64(word ^ (graphs ? 1u : 0u));
  word = SplitMix64(word ^ static_cast<uint64_t>(runner));
  word = SplitMix64(word ^ static_cast<uint64_t>(k));
  return SplitMix64(word ^ static_cast<uint64_t>(d));
}

void InverseOf(const SemanticHandoff& routes, absl::Span<const int32_t> accepted_ids, const SourcePlan& source,
               int64_t tokens, InverseCoordinates* out) {
  const int64_t n_send = static_cast<int64_t>(accepted_ids.size());
  InverseCoordinates& inverse = *out;
  inverse.token.resize(n_send);
  inverse.gate.resize(n_send);
  inverse.num_tokens = tokens;
  for (int64_t pos = 0; pos < n_send; ++pos) {
    const int32_t r = accepted_ids[source.send_order[pos]];
    inverse.token[pos] = routes.token[r];
    inverse.gate[pos] = routes.gate[r];
  }
}

void SplitBytes(absl::Span<const int64_t> send_counts, absl::Span<const int64_t> recv_counts, int64_t row_bytes,
                int64_t dispatch_row_bytes, ByteSplits* out) {
  const size_t p = send_counts.size();
  ByteSplits& b = *out;
  for (std::vector<int64_t>* v : {&b.send, &b.recv, &b.dispatch_send, &b.dispatch_recv, &b.send_meta, &b.recv_meta}) {
    v->resize(p);
  }
  for (size_t i = 0; i < p; ++i) {
    b.send[i] = send_counts[i] * row_bytes;
    b.recv[i] = recv_counts[i] * row_bytes;
    b.dispatch_send[i] = send_counts[i] * dispatch_row_bytes;
    b.dispatch_recv[i] = recv_counts[i] * dispatch_row_bytes;
    b.send_meta[i] = send_counts[i] * 4;
    b.recv_meta[i] = recv_counts[i] * 4;
  }
}

void CombineTables(absl::Span<const int32_t> accepted_ids, const SourcePlan& source,
                   absl::Span<const float> gate_of_position, int64_t routes, std::vector<int32_t>* row_of_route,
                   std::vector<float>* gates) {
  row_of_route->assign(routes, -1);
  gates->assign(routes, 0.0f);
  for (size_t i = 0; i < accepted_ids.size(); ++i) {
    const int32_t r = accepted_ids[i];
    const int32_t pos = source.send_position[i];
    (*row_of_route)[r] = pos;
    (*gates)[r] = gate_of_position[pos];
  }
}

absl::Status CheckCombineTables(absl::Span<const int32_t> row_of_route, absl::Span<const int32_t> position_token,
                                int64_t k, std::vector<uint8_t>* seen) {
  const int64_t n_send = static_cast<int64_t>(position_token.size());
  seen->assign(n_send, 0);
  int64_t combined = 0;
  for (int64_t r = 0; r < static_cast<int64_t>(row_of_route.size()); ++r) {
    const int32_t pos = row_of_route[r];
    if (pos < 0) continue;
    if (pos >= n_send || (*seen)[pos] != 0 || position_token[pos] != r / k) {
      return absl::DataLossError(
          absl::StrCat("inverse permutation: route ", r, " (token ", r / k, ") combines send position ", pos,
                       pos >= n_send       ? absl::StrCat(", past the ", n_send, " sent")
                       : (*seen)[pos] != 0 ? std::string(", which another route combines already")
                                           : absl::StrCat(", which was sent for token ", position_token[pos]),
                       "; the step's output is not published"));
    }
    (*seen)[pos] = 1;
    ++combined;
  }
  if (combined != n_send) {
    return absl::DataLossError(absl::StrCat("inverse permutation: ", combined, " routes combine the ", n_send,
                                            " sent positions; the step's output is not published"));
  }
  return absl::OkStatus();
}

void CountRoutes(const PlacementManifest& m, const Topology& topology, Rank me, absl::Span<const int64_t> slot_counts,
                 int64_t attempted, StepRecord* record) {
  int64_t accepted = 0;
  for (size_t q = 0; q < slot_counts.size(); ++q) {
    const int64_t n = slot_counts[q];
    if (n == 0) continue;
    accepted += n;
    const Rank dst = m.slot(PhysicalSlotId(static_cast<int32_t>(q))).rank;
    if (dst != me) record->routes_remote += n;
    if (topology.NodeOf(dst) != topology.NodeOf(me)) record->routes_inter_node += n;
  }
  record->routes_attempted = attempted;
  record->routes_accepted = accepted;
  record->routes_dropped = attempted - accepted;
}

int StepTables::Add(const void* src, int64_t bytes) {
  tables_.push_back({src, bytes, total_});
  total_ += (bytes + 15) / 16 * 16;
  return static_cast<int>(tables_.size()) - 1;
}

absl::Status StepTables::Upload(bool device, kernels::ExpertKernels& kern, kernels::KernelBuffer& to,
                                std::vector<uint8_t>& host, kernels::Stream stream) {
  device_ = device;
  if (!device || total_ == 0) return absl::OkStatus();
  host.resize(total_);
  for (const Table& t : tables_) {
    if (t.bytes > 0) std::memcpy(host.data() + t.offset, t.src, t.bytes);
  }
  RETURN_IF_ERROR(to.Reserve(&kern, total_));
  RETURN_IF_ERROR(kern.CopyToKernel(to.data(), host.data(), total_, stream));
  base_ = static_cast<const uint8_t*>(to.data());
  return absl::OkStatus();
}

}  // namespace moe
