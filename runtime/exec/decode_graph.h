// The decode latency path's CUDA graph (spec 0x05D-0x05F), behind an interface with no CUDA
// types so the layer executor stays host code; the implementation (cuda_decode_graph.h) lives
// with the CUDA kernels and the NCCL transport.
//
// One graph per bucket and generation, captured once over stable buffers sized by the bucket:
//   pack (gather token rows into fixed peer segments, padding rows zero)
//   -> grouped ncclSend/ncclRecv of every segment
//   -> experts over this rank's local slots (device offsets, the gather from the received
//      segments fused into the operand loads; the decode kernels, or GEMMs over padded slots)
//   -> unpack into return segments -> the return exchange
//   -> gate-weighted combine (FP32 accumulation) into [rank_tokens, d].
// Each replay copies this step's host tables into the stable buffers (one copy), launches the
// graph and waits with the transport's deadline. The host decides everything that varies per
// step (admission, plans, tables); the graph's shape never changes.
#ifndef MOE_RUNTIME_EXEC_DECODE_GRAPH_H_
#define MOE_RUNTIME_EXEC_DECODE_GRAPH_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe {

struct DecodeGraphShape {
  int peers = 0;
  int64_t segment_rows = 0;  // rows per peer segment: rank_tokens * k bounds any rank's routes to one peer
  int local_slots = 0;
  int64_t slot_routes = 0;  // routes per local slot the bucket admits
  int64_t rank_tokens = 0;
  int d = 0;
  int d_ff = 0;
  int k = 0;
  // The runner (D_runner of the graph key, spec 0x05D): false, the decode kernels over the
  // compact segments (one pass over a hit expert's weights per 8 or 16 of its rows); true, every
  // local slot computed at slot_routes rows by tensor-core GEMMs of fixed shape (padding zeroed,
  // never returned), which wins once most slots receive a few rows or more
  // (ChoosePaddedRunner).
  bool padded_runner = false;
  // This generation's weights in device memory ([L, 2 d_ff, d] and [L, d, d_ff]); they must
  // outlive the graph.
  const uint16_t* w_gate_up = nullptr;
  const uint16_t* w_down = nullptr;
  // FP8 experts instead (LayerExecutorOptions::expert_dtype): E4M3 weights with their 128 x 128
  // block scales, all four set or none (kernels::Fp8ExpertWeights); the BF16 pointers are then
  // null and the runner is the decode kernels' grouped layout.
  const uint8_t* fp8_gate_up = nullptr;
  const float* fp8_gate_up_scales = nullptr;
  const uint8_t* fp8_down = nullptr;
  const float* fp8_down_scales = nullptr;
  // Capture first runs the pipeline once eagerly with every peer (connections, scratch).
  absl::Duration warmup_timeout = absl::Seconds(30);
};

// How a bucket's expert step runs (the layer executor's option; part of the graph key).
enum class DecodeRunner { kAuto, kKernels, kPadded };
// The runner a bucket gets: kAuto takes the padded GEMMs when a full bucket is expected to give
// each physical slot at least two rows (peers * rank_tokens * k / total_slots >= 2). The
// padded runner reads every local slot's weights, hit or not, and the decode kernels only the hit
// ones; with most slots hit the GEMMs' single pass wins (H200, bench/RESULTS.md: E=128 64
// tokens 324 us against 420, E=32 16 tokens 692 against 816; with 1 row per expert expected,
// E=128 16 tokens, 323 against 195). `kernels_beat_padded` (ExpertKernels::DecodeGemmBeatsPadded
// for the bucket's rows: CUDA's Hopper grouped kernels) keeps kAuto off the padded runner.
bool ChoosePaddedRunner(DecodeRunner runner, int peers, int64_t rank_tokens, int k, int64_t total_slots,
                        bool kernels_beat_padded = false);
absl::StatusOr<DecodeRunner> ParseDecodeRunner(const std::string& name);

// One step's tables, host memory. Row r of peer j's segment is at j * segment_rows + r.
struct DecodeGraphTables {
  const uint16_t* hidden = nullptr;  // [tokens, d]
  bool rows_on_device = false;       // hidden and the output rows are in device memory
  // With rows_on_device, optional: recorded after the output rows' copy instead of waiting for it
  // (LayerStepInput::done_event).
  void* done_event = nullptr;
  int64_t tokens = 0;                       // <= rank_tokens
  const int32_t* send_index = nullptr;      // [peers * segment_rows]: source token, -1 padding
  const int32_t* expert_rows = nullptr;     // [local_slots * slot_routes]: received row per layout row
  const int64_t* expert_offsets = nullptr;  // [local_slots + 1]
  const int32_t* layout_row = nullptr;      // [peers * segment_rows]: layout row per received row, -1 padding
  const int32_t* row_of_route = nullptr;    // [rank_tokens * k]: returned row per route, -1 none
  const float* gates = nullptr;             // [rank_tokens * k]
};

class DecodeStepGraph {
 public:
  virtual ~DecodeStepGraph() = default;
  // Writes [tables.tokens, d] BF16 rows to `out` (host, or device memory with
  // tables.rows_on_device). Every member of the group replays its
  // graph for the same step; a peer that does not turns into DEADLINE_EXCEEDED after `timeout`.
  virtual absl::Status Replay(uint64_t seq, const DecodeGraphTables& tables, uint16_t* out, absl::Duration timeout) = 0;
};

// Captures a graph for a shape. Called by every member at the same step (the first admitted
// replay of a bucket), because capture warms up the peer connections collectively.
using DecodeGraphFactory = std::function<absl::StatusOr<std::unique_ptr<DecodeStepGraph>>(const DecodeGraphShape&)>;

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_DECODE_GRAPH_H_
