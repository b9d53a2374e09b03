// Agreement before payload moves (spec 0x0E "peer route counts disagree -> abort before payload
// exchange"; DESIGN "every rankd must reach the same decision for the same layer step").
//
// AgreeOnStep is collective over the step's process group: every member contributes its step
// header (step id, layer, placement generation, process-group epoch) and its count row (rows it
// sends to each peer slot). Every member receives every header, so all members reach the same
// verdict from the same data: either all proceed with the receive splits (the count matrix
// column of this member) or all return ABORTED naming the field and the disagreeing peer slot.
// No member enters the payload exchange after a disagreement.
#ifndef MOE_RUNTIME_EXEC_STEP_EXCHANGE_H_
#define MOE_RUNTIME_EXEC_STEP_EXCHANGE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

#include "runtime/transport/transport.h"

namespace moe {

struct StepHeader {
  uint64_t step_id = 0;
  int64_t layer = 0;
  int64_t placement_version = 0;
  int64_t process_group_epoch = 0;
  // Nonzero when this member rejected its own input: it still takes part in the agreement so
  // that every member aborts the step at once instead of waiting for it.
  int64_t abort = 0;
  int64_t tokens = 0;  // this member's input rows (decode-graph admission needs every rank's)
  // Shadow proposal: the candidate generation this member would also run this step on, and its
  // sampling period (-1 / 0: none). Not a reason to abort: the shadow pass runs only when every
  // member proposes the same pair and the step id is a multiple of the period.
  int64_t shadow_version = -1;
  int64_t shadow_every = 0;
  // A digest of this member's decode-graph manifest (bucket capacities, graph capability). Not a
  // reason to abort: when members differ, every member serves the step eagerly (0x0E "graph key
  // differs -> explicit eager fallback"), so no member replays a graph its peers do not.
  int64_t graph_key = 0;
  // The precision of the experts serving the step (0 BF16, 1 FP8; LayerExecutorOptions::
  // expert_dtype). Members that differ abort the step: a token's routes would be computed in
  // different precisions depending on where their experts live.
  int64_t expert_dtype = 0;
};

// Whether a shadow proposal (candidate version, period) samples step `step_id`: the agreement's
// rule (every member must also propose the same pair), which a member can apply to its own
// proposal before the agreement.
inline bool ShadowSamples(int64_t shadow_version, int64_t shadow_every, uint64_t step_id) {
  return shadow_version >= 0 && shadow_every > 0 && step_id % static_cast<uint64_t>(shadow_every) == 0;
}

struct StepAgreement {
  std::vector<int64_t> count_matrix;  // [P * P], row = source peer slot, column = destination
  std::vector<int64_t> recv_counts;   // this member's column
  std::vector<int64_t> rank_tokens;   // [P], every member's input rows
  std::vector<int64_t> slot_routes;   // [Q], routes per physical slot summed over members
  int64_t shadow_version = -1;        // agreed shadow pass for this step, -1: none
  bool graph_keys_agree = true;       // every member proposed the same graph_key
  // With send_meta: true when every member's metadata fitted its record, and then recv_meta is
  // what an all-to-all-v of send_meta by the send counts would have delivered to this member
  // (grouped by source peer slot); false: exchange it separately.
  bool meta_received = false;
  std::vector<int32_t> recv_meta;
};

// Words of a member's agreement record (header, counts, then slot counts and metadata while
// they fit): a constant, so every member posts the same size whatever its step holds. 7 KiB:
// from 8 KiB on (its own headers included) UCX switches to its rendezvous protocol, and one
// all-gather of four members on the build machine then took 450-570 us instead of 55-75
// (shm/tcp over loopback, 2 cores; 7000 and 8150 bytes were still eager).
inline constexpr int64_t kAgreementRecordWords = 896;

// `slot_counts` (optional, the same length Q on every member) are this member's routes per
// physical slot; the agreement sums them. `send_meta` (optional, null: none; every member of a
// step passes one or none): one int32 per send position,
// grouped by destination peer slot as send_counts; when every member's fits the record beside
// its slot counts (a decode-sized step), it is delivered with the agreement, one collective for
// both. Slot counts beyond the record take a second all-gather.
absl::StatusOr<StepAgreement> AgreeOnStep(Transport& transport, const StepHeader& header,
                                          absl::Span<const int64_t> send_counts, absl::Duration timeout,
                                          absl::Span<const int64_t> slot_counts = {},
                                          const std::vector<int32_t>* send_meta = nullptr);

// The records of an agreement (this member's, every member's, the slot counts when they take a
// second all-gather), kept between steps so that their memory is reused.
struct AgreementScratch {
  std::vector<int64_t> mine, all, slots;
};

// Count conservation (0x0DC's N_count_failure): with slot counts given, a member's count row
// (routes it sends) must sum to its slot counts (routes it sends, by physical slot). A record that
// does not aborts the step everywhere; that ABORTED status carries this payload, so that the
// member counts the failure (GenerationCounters::count_failures).
inline constexpr char kCountConservationPayload[] = "type.moe/count_conservation";
bool IsCountConservationFailure(const absl::Status& s);

// AgreeOnStep into *out, whose vectors (and the scratch's) keep their memory from step to step:
// a step of the same shape allocates nothing. On an error *out is unspecified.
absl::Status AgreeOnStepInto(Transport& transport, const StepHeader& header, absl::Span<const int64_t> send_counts,
                             absl::Duration timeout, absl::Span<const int64_t> slot_counts,
                             const std::vector<int32_t>* send_meta, AgreementScratch* scratch, StepAgreement* out);

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_STEP_EXCHANGE_H_
