#include "runtime/exec/step_exchange.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {

absl::StatusOr<StepAgreement> AgreeOnStep(Transport& transport, const StepHeader& header,
                                          absl::Span<const int64_t> send_counts, absl::Duration timeout,
                                          absl::Span<const int64_t> slot_counts, const std::vector<int32_t>* send_meta) {
  const int p = transport.size();
  if (static_cast<int>(send_counts.size()) != p) {
    return absl::InvalidArgumentError(
        absl::StrCat("send_counts: ", send_counts.size(), " entries for a group of ", p));
  }
  // One all-gather of little-endian int64 records of a size every member knows before it posts
  // them (kAgreementRecordWords): 11 header words (Q, the shadow proposal, the graph key, the
  // metadata entries inline or -1), the P counts, then the Q slot counts when they fit, then the
  // metadata (int32 pairs) when it fits too. Members under different placement generations
  // (different Q) disagree on the header and abort together, never in a size mismatch. Only
  // when Q exceeds the record do the slot counts take a second all-gather (every member then
  // has the same Q).
  constexpr int kHeaderWords = 11;
  const int64_t q = static_cast<int64_t>(slot_counts.size());
  const int64_t inline_room = std::max<int64_t>(0, kAgreementRecordWords - kHeaderWords - p);
  const int64_t words = kHeaderWords + p + inline_room;
  const bool counts_inline = q <= inline_room;
  const int64_t n_meta = send_meta != nullptr ? static_cast<int64_t>(send_meta->size()) : 0;
  const bool meta_inline = send_meta != nullptr && counts_inline && q + (n_meta + 1) / 2 <= inline_room;
  std::vector<int64_t> mine(words, 0);
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
  mine[10] = meta_inline ? n_meta : -1;
  std::memcpy(mine.data() + kHeaderWords, send_counts.data(), sizeof(int64_t) * p);
  int64_t* inline_words = mine.data() + kHeaderWords + p;
  if (counts_inline && q > 0) std::memcpy(inline_words, slot_counts.data(), sizeof(int64_t) * q);
  if (meta_inline && n_meta > 0) std::memcpy(inline_words + q, send_meta->data(), sizeof(int32_t) * n_meta);
  std::vector<int64_t> all(words * p);
  // Matched by step (Transport::StepGather): members in different steps abort at once.
  absl::Status s = transport.StepGather(header.step_id, mine.data(), words * 8, all.data(), timeout);
  if (!s.ok()) return s;

  for (int i = 0; i < p; ++i) {
    if (all[i * words + 4] != 0) {
      return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                             " rejected its input for this step"));
    }
  }
  static constexpr const char* kField[kHeaderWords] = {"step_id", "layer", "placement_generation",
                                                      "process_group_epoch", "", "", "slot_count_length", "", "",
                                                      "", ""};
  // Compare every member against slot 0: all members run this same loop over the same data.
  for (int i = 1; i < p; ++i) {
    for (int f : {0, 1, 2, 3, 6}) {
      if (all[i * words + f] != all[f]) {
        // The step id is unsigned on the wire (shadow passes add 2^56).
        auto shown = [&](int64_t v) { return f == 0 ? absl::StrCat(static_cast<uint64_t>(v)) : absl::StrCat(v); };
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " has ",
                                               kField[f], " ", shown(all[i * words + f]), ", peer slot 0 has ",
                                               shown(all[f])));
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
  if (counts_inline) {
    for (int i = 0; i < p; ++i) {
      const int64_t* theirs = all.data() + i * words + kHeaderWords + p;
      for (int64_t j = 0; j < q; ++j) out.slot_routes[j] += theirs[j];
    }
  } else {
    std::vector<int64_t> slots(q * p);
    s = transport.AllGather(header.step_id, slot_counts.data(), q * 8, slots.data(), timeout);
    if (!s.ok()) return s;
    for (int i = 0; i < p; ++i) {
      for (int64_t j = 0; j < q; ++j) out.slot_routes[j] += slots[i * q + j];
    }
  }
  // The metadata, when every member's came inline: this member's segment of each record.
  bool every_meta = send_meta != nullptr;
  for (int i = 0; i < p && every_meta; ++i) every_meta = all[i * words + 10] >= 0;
  if (every_meta) {
    const int me = transport.slot();
    int64_t total = 0;
    for (int i = 0; i < p; ++i) total += out.count_matrix[i * p + me];
    out.recv_meta.resize(total);
    int64_t at = 0;
    for (int i = 0; i < p; ++i) {
      int64_t entries = 0, before = 0;
      for (int j = 0; j < p; ++j) {
        entries += out.count_matrix[i * p + j];
        if (j < me) before += out.count_matrix[i * p + j];
      }
      if (all[i * words + 10] != entries) {
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " sent ",
                                               all[i * words + 10], " metadata entries for ", entries, " routes"));
      }
      const char* theirs = reinterpret_cast<const char*>(all.data() + i * words + kHeaderWords + p + q);
      const int64_t n = out.count_matrix[i * p + me];
      if (n > 0) std::memcpy(out.recv_meta.data() + at, theirs + before * sizeof(int32_t), n * sizeof(int32_t));
      at += n;
    }
    out.meta_received = true;
  }
  return out;
}

}  // namespace moe
