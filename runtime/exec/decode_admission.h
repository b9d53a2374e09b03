// Decode graphs: the exact admission predicate and the phase ledgers (spec 0x05A-0x05F).
//
// A captured decode graph is bound to an immutable key (process group, placement generation,
// checkpoint, d, k, dtypes, dispatch and runner implementations, rank-token and physical-slot
// capacities). A step replays it only when it is a decode step, its key equals the graph's,
// every rank's token count and every slot's route count fit the captured capacities, and the
// stable buffers are ready; otherwise it falls back to the eager path with the first failing
// reason, never clipping rows (0x05F). Every member evaluates the predicate over the same
// agreed counts, so all members take the same path.
#ifndef MOE_RUNTIME_EXEC_DECODE_ADMISSION_H_
#define MOE_RUNTIME_EXEC_DECODE_ADMISSION_H_

#include <cstdint>
#include <string>
#include <vector>

namespace moe {

struct GraphKey {
  std::string process_group;
  int64_t placement_version = 0;
  std::string checkpoint;
  int d = 0;
  int k = 0;
  std::string activation_dtype = "bf16";
  std::string gate_dtype = "fp32";
  std::string dispatch = "all_to_all_v";
  std::string runner = "grouped";
  std::vector<int64_t> rank_token_capacity;  // per rank (peer-slot order)
  std::vector<int64_t> slot_route_capacity;  // per physical slot

  // Every field, the capacities C_T and C_q included (0x05D's K_graph).
  friend bool operator==(const GraphKey& a, const GraphKey& b);
};

struct DecodeGraph {
  std::string graph_id;  // "decode.bucket4.v17"
  GraphKey key;
  bool stable_buffers_ready = false;
};

enum class FallbackReason {
  kNone = 0,
  kPhaseNotDecode,
  kGraphKeyMismatch,
  kRankTokenCapacityExceeded,
  kExpertRouteCapacityExceeded,
  kStableBufferUnavailable,
};
const char* FallbackReasonName(FallbackReason r);

struct AdmissionStep {
  bool decode = false;
  GraphKey key;                      // the step's key (capacities ignored in the comparison)
  std::vector<int64_t> rank_tokens;  // per rank
  std::vector<int64_t> slot_routes;  // per physical slot
};

struct Admission {
  bool replay = false;
  FallbackReason reason = FallbackReason::kNone;
  std::string graph_id;
};

// `graph` null means no graph is captured for this configuration (stable_buffer_unavailable).
Admission AdmitDecodeGraph(const AdmissionStep& step, const DecodeGraph* graph);

// 0x05C / 0x05E ledgers of one execution unit.
struct UnitLedger {
  int64_t useful_input_rows = 0;
  int64_t executed_dispatch_slots = 0;  // token slots the dispatch moves (capacity for graphs)
  int64_t useful_routes = 0;
  int64_t executed_runner_rows = 0;
  int64_t graph_payload_bytes = 0;  // reserved stable-buffer payload (graph units)
  int64_t host_submissions = 0;
};
// A graph-replayed unit: dispatch executes every captured token slot, the runner every captured
// route row; reserved payload = hidden + route ids + gates + expert output + P x 3 INT32 metadata.
UnitLedger GraphUnitLedger(const GraphKey& key, const std::vector<int64_t>& rank_tokens,
                           const std::vector<int64_t>& slot_routes, int act_bytes, int num_ranks);
// An eager (variable) unit: executes exactly the useful rows.
UnitLedger EagerUnitLedger(const std::vector<int64_t>& rank_tokens, const std::vector<int64_t>& slot_routes,
                           int64_t host_submissions);

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_DECODE_ADMISSION_H_
