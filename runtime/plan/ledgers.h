// Ledgers of one planned layer step (spec 0x02B1, 0x03C1, 0x03D1-0x03D6, 0x04B-0x04F, 0x07C,
// 0x07E). Every value is computed from the plan, the manifest, the topology and declared
// element widths; none is measured. They are representation-level counts, not fabric bytes or
// time: the names say so (staging, remote logical, executed rows, ...).
#ifndef MOE_RUNTIME_PLAN_LEDGERS_H_
#define MOE_RUNTIME_PLAN_LEDGERS_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/exec/runner_layout.h"
#include "runtime/plan/route_plan.h"

namespace moe {

// 0x02B1: the three load ledgers answer different questions.
struct LoadLedger {
  std::vector<int64_t> logical_expert_rows;    // [E]
  std::vector<int64_t> physical_slot_rows;     // [Q]
  std::vector<int64_t> destination_rank_rows;  // [P]
};
LoadLedger ComputeLoadLedger(const ClusterPlan& plan, const FrozenHandoff& handoff, const PlacementManifest& manifest);

// Element widths of the declared representation (0x03D: BF16 rows, INT64 coordinates,
// INT32 transport metadata and handle fields).
struct LedgerWidths {
  int activation = 2;  // b_a
  int output = 2;      // b_o
  int coordinate = 8;  // count / offset tables
  int meta = 4;        // transport metadata and handle fields
  int dispatch_meta_fields = 2;
  int combine_meta_fields = 1;
  int handle_fields = 8;
};

struct ByteLedger {
  int64_t routes = 0;            // R
  int64_t remote_routes = 0;     // R_remote (destination != source)
  int64_t tokens = 0;            // input rows over all partitions
  int64_t staging_dispatch = 0;  // R d b_a
  int64_t staging_combine = 0;   // R d b_o
  int64_t remote_dispatch = 0;   // R_remote d b_a
  int64_t remote_combine = 0;    // R_remote d b_o
  int64_t dispatch_meta = 0;     // R_remote * fields * 4
  int64_t combine_meta = 0;
  int64_t route_handle = 0;    // R * 8 * 4
  int64_t count_matrix = 0;    // P^2 b_c
  int64_t send_offsets = 0;    // P (P + 1) b_c
  int64_t recv_splits = 0;     // P^2 b_c
  int64_t expert_offsets = 0;  // sum_u (L_u + 1) b_c
  int64_t expert_offset_entries = 0;
  int64_t remote_logical = 0;  // remote payload + remote metadata, excluding protocol
  int64_t max_split = 0;       // max_{p,u} C_{p,u}
  int64_t padded_rows = 0;     // P^2 max split (uniform padded all-to-all)
  int64_t padding_rows = 0;
  int64_t padded_per_direction = 0;  // bytes
  int64_t padded_round_trip = 0;
  int64_t useful_round_trip = 0;
};
ByteLedger ComputeByteLedger(const ClusterPlan& plan, const FrozenHandoff& handoff, int d, const LedgerWidths& w);

// 0x0AB: the logical remote dispatch payload of the same R_remote rows of width d in three
// representations: BF16 data, FP8 data plus one FP32 scale per row, FP8 data plus one FP32 scale
// per `scale_block` values of a row. Data and scales only (no alignment, metadata or protocol):
// at small d the scales make FP8 larger than BF16.
struct PrecisionPayloads {
  int64_t remote_rows = 0;
  int64_t d = 0;
  int64_t scale_block = 128;
  int64_t bf16 = 0;              // R_remote d b16
  int64_t fp8_row_scale = 0;     // R_remote d b8 + R_remote b_s
  int64_t fp8_block_scales = 0;  // R_remote d b8 + R_remote ceil(d / g) b_s
};
// INVALID_ARGUMENT for a negative row count, a non-positive width or block, or a payload past
// int64.
absl::StatusOr<PrecisionPayloads> ComputePrecisionPayloads(int64_t remote_rows, int64_t d, int64_t scale_block = 128);

// 0x03D3-0x03D5: half-open buffer lifetimes over an event schedule.
struct ScheduleEvent {
  std::string name;
  std::string stream;
  int epoch = 0;
  std::vector<std::string> deps;
};
struct BufferLifetime {
  std::string name;
  int64_t bytes = 0;
  int begin = 0;  // live on [begin, end)
  int end = 0;
  std::string last_reader;  // event that must complete before release
  std::string alias_group;  // buffers sharing storage; empty = own allocation
};
struct LifetimeReport {
  int64_t total_bytes = 0;
  int64_t peak_bytes = 0;
  int peak_epoch = 0;
  std::vector<int64_t> live_by_epoch;
};
// Rejects: an unknown event (missing dependency), a non-root event without dependencies, a
// cyclic event graph, an event scheduled at or before a dependency, a buffer released before
// its last reader completes, an empty interval, and two buffers of one alias group live at once.
absl::StatusOr<LifetimeReport> CheckLifetimes(const std::vector<ScheduleEvent>& events,
                                              const std::vector<BufferLifetime>& buffers);
// The layer-step DAG of 0x03D4 with its epochs.
std::vector<ScheduleEvent> LayerStepEvents();
// The fourteen buffers of one layer step, sized from the byte ledger.
std::vector<BufferLifetime> LayerStepBuffers(const ByteLedger& bytes, int d, const LedgerWidths& w);

// 0x04B-0x04F: runner row / FLOP / state ledgers.
struct RunnerLedger {
  RunnerKind kind = RunnerKind::kGrouped;
  int64_t useful_rows = 0;
  int64_t capacity_rows = 0;
  int64_t executed_rows = 0;
  double utilization = 0;
  int64_t input_values = 0;         // executed rows * d
  int64_t intermediate_values = 0;  // executed rows * d_ff
  int64_t matmul_flops = 0;         // 6 * executed * d * d_ff
  int64_t useful_flops = 0;
  int64_t state_bytes = 0;  // mask / descriptor table / block topology
  std::string state;
  // Block-sparse topology detail.
  int64_t row_blocks = 0;
  int64_t nonzero_blocks = 0;
};
absl::StatusOr<RunnerLedger> ComputeRunnerLedger(const RunnerLayout& layout, int d, int d_ff, int block_cols);

// 0x07C: route classes.
enum RouteClass { kSameGpu = 0, kSameNodeRemoteGpu = 1, kDifferentNode = 2 };
const char* RouteClassName(int c);
struct RouteClassLedger {
  std::array<int64_t, 3> rows{};
  std::array<int64_t, 3> dispatch_bytes{};
  std::array<int64_t, 3> round_trip_bytes{};
  std::array<int64_t, 3> directed_pairs{};  // distinct (source, destination) pairs per direction
  std::array<std::vector<int32_t>, 3> routes;
};
RouteClassLedger ComputeRouteClasses(const ClusterPlan& plan, const FrozenHandoff& handoff, const Topology& topology,
                                     int d, const LedgerWidths& w);

// 0x07E: flat vs hierarchical (relay) exchange of the inter-node routes.
struct RelayLedger {
  int64_t dispatch_to_source_relay = 0;  // source -> source-node relay
  int64_t dispatch_relay_to_relay = 0;   // source relay -> destination relay
  int64_t dispatch_relay_to_final = 0;   // destination relay -> expert rank
  int64_t combine_to_expert_relay = 0;   // expert rank -> expert-node relay
  int64_t combine_relay_to_relay = 0;
  int64_t combine_relay_to_origin = 0;
  int64_t inter_node_round_trip_bytes = 0;    // equal for flat and hierarchical
  int64_t added_relay_bytes = 0;              // intra-node relay movements the hierarchy adds
  int64_t flat_inter_node_pairs = 0;          // directed rank pairs, dispatch + combine
  int64_t hierarchical_inter_node_pairs = 0;  // directed relay pairs, dispatch + combine
};
RelayLedger ComputeRelayLedger(const ClusterPlan& plan, const FrozenHandoff& handoff, const Topology& topology, int d,
                               const LedgerWidths& w);

}  // namespace moe

#endif  // MOE_RUNTIME_PLAN_LEDGERS_H_
