#include "runtime/exec/step_exchange.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace moe {
namespace {

// One all-gather of little-endian int64 records of a size every member knows before it posts
// them (kAgreementRecordWords): 11 header words (Q, the shadow proposal, the graph key, the
// metadata entries inline or -1), the P counts, then the Q slot counts when they fit, then the
// metadata (int32 pairs) when it fits too. Members under different placement generations
// (different Q) disagree on the header and abort together, never in a size mismatch. Only
// when Q exceeds the record do the slot counts take a second all-gather (every member then
// has the same Q).
constexpr int kHeaderWords = 12;
// The most routes one member can send in a step: --max_step_tokens is at most 2^24 and top-k at
// most 64. A record above it is corrupt (sums of counts below it cannot overflow).
constexpr int64_t kMaxMemberRoutes = (int64_t{1} << 24) * 64;
enum Word {
  kStepId,
  kLayer,
  kGeneration,
  kEpoch,
  kAbort,
  kTokens,
  kSlotCount,
  kShadowVersion,
  kShadowEvery,
  kGraphKey,
  kMetaEntries,
  kExpertDtype
};

struct RecordLayout {
  RecordLayout(int peers, int64_t slots, const std::vector<int32_t>* send_meta)
      : p(peers),
        q(slots),
        inline_room(std::max<int64_t>(0, kAgreementRecordWords - kHeaderWords - peers)),
        words(kHeaderWords + peers + inline_room),
        counts_inline(slots <= inline_room),
        n_meta(send_meta != nullptr ? static_cast<int64_t>(send_meta->size()) : 0),
        meta_inline(send_meta != nullptr && counts_inline && slots + (n_meta + 1) / 2 <= inline_room) {}
  const int p;
  const int64_t q, inline_room, words;
  const bool counts_inline;
  const int64_t n_meta;
  const bool meta_inline;
  // Word f of member i's record in the gathered records.
  int64_t At(const std::vector<int64_t>& all, int i, int f) const { return all[i * words + f]; }
  const int64_t* Inline(const std::vector<int64_t>& all, int i) const {
    return all.data() + i * words + kHeaderWords + p;
  }
};

void EncodeRecord(const RecordLayout& l, const StepHeader& header, absl::Span<const int64_t> send_counts,
                  absl::Span<const int64_t> slot_counts, const std::vector<int32_t>* send_meta,
                  std::vector<int64_t>* record) {
  std::vector<int64_t>& mine = *record;
  mine.assign(l.words, 0);
  mine[kStepId] = static_cast<int64_t>(header.step_id);
  mine[kLayer] = header.layer;
  mine[kGeneration] = header.placement_version;
  mine[kEpoch] = header.process_group_epoch;
  mine[kAbort] = header.abort;
  mine[kTokens] = header.tokens;
  mine[kSlotCount] = l.q;
  mine[kShadowVersion] = header.shadow_version;
  mine[kShadowEvery] = header.shadow_every;
  mine[kGraphKey] = header.graph_key;
  mine[kMetaEntries] = l.meta_inline ? l.n_meta : -1;
  mine[kExpertDtype] = header.expert_dtype;
  std::memcpy(mine.data() + kHeaderWords, send_counts.data(), sizeof(int64_t) * l.p);
  int64_t* inline_words = mine.data() + kHeaderWords + l.p;
  if (l.counts_inline && l.q > 0) std::memcpy(inline_words, slot_counts.data(), sizeof(int64_t) * l.q);
  if (l.meta_inline && l.n_meta > 0) std::memcpy(inline_words + l.q, send_meta->data(), sizeof(int32_t) * l.n_meta);
}

// ABORTED when any member set the abort flag or any member's identity words differ from slot
// 0's. All members run this same check over the same data, so they abort together.
absl::Status CheckHeaders(const RecordLayout& l, const std::vector<int64_t>& all) {
  for (int i = 0; i < l.p; ++i) {
    if (l.At(all, i, kAbort) != 0) {
      return absl::AbortedError(
          absl::StrCat("step aborted before payload exchange: peer slot ", i, " rejected its input for this step"));
    }
  }
  static constexpr const char* kField[kHeaderWords] = {
      "step_id", "layer", "placement_generation", "process_group_epoch", "", "", "slot_count_length", "", "",
      "",        "",      "expert_dtype"};
  for (int i = 1; i < l.p; ++i) {
    for (int f : {kStepId, kLayer, kGeneration, kEpoch, kSlotCount, kExpertDtype}) {
      if (l.At(all, i, f) != all[f]) {
        // The step id is unsigned on the wire (shadow passes add 2^56).
        auto shown = [&](int64_t v) {
          if (f == kExpertDtype) return std::string(v == 1 ? "fp8" : v == 0 ? "bf16" : "unknown");
          return f == kStepId ? absl::StrCat(static_cast<uint64_t>(v)) : absl::StrCat(v);
        };
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " has ",
                                               kField[f], " ", shown(l.At(all, i, f)), ", peer slot 0 has ",
                                               shown(all[f])));
      }
    }
  }
  return absl::OkStatus();
}

// The shadow decision, the graph keys and the count matrix from the gathered records.
absl::Status ReadAgreement(const RecordLayout& l, const std::vector<int64_t>& all, uint64_t step_id, int me,
                           StepAgreement* out) {
  const int p = l.p;
  // The shadow pass: every member proposed the same (version, period) and the step is sampled.
  bool shadow = ShadowSamples(all[kShadowVersion], all[kShadowEvery], step_id);
  for (int i = 1; i < p && shadow; ++i) {
    shadow = l.At(all, i, kShadowVersion) == all[kShadowVersion] && l.At(all, i, kShadowEvery) == all[kShadowEvery];
  }
  out->shadow_version = shadow ? all[kShadowVersion] : -1;
  for (int i = 1; i < p; ++i)
    out->graph_keys_agree = out->graph_keys_agree && l.At(all, i, kGraphKey) == all[kGraphKey];
  out->count_matrix.resize(static_cast<size_t>(p) * p);
  for (int i = 0; i < p; ++i) {
    int64_t row = 0;
    for (int j = 0; j < p; ++j) {
      const int64_t c = l.At(all, i, kHeaderWords + j);
      if (c < 0) {
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                               " reports a negative count for peer slot ", j));
      }
      if (c > kMaxMemberRoutes - row) {
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                               " reports more than ", kMaxMemberRoutes, " routes"));
      }
      row += c;
      out->count_matrix[i * p + j] = c;
    }
  }
  out->recv_counts.resize(p);
  out->rank_tokens.resize(p);
  for (int i = 0; i < p; ++i) {
    out->recv_counts[i] = out->count_matrix[i * p + me];
    out->rank_tokens[i] = l.At(all, i, kTokens);
  }
  return absl::OkStatus();
}

// Routes per physical slot summed over members: from the records, or a second all-gather when
// the slot counts did not fit them.
absl::Status SumSlotRoutes(const RecordLayout& l, const std::vector<int64_t>& all, Transport& transport,
                           const StepHeader& header, absl::Span<const int64_t> slot_counts, absl::Duration timeout,
                           std::vector<int64_t>* gathered, StepAgreement* out) {
  const int p = l.p;
  const int64_t q = l.q;
  out->slot_routes.assign(q, 0);
  const int64_t* from = nullptr;  // member i's q counts at from + i * stride
  int64_t stride = 0;
  if (l.counts_inline) {
    from = l.Inline(all, 0);
    stride = l.words;
  } else {
    std::vector<int64_t>& slots = *gathered;
    slots.resize(q * p);
    absl::Status s = transport.AllGather(header.step_id, slot_counts.data(), q * 8, slots.data(), timeout);
    if (!s.ok()) return s;
    from = slots.data();
    stride = q;
  }
  for (int i = 0; i < p; ++i) {
    const int64_t* theirs = from + i * stride;
    int64_t total = 0;
    for (int64_t j = 0; j < q; ++j) {
      if (theirs[j] < 0 || theirs[j] > kMaxMemberRoutes - total) {
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                               " reports slot count ", theirs[j], " for physical slot ", j));
      }
      total += theirs[j];
      out->slot_routes[j] += theirs[j];
    }
    int64_t sent = 0;  // bounded by ReadAgreement
    for (int j = 0; j < p; ++j) sent += out->count_matrix[static_cast<size_t>(i) * p + j];
    if (q > 0 && total != sent) {
      absl::Status s = absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " sends ",
                                                       sent, " routes but counts ", total,
                                                       " by physical slot (count conservation, 0x0DC)"));
      s.SetPayload(kCountConservationPayload, absl::Cord(absl::StrCat(i)));
      return s;
    }
  }
  return absl::OkStatus();
}

// The metadata, when every member's came inline: this member's segment of each record.
absl::Status ReadInlineMeta(const RecordLayout& l, const std::vector<int64_t>& all, int me, StepAgreement* out) {
  const int p = l.p;
  int64_t total = 0;
  for (int i = 0; i < p; ++i) total += out->count_matrix[i * p + me];
  out->recv_meta.resize(total);
  int64_t at = 0;
  for (int i = 0; i < p; ++i) {
    int64_t entries = 0, before = 0;
    for (int j = 0; j < p; ++j) {
      entries += out->count_matrix[i * p + j];
      if (j < me) before += out->count_matrix[i * p + j];
    }
    if (l.At(all, i, kMetaEntries) != entries) {
      return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " sent ",
                                             l.At(all, i, kMetaEntries), " metadata entries for ", entries, " routes"));
    }
    if (!l.counts_inline || entries > 2 * (l.inline_room - l.q)) {
      // A sender puts its entries inline only where they fit (RecordLayout): these do not.
      return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " claims ", entries,
                                             " metadata entries inline, more than its record holds"));
    }
    const char* theirs = reinterpret_cast<const char*>(l.Inline(all, i) + l.q);
    const int64_t n = out->count_matrix[i * p + me];
    if (n > 0) std::memcpy(out->recv_meta.data() + at, theirs + before * sizeof(int32_t), n * sizeof(int32_t));
    at += n;
  }
  out->meta_received = true;
  return absl::OkStatus();
}

}  // namespace

bool IsCountConservationFailure(const absl::Status& s) {
  return s.code() == absl::StatusCode::kAborted && s.GetPayload(kCountConservationPayload).has_value();
}

absl::Status AgreeOnStepInto(Transport& transport, const StepHeader& header, absl::Span<const int64_t> send_counts,
                             absl::Duration timeout, absl::Span<const int64_t> slot_counts,
                             const std::vector<int32_t>* send_meta, AgreementScratch* scratch, StepAgreement* out) {
  const int p = transport.size();
  if (static_cast<int>(send_counts.size()) != p) {
    return absl::InvalidArgumentError(absl::StrCat("send_counts: ", send_counts.size(), " entries for a group of ", p));
  }
  out->shadow_version = -1;
  out->graph_keys_agree = true;
  out->meta_received = false;
  out->recv_meta.clear();
  const RecordLayout layout(p, static_cast<int64_t>(slot_counts.size()), send_meta);
  EncodeRecord(layout, header, send_counts, slot_counts, send_meta, &scratch->mine);
  std::vector<int64_t>& all = scratch->all;
  all.resize(layout.words * p);
  // Matched by step (Transport::StepGather): members in different steps abort at once.
  absl::Status s = transport.StepGather(header.step_id, scratch->mine.data(), layout.words * 8, all.data(), timeout);
  if (!s.ok()) return s;
  if (s = CheckHeaders(layout, all); !s.ok()) return s;
  if (s = ReadAgreement(layout, all, header.step_id, transport.slot(), out); !s.ok()) return s;
  if (s = SumSlotRoutes(layout, all, transport, header, slot_counts, timeout, &scratch->slots, out); !s.ok()) return s;
  bool every_meta = send_meta != nullptr;
  for (int i = 0; i < p && every_meta; ++i) every_meta = layout.At(all, i, kMetaEntries) >= 0;
  if (every_meta) {
    if (s = ReadInlineMeta(layout, all, transport.slot(), out); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<StepAgreement> AgreeOnStep(Transport& transport, const StepHeader& header,
                                          absl::Span<const int64_t> send_counts, absl::Duration timeout,
                                          absl::Span<const int64_t> slot_counts,
                                          const std::vector<int32_t>* send_meta) {
  AgreementScratch scratch;
  StepAgreement out;
  if (absl::Status s = AgreeOnStepInto(transport, header, send_counts, timeout, slot_counts, send_meta, &scratch, &out);
      !s.ok()) {
    return s;
  }
  return out;
}

}  // namespace moe
