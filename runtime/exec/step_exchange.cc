#include "runtime/exec/step_exchange.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<StepAgreement> AgreeOnStep(Transport& transport, const StepHeader& header,
                                          absl::Span<const int64_t> send_counts, absl::Duration timeout,
                                          absl::Span<const int64_t> slot_counts) {
  const int p = transport.size();
  if (static_cast<int>(send_counts.size()) != p) {
    return absl::InvalidArgumentError(
        absl::StrCat("send_counts: ", send_counts.size(), " entries for a group of ", p));
  }
  // Two all-gathers of little-endian int64 records, both of a size every member knows before it
  // posts them: (1) 10 header words (Q, the shadow proposal, the graph key) and the P counts; (2) only when (1) agreed, so
  // every member has the same Q, the Q per-slot route counts. Members under different placement
  // generations (different Q) therefore disagree in (1) and abort together, never in a size
  // mismatch inside (2).
  constexpr int kHeaderWords = 10;
  const int64_t q = static_cast<int64_t>(slot_counts.size());
  const int64_t words = kHeaderWords + p;
  std::vector<int64_t> mine(words);
  mine[0] = static_cast<int64_t>(header.step_id);
  mine[1] = header.layer;
  mine[2] = header.placement_version;
  mine[3] = header.process_group_epoch;
  mine[4] = header.abort;
  mine[5] = header.tokens;
  mine[6] = q;
  mine[7] = header.shadow_version;
  mine[8] = header.shadow_every;
  mine[9] = header.graph_key;
  std::memcpy(mine.data() + kHeaderWords, send_counts.data(), sizeof(int64_t) * p);
  std::vector<int64_t> all(words * p);
  absl::Status s = transport.AllGather(header.step_id * 2, mine.data(), words * 8, all.data(), timeout);
  if (!s.ok()) return s;

  for (int i = 0; i < p; ++i) {
    if (all[i * words + 4] != 0) {
      return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                             " rejected its input for this step"));
    }
  }
  static constexpr const char* kField[10] = {"step_id", "layer", "placement_generation", "process_group_epoch",
                                            "", "", "slot_count_length", "", "", ""};
  // Compare every member against slot 0: all members run this same loop over the same data.
  for (int i = 1; i < p; ++i) {
    for (int f : {0, 1, 2, 3, 6}) {
      if (all[i * words + f] != all[f]) {
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " has ",
                                               kField[f], " ", all[i * words + f], ", peer slot 0 has ", all[f]));
      }
    }
  }
  StepAgreement out;
  // The shadow pass: every member proposed the same (version, period) and the step is sampled.
  bool shadow = all[7] >= 0 && all[8] > 0 && header.step_id % static_cast<uint64_t>(all[8]) == 0;
  for (int i = 1; i < p && shadow; ++i) shadow = all[i * words + 7] == all[7] && all[i * words + 8] == all[8];
  out.shadow_version = shadow ? all[7] : -1;
  for (int i = 1; i < p; ++i) out.graph_keys_agree = out.graph_keys_agree && all[i * words + 9] == all[9];
  out.count_matrix.resize(static_cast<size_t>(p) * p);
  for (int i = 0; i < p; ++i) {
    for (int j = 0; j < p; ++j) {
      const int64_t c = all[i * words + kHeaderWords + j];
      if (c < 0) {
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                               " reports a negative count for peer slot ", j));
      }
      out.count_matrix[i * p + j] = c;
    }
  }
  out.recv_counts.resize(p);
  out.rank_tokens.resize(p);
  for (int i = 0; i < p; ++i) {
    out.recv_counts[i] = out.count_matrix[i * p + transport.slot()];
    out.rank_tokens[i] = all[i * words + 5];
  }
  out.slot_routes.assign(q, 0);
  if (q > 0) {
    std::vector<int64_t> slots(q * p);
    s = transport.AllGather(header.step_id * 2 + 1, slot_counts.data(), q * 8, slots.data(), timeout);
    if (!s.ok()) return s;
    for (int i = 0; i < p; ++i) {
      for (int64_t j = 0; j < q; ++j) out.slot_routes[j] += slots[i * q + j];
    }
  }
  return out;
}

}  // namespace moe
