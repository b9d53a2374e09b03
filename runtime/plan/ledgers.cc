#include "runtime/plan/ledgers.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

#include "runtime/status.h"

namespace moe {

LoadLedger ComputeLoadLedger(const ClusterPlan& plan, const FrozenHandoff& handoff, const PlacementManifest& manifest) {
  const SemanticHandoff& h = handoff.routes;
  LoadLedger l;
  l.logical_expert_rows.assign(h.num_experts, 0);
  l.physical_slot_rows.assign(manifest.num_slots(), 0);
  l.destination_rank_rows.assign(plan.num_ranks, 0);
  for (int32_t r = 0; r < h.size(); ++r) {
    if (!h.admitted[r]) continue;
    ++l.logical_expert_rows[h.expert[r].value()];
    ++l.destination_rank_rows[plan.destination_rank[r]];
  }
  for (int u = 0; u < plan.num_ranks; ++u) {
    const auto local = manifest.LocalSlots(Rank(u));
    for (size_t i = 0; i < local.size(); ++i) {
      l.physical_slot_rows[local[i].value()] = plan.destination[u].expert_counts[i];
    }
  }
  return l;
}

ByteLedger ComputeByteLedger(const ClusterPlan& plan, const FrozenHandoff& handoff, int d, const LedgerWidths& w) {
  const SemanticHandoff& h = handoff.routes;
  const int64_t p = plan.num_ranks;
  ByteLedger b;
  b.routes = plan.accepted;
  for (int32_t r = 0; r < h.size(); ++r) {
    if (h.admitted[r] && plan.destination_rank[r] != h.origin[r].value()) ++b.remote_routes;
  }
  std::set<std::pair<int32_t, int32_t>> tokens;
  for (int32_t r = 0; r < h.size(); ++r) tokens.insert({h.origin[r].value(), h.token[r]});
  b.tokens = static_cast<int64_t>(tokens.size());
  b.staging_dispatch = b.routes * d * w.activation;
  b.staging_combine = b.routes * d * w.output;
  b.remote_dispatch = b.remote_routes * d * w.activation;
  b.remote_combine = b.remote_routes * d * w.output;
  b.dispatch_meta = b.remote_routes * w.dispatch_meta_fields * w.meta;
  b.combine_meta = b.remote_routes * w.combine_meta_fields * w.meta;
  b.route_handle = b.routes * w.handle_fields * w.meta;
  b.count_matrix = p * p * w.coordinate;
  b.send_offsets = p * (p + 1) * w.coordinate;
  b.recv_splits = p * p * w.coordinate;
  for (const DestinationPlan& dp : plan.destination) b.expert_offset_entries += dp.expert_offsets.size();
  b.expert_offsets = b.expert_offset_entries * w.coordinate;
  b.remote_logical = b.remote_dispatch + b.remote_combine + b.dispatch_meta + b.combine_meta;
  for (int64_t c : plan.count_matrix) b.max_split = std::max(b.max_split, c);
  b.padded_rows = p * p * b.max_split;
  b.padding_rows = b.padded_rows - b.routes;
  b.padded_per_direction = b.padded_rows * d * w.activation;
  b.padded_round_trip = b.padded_rows * d * (w.activation + w.output);
  b.useful_round_trip = b.staging_dispatch + b.staging_combine;
  return b;
}

namespace {

using EventIndex = std::map<std::string, size_t>;

// Event name -> index in `events`; a name declared twice is an error.
absl::StatusOr<EventIndex> IndexEvents(const std::vector<ScheduleEvent>& events) {
  EventIndex index;
  for (size_t i = 0; i < events.size(); ++i) {
    if (!index.emplace(events[i].name, i).second) {
      return absl::InvalidArgumentError(absl::StrCat("event ", events[i].name, " is declared twice"));
    }
  }
  return index;
}

// Dependencies exist and every non-root event has one.
absl::Status CheckDependencies(const std::vector<ScheduleEvent>& events, const EventIndex& index) {
  int roots = 0;
  for (const ScheduleEvent& e : events) {
    if (e.deps.empty()) ++roots;
    for (const std::string& dep : e.deps) {
      if (index.find(dep) == index.end()) {
        return absl::FailedPreconditionError(
            absl::StrCat("missing dependency: event ", e.name, " waits on unknown event ", dep));
      }
    }
  }
  if (roots != 1) {
    return absl::FailedPreconditionError(absl::StrCat("missing dependency: the event graph has ", roots,
                                                      " events without a dependency, expected one root"));
  }
  return absl::OkStatus();
}

// Epochs follow dependencies (on an acyclic graph: CheckAcyclic runs first).
absl::Status CheckEpochOrder(const std::vector<ScheduleEvent>& events, const EventIndex& index) {
  for (const ScheduleEvent& e : events) {
    for (const std::string& dep : e.deps) {
      const ScheduleEvent& before = events[index.find(dep)->second];
      if (before.epoch >= e.epoch) {
        return absl::FailedPreconditionError(absl::StrCat("epoch before dependency: event ", e.name, " at epoch ",
                                                          e.epoch, " does not follow ", dep, " at epoch ",
                                                          before.epoch));
      }
    }
  }
  return absl::OkStatus();
}

// Cycle check (Kahn), before the epoch order: a cycle is named as one, whatever epochs its events
// were given (any cycle also breaks the epoch order, which would otherwise be the reason given).
absl::Status CheckAcyclic(const std::vector<ScheduleEvent>& events, const EventIndex& index) {
  std::vector<int> indegree(events.size(), 0);
  std::vector<std::vector<size_t>> users(events.size());
  for (size_t i = 0; i < events.size(); ++i) {
    for (const std::string& dep : events[i].deps) {
      users[index.find(dep)->second].push_back(i);  // CheckDependencies found every dep
      ++indegree[i];
    }
  }
  std::vector<size_t> ready;
  for (size_t i = 0; i < events.size(); ++i) {
    if (indegree[i] == 0) ready.push_back(i);
  }
  size_t visited = 0;
  while (!ready.empty()) {
    const size_t i = ready.back();
    ready.pop_back();
    ++visited;
    for (size_t u : users[i]) {
      if (--indegree[u] == 0) ready.push_back(u);
    }
  }
  if (visited != events.size()) return absl::FailedPreconditionError("cyclic event graph");
  return absl::OkStatus();
}

// Each buffer's interval is non-empty and outlives its last reader; buffers of one alias group
// are never live together. Adds the buffers' bytes to report.total_bytes and raises *last_epoch
// to the last buffer end.
absl::Status CheckBuffers(const std::vector<ScheduleEvent>& events, const EventIndex& index,
                          const std::vector<BufferLifetime>& buffers, LifetimeReport& report, int* last_epoch) {
  for (const BufferLifetime& b : buffers) {
    if (b.begin >= b.end) {
      return absl::InvalidArgumentError(
          absl::StrCat("buffer ", b.name, ": empty interval [", b.begin, ", ", b.end, ")"));
    }
    auto it = index.find(b.last_reader);
    if (it == index.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("missing dependency: buffer ", b.name, " names unknown last reader ", b.last_reader));
    }
    const int complete = events[it->second].epoch;
    if (b.end < complete) {
      return absl::FailedPreconditionError(absl::StrCat("early release: buffer ", b.name, " released at epoch ", b.end,
                                                        " before its last reader ", b.last_reader,
                                                        " completes at epoch ", complete));
    }
    report.total_bytes += b.bytes;
    *last_epoch = std::max(*last_epoch, b.end);
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    for (size_t j = i + 1; j < buffers.size(); ++j) {
      const BufferLifetime& a = buffers[i];
      const BufferLifetime& b = buffers[j];
      if (!a.alias_group.empty() && a.alias_group == b.alias_group && a.begin < b.end && b.begin < a.end) {
        return absl::FailedPreconditionError(absl::StrCat("overlapping live alias: buffers ", a.name, " and ", b.name,
                                                          " share alias group ", a.alias_group, " while both live"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LifetimeReport> CheckLifetimes(const std::vector<ScheduleEvent>& events,
                                              const std::vector<BufferLifetime>& buffers) {
  ASSIGN_OR_RETURN(const EventIndex index, IndexEvents(events));
  RETURN_IF_ERROR(CheckDependencies(events, index));
  RETURN_IF_ERROR(CheckAcyclic(events, index));
  RETURN_IF_ERROR(CheckEpochOrder(events, index));

  LifetimeReport report;
  int last_epoch = 0;
  for (const ScheduleEvent& e : events) last_epoch = std::max(last_epoch, e.epoch);
  RETURN_IF_ERROR(CheckBuffers(events, index, buffers, report, &last_epoch));
  report.live_by_epoch.assign(last_epoch + 1, 0);
  for (const BufferLifetime& b : buffers) {
    for (int t = b.begin; t < b.end; ++t) report.live_by_epoch[t] += b.bytes;
  }
  for (int t = 0; t <= last_epoch; ++t) {
    if (report.live_by_epoch[t] > report.peak_bytes) {
      report.peak_bytes = report.live_by_epoch[t];
      report.peak_epoch = t;
    }
  }
  return report;
}

std::vector<ScheduleEvent> LayerStepEvents() {
  return {
      {"route_ready", "route", 0, {}},
      {"dispatch_packed", "pack", 1, {"route_ready"}},
      {"dispatch_in_flight", "communication", 2, {"dispatch_packed"}},
      {"dispatch_complete", "communication", 3, {"dispatch_in_flight"}},
      {"expert_input_ready", "expert", 4, {"dispatch_complete"}},
      {"expert_complete", "expert", 5, {"expert_input_ready"}},
      {"combine_in_flight", "communication", 6, {"expert_complete"}},
      {"combine_complete", "communication", 7, {"combine_in_flight"}},
      {"output_ready", "output", 8, {"combine_complete"}},
      {"handle_released", "output", 9, {"output_ready"}},
      {"downstream_consumer", "output", 10, {"handle_released"}},
  };
}

absl::StatusOr<PrecisionPayloads> ComputePrecisionPayloads(int64_t remote_rows, int64_t d, int64_t scale_block) {
  if (remote_rows < 0) return absl::InvalidArgumentError("remote_rows: must not be negative");
  if (d <= 0 || scale_block <= 0) return absl::InvalidArgumentError("d, scale_block: must be positive");
  constexpr int64_t kBf16 = 2, kFp8 = 1, kScale = 4;
  PrecisionPayloads p;
  p.remote_rows = remote_rows;
  p.d = d;
  p.scale_block = scale_block;
  const int64_t blocks = d / scale_block + (d % scale_block != 0);
  int64_t row_bf16 = 0, row_fp8 = 0, row_fp8_blocks = 0;
  if (__builtin_mul_overflow(d, kBf16, &row_bf16) || __builtin_mul_overflow(d, kFp8, &row_fp8) ||
      __builtin_mul_overflow(blocks, kScale, &row_fp8_blocks) ||
      __builtin_add_overflow(row_fp8_blocks, row_fp8, &row_fp8_blocks) ||
      __builtin_mul_overflow(remote_rows, row_bf16, &p.bf16) ||
      __builtin_mul_overflow(remote_rows, row_fp8 + kScale, &p.fp8_row_scale) ||
      __builtin_mul_overflow(remote_rows, row_fp8_blocks, &p.fp8_block_scales)) {
    return absl::InvalidArgumentError(absl::StrCat("d: ", remote_rows, " rows of width ", d, " overflow a byte count"));
  }
  return p;
}

std::vector<BufferLifetime> LayerStepBuffers(const ByteLedger& b, int d, const LedgerWidths& w) {
  const int64_t rows_in = b.tokens * d * w.activation;
  const int64_t rows_out = b.tokens * d * w.output;
  return {
      {"input hidden", rows_in, 0, 9, "handle_released", ""},
      {"immutable route handle", b.route_handle, 0, 9, "handle_released", ""},
      {"count matrix", b.count_matrix, 1, 7, "combine_complete", ""},
      {"send offsets", b.send_offsets, 1, 7, "combine_complete", ""},
      {"receive splits", b.recv_splits, 1, 7, "combine_complete", ""},
      {"packed send payload", b.staging_dispatch, 1, 3, "dispatch_complete", ""},
      {"send metadata", b.routes * w.dispatch_meta_fields * w.meta, 1, 3, "dispatch_complete", ""},
      {"source-major receive", b.staging_dispatch, 2, 4, "expert_input_ready", ""},
      {"local expert offsets", b.expert_offsets, 3, 5, "expert_complete", ""},
      {"local expert input", b.staging_dispatch, 3, 5, "expert_complete", ""},
      {"expert output / return payload", b.staging_combine, 4, 7, "combine_complete", "expert_output_return"},
      {"return metadata", b.routes * w.combine_meta_fields * w.meta, 4, 7, "combine_complete", ""},
      {"returned source-order rows", b.staging_combine, 6, 8, "output_ready", ""},
      {"output hidden", rows_out, 7, 10, "downstream_consumer", ""},
  };
}

absl::StatusOr<RunnerLedger> ComputeRunnerLedger(const RunnerLayout& layout, int d, int d_ff, int block_cols) {
  if (d <= 0 || d_ff <= 0) return absl::InvalidArgumentError("d and d_ff: must be positive");
  RunnerLedger l;
  l.kind = layout.kind;
  l.useful_rows = layout.useful_rows;
  l.capacity_rows = layout.capacity_rows;
  l.executed_rows = layout.executed_rows;
  l.utilization = l.executed_rows == 0 ? 1.0 : static_cast<double>(l.useful_rows) / l.executed_rows;
  l.input_values = l.executed_rows * d;
  l.intermediate_values = l.executed_rows * d_ff;
  l.matmul_flops = 6 * l.executed_rows * d * d_ff;
  l.useful_flops = 6 * l.useful_rows * d * d_ff;
  switch (layout.kind) {
    case RunnerKind::kPaddedDense:
      l.state_bytes = l.executed_rows;  // one mask byte per executed row
      l.state = "valid-row mask";
      break;
    case RunnerKind::kGrouped: {
      int64_t problems = 0;
      for (int64_t c : layout.counts) problems += c > 0 ? 1 : 0;
      l.state_bytes = problems * 8 * 8;  // m, n, k, four offsets and output offset as INT64
      l.state = "descriptor table";
      break;
    }
    case RunnerKind::kBlockSparse: {
      if (block_cols <= 0 || d_ff % block_cols != 0) {
        return absl::InvalidArgumentError(absl::StrCat("block_cols: ", block_cols, " must divide d_ff=", d_ff));
      }
      l.row_blocks = layout.block_rows == 0 ? 0 : l.executed_rows / layout.block_rows;
      l.nonzero_blocks = l.row_blocks * (d_ff / block_cols);
      // row_offsets (row blocks + 1), column, row and transpose indices: INT32 each.
      l.state_bytes = (l.row_blocks + 1 + 3 * l.nonzero_blocks) * 4;
      l.state = "block topology";
      break;
    }
  }
  return l;
}

const char* RouteClassName(int c) {
  switch (c) {
    case kSameGpu:
      return "same-gpu";
    case kSameNodeRemoteGpu:
      return "same-node-remote-gpu";
    case kDifferentNode:
      return "different-node";
  }
  return "unknown";
}

RouteClassLedger ComputeRouteClasses(const ClusterPlan& plan, const FrozenHandoff& handoff, const Topology& topology,
                                     int d, const LedgerWidths& w) {
  const SemanticHandoff& h = handoff.routes;
  RouteClassLedger l;
  std::array<std::set<std::pair<int, int>>, 3> pairs;
  for (int32_t r = 0; r < h.size(); ++r) {
    if (!h.admitted[r]) continue;
    const Rank src = h.origin[r];
    const Rank dst(plan.destination_rank[r]);
    const int c =
        src == dst ? kSameGpu : (topology.NodeOf(src) == topology.NodeOf(dst) ? kSameNodeRemoteGpu : kDifferentNode);
    ++l.rows[c];
    l.routes[c].push_back(r);
    if (c != kSameGpu) pairs[c].insert({src.value(), dst.value()});
  }
  for (int c = 0; c < 3; ++c) {
    l.dispatch_bytes[c] = l.rows[c] * d * w.activation;
    l.round_trip_bytes[c] = l.rows[c] * d * (w.activation + w.output);
    l.directed_pairs[c] = static_cast<int64_t>(pairs[c].size());
  }
  return l;
}

RelayLedger ComputeRelayLedger(const ClusterPlan& plan, const FrozenHandoff& handoff, const Topology& topology, int d,
                               const LedgerWidths& w) {
  const SemanticHandoff& h = handoff.routes;
  RelayLedger l;
  // (direction, from, to): dispatch = 0, combine = 1.
  std::set<std::tuple<int, int, int>> flat_pairs, relay_pairs;
  int64_t inter_rows = 0;
  for (int32_t r = 0; r < h.size(); ++r) {
    if (!h.admitted[r]) continue;
    const Rank src = h.origin[r];
    const Rank dst(plan.destination_rank[r]);
    const TopologyDomainId src_node = topology.NodeOf(src);
    const TopologyDomainId dst_node = topology.NodeOf(dst);
    if (src_node == dst_node) continue;
    ++inter_rows;
    const Rank src_relay = topology.RelayOf(src_node);
    const Rank dst_relay = topology.RelayOf(dst_node);
    // Dispatch: source -> source relay -> destination relay -> expert rank.
    if (src != src_relay) ++l.dispatch_to_source_relay;
    ++l.dispatch_relay_to_relay;
    if (dst != dst_relay) ++l.dispatch_relay_to_final;
    // Combine reverses the roles.
    if (dst != dst_relay) ++l.combine_to_expert_relay;
    ++l.combine_relay_to_relay;
    if (src != src_relay) ++l.combine_relay_to_origin;
    flat_pairs.insert({0, src.value(), dst.value()});
    flat_pairs.insert({1, dst.value(), src.value()});
    relay_pairs.insert({0, src_relay.value(), dst_relay.value()});
    relay_pairs.insert({1, dst_relay.value(), src_relay.value()});
  }
  l.inter_node_round_trip_bytes = inter_rows * d * (w.activation + w.output);
  l.added_relay_bytes = (l.dispatch_to_source_relay + l.dispatch_relay_to_final) * d * w.activation +
                        (l.combine_to_expert_relay + l.combine_relay_to_origin) * d * w.output;
  l.flat_inter_node_pairs = static_cast<int64_t>(flat_pairs.size());
  l.hierarchical_inter_node_pairs = static_cast<int64_t>(relay_pairs.size());
  return l;
}

}  // namespace moe
