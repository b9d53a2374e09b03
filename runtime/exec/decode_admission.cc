#include "runtime/exec/decode_admission.h"

#include <numeric>

namespace moe {

bool operator==(const GraphKey& a, const GraphKey& b) {
  return a.process_group == b.process_group && a.placement_version == b.placement_version &&
         a.checkpoint == b.checkpoint && a.d == b.d && a.k == b.k && a.activation_dtype == b.activation_dtype &&
         a.gate_dtype == b.gate_dtype && a.dispatch == b.dispatch && a.runner == b.runner &&
         a.rank_token_capacity == b.rank_token_capacity && a.slot_route_capacity == b.slot_route_capacity;
}

const char* FallbackReasonName(FallbackReason r) {
  switch (r) {
    case FallbackReason::kNone:
      return "none";
    case FallbackReason::kPhaseNotDecode:
      return "phase_not_decode";
    case FallbackReason::kGraphKeyMismatch:
      return "graph_key_mismatch";
    case FallbackReason::kRankTokenCapacityExceeded:
      return "rank_token_capacity_exceeded";
    case FallbackReason::kExpertRouteCapacityExceeded:
      return "expert_route_capacity_exceeded";
    case FallbackReason::kStableBufferUnavailable:
      return "stable_buffer_unavailable";
  }
  return "unknown";
}

Admission AdmitDecodeGraph(const AdmissionStep& step, const DecodeGraph* graph) {
  auto fallback = [](FallbackReason r) { return Admission{false, r, ""}; };
  if (!step.decode) return fallback(FallbackReason::kPhaseNotDecode);
  if (graph == nullptr) return fallback(FallbackReason::kStableBufferUnavailable);
  if (!(step.key == graph->key)) return fallback(FallbackReason::kGraphKeyMismatch);
  const GraphKey& g = graph->key;
  if (step.rank_tokens.size() != g.rank_token_capacity.size()) return fallback(FallbackReason::kGraphKeyMismatch);
  for (size_t i = 0; i < step.rank_tokens.size(); ++i) {
    if (step.rank_tokens[i] > g.rank_token_capacity[i]) return fallback(FallbackReason::kRankTokenCapacityExceeded);
  }
  if (step.slot_routes.size() != g.slot_route_capacity.size()) return fallback(FallbackReason::kGraphKeyMismatch);
  for (size_t i = 0; i < step.slot_routes.size(); ++i) {
    if (step.slot_routes[i] > g.slot_route_capacity[i]) return fallback(FallbackReason::kExpertRouteCapacityExceeded);
  }
  if (!graph->stable_buffers_ready) return fallback(FallbackReason::kStableBufferUnavailable);
  return Admission{true, FallbackReason::kNone, graph->graph_id};
}

UnitLedger GraphUnitLedger(const GraphKey& key, const std::vector<int64_t>& rank_tokens,
                           const std::vector<int64_t>& slot_routes, int act_bytes, int num_ranks) {
  UnitLedger l;
  l.useful_input_rows = std::accumulate(rank_tokens.begin(), rank_tokens.end(), int64_t{0});
  l.useful_routes = std::accumulate(slot_routes.begin(), slot_routes.end(), int64_t{0});
  l.executed_dispatch_slots =
      std::accumulate(key.rank_token_capacity.begin(), key.rank_token_capacity.end(), int64_t{0});
  l.executed_runner_rows = std::accumulate(key.slot_route_capacity.begin(), key.slot_route_capacity.end(), int64_t{0});
  const int64_t slots = l.executed_dispatch_slots;
  // hidden + route ids (INT32) + gates (FP32) + expert output + per-rank metadata (3 x INT32).
  l.graph_payload_bytes = slots * key.d * act_bytes + slots * key.k * 4 + slots * key.k * 4 +
                          slots * key.d * act_bytes + static_cast<int64_t>(num_ranks) * 3 * 4;
  l.host_submissions = 1;
  return l;
}

UnitLedger EagerUnitLedger(const std::vector<int64_t>& rank_tokens, const std::vector<int64_t>& slot_routes,
                           int64_t host_submissions) {
  UnitLedger l;
  l.useful_input_rows = std::accumulate(rank_tokens.begin(), rank_tokens.end(), int64_t{0});
  l.useful_routes = std::accumulate(slot_routes.begin(), slot_routes.end(), int64_t{0});
  l.executed_dispatch_slots = l.useful_input_rows;
  l.executed_runner_rows = l.useful_routes;
  l.host_submissions = host_submissions;
  return l;
}

}  // namespace moe
