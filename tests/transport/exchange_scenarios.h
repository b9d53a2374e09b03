// Scenarios every Transport implementation must pass, run by one member (peer slot). Each
// returns OkStatus when the member observed the expected outcome.
#ifndef MOE_TESTS_TRANSPORT_EXCHANGE_SCENARIOS_H_
#define MOE_TESTS_TRANSPORT_EXCHANGE_SCENARIOS_H_

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "runtime/exec/step_exchange.h"
#include "runtime/transport/transport.h"

namespace moe::testing {

inline uint8_t Pattern(int src, int dst, uint64_t seq, int64_t i) {
  return static_cast<uint8_t>((src * 131 + dst * 17 + seq * 7 + i) & 0xff);
}

// Header agreement, then a random all-to-all-v (zero-count peers included) over `rounds` steps;
// every member derives the same count matrix from the seed and checks every received byte.
inline absl::Status RandomExchange(Transport& t, int rounds, uint32_t seed) {
  const int p = t.size(), me = t.slot();
  for (int r = 0; r < rounds; ++r) {
    std::mt19937 rng(seed + r);
    std::vector<int64_t> matrix(p * p);
    for (auto& c : matrix) c = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 5000);
    std::vector<int64_t> send(matrix.begin() + me * p, matrix.begin() + (me + 1) * p);
    StepHeader h{static_cast<uint64_t>(100 + r), 7, 17, 12};
    auto agreement = AgreeOnStep(t, h, send, absl::Seconds(20));
    if (!agreement.ok()) return agreement.status();
    std::vector<uint8_t> out, in;
    for (int j = 0; j < p; ++j) {
      for (int64_t i = 0; i < send[j]; ++i) out.push_back(Pattern(me, j, h.step_id, i));
    }
    int64_t total = 0;
    for (int64_t c : agreement->recv_counts) total += c;
    in.assign(total, 0);
    absl::Status s = t.AllToAllV(h.step_id, out.data(), send, in.data(), agreement->recv_counts, absl::Seconds(20));
    if (!s.ok()) return s;
    int64_t off = 0;
    for (int j = 0; j < p; ++j) {
      if (agreement->recv_counts[j] != matrix[j * p + me])
        return absl::InternalError("recv split is not the transpose");
      for (int64_t i = 0; i < agreement->recv_counts[j]; ++i) {
        if (in[off + i] != Pattern(j, me, h.step_id, i)) {
          return absl::InternalError(absl::StrCat("byte ", i, " from slot ", j, " corrupted in round ", r));
        }
      }
      off += agreement->recv_counts[j];
    }
  }
  return absl::OkStatus();
}

// `bad_slot` proposes another layer: every member must get ABORTED and none may exchange payload.
inline absl::Status HeaderMismatchAbortsEveryone(Transport& t, int bad_slot) {
  std::vector<int64_t> send(t.size(), 1);
  StepHeader h{200, t.slot() == bad_slot ? 8 : 7, 17, 12};
  auto agreement = AgreeOnStep(t, h, send, absl::Seconds(20));
  if (agreement.ok()) return absl::InternalError("a disagreeing header was accepted");
  if (agreement.status().code() != absl::StatusCode::kAborted) return agreement.status();
  if (std::string(agreement.status().message()).find("layer") == std::string::npos) {
    return absl::InternalError(absl::StrCat("abort does not name the field: ", agreement.status().message()));
  }
  // Still serving: the next step agrees normally.
  StepHeader next{201, 7, 17, 12};
  return AgreeOnStep(t, next, send, absl::Seconds(20)).status();
}

// `odd_slot` is still on another placement generation with another slot count (a rollout in
// progress): every member must get ABORTED naming the generation, none a transport error, and
// the next step (all on the same generation) agrees, slot routes summed over the members.
inline absl::Status GenerationSplitAbortsEveryone(Transport& t, int odd_slot) {
  std::vector<int64_t> send(t.size(), 1);
  const bool odd = t.slot() == odd_slot;
  const std::vector<int64_t> slots(odd ? 20 : 18, 1);
  auto agreement = AgreeOnStep(t, StepHeader{400, 7, odd ? 2 : 1, 12}, send, absl::Seconds(20), slots);
  if (agreement.ok()) return absl::InternalError("members on different generations agreed");
  if (agreement.status().code() != absl::StatusCode::kAborted) return agreement.status();
  if (std::string(agreement.status().message()).find("placement_generation") == std::string::npos) {
    return absl::InternalError(absl::StrCat("abort does not name the generation: ", agreement.status().message()));
  }
  // Each member's route to peer j goes to physical slot j: its slot counts sum to its count row
  // (count conservation).
  std::vector<int64_t> same(20, 0);
  for (int j = 0; j < t.size(); ++j) ++same[j % same.size()];
  auto next = AgreeOnStep(t, StepHeader{401, 7, 2, 12}, send, absl::Seconds(20), same);
  if (!next.ok()) return next.status();
  for (size_t q = 0; q < next->slot_routes.size(); ++q) {
    if (next->slot_routes[q] != same[q] * t.size()) {
      return absl::InternalError(absl::StrCat("slot ", q, "'s routes summed to ", next->slot_routes[q]));
    }
  }
  return absl::OkStatus();
}

// Proposals that do not abort: a graph key differing on `odd_slot` makes every member see
// graph_keys_agree = false; a shadow proposal runs only when every member makes the same one
// and the step id is a multiple of its period.
inline absl::Status ProposalsAgreeOrNot(Transport& t, int odd_slot) {
  std::vector<int64_t> send(t.size(), 1);
  StepHeader h{500, 7, 17, 12};
  h.graph_key = t.slot() == odd_slot ? 99 : 42;
  h.shadow_version = 18;
  h.shadow_every = 5;
  auto a = AgreeOnStep(t, h, send, absl::Seconds(20));
  if (!a.ok()) return a.status();
  if (a->graph_keys_agree) return absl::InternalError("differing graph keys reported as agreeing");
  if (a->shadow_version != 18) return absl::InternalError("a sampled, unanimous shadow proposal was not agreed");
  h = StepHeader{501, 7, 17, 12};
  h.graph_key = 42;
  h.shadow_version = t.slot() == odd_slot ? -1 : 18;
  h.shadow_every = 1;
  a = AgreeOnStep(t, h, send, absl::Seconds(20));
  if (!a.ok()) return a.status();
  if (!a->graph_keys_agree) return absl::InternalError("equal graph keys reported as differing");
  if (t.size() > 1 && a->shadow_version != -1) return absl::InternalError("a shadow pass agreed without every member");
  return absl::OkStatus();
}

// Slot metadata with the agreement: decode-sized steps (zero-route members included) deliver
// to every member what an all-to-all-v of the metadata would, checked against that exchange;
// a step where one member's metadata exceeds the record, or slot counts that exceed it (they
// take a second all-gather and still sum), delivers none to anyone (each then exchanges it
// separately).
inline absl::Status MetadataRidesWithTheAgreement(Transport& t) {
  const int p = t.size(), me = t.slot();
  for (int r = 0; r < 4; ++r) {
    std::mt19937 rng(77 + r);
    std::vector<int64_t> matrix(p * p);
    const bool big = r == 3;  // slot 0 sends more entries than the record holds
    for (int i = 0; i < p; ++i) {
      for (int j = 0; j < p; ++j) {
        matrix[i * p + j] = big && i == 0 ? 3000 + j : (rng() % 3 == 0 || i == p - 1 ? 0 : rng() % 40);
      }
    }
    std::vector<int64_t> send(matrix.begin() + me * p, matrix.begin() + (me + 1) * p);
    std::vector<int32_t> meta;
    for (int j = 0; j < p; ++j) {
      for (int64_t i = 0; i < send[j]; ++i) meta.push_back(me * 100000 + j * 1000 + static_cast<int32_t>(i));
    }
    // The member's routes by physical slot (they sum to its count row: count conservation): all
    // of them in slot 1 + me.
    std::vector<int64_t> slots(r == 2 ? kAgreementRecordWords : 24, 0);
    for (int64_t c : send) slots[1 + me] += c;
    const StepHeader h{static_cast<uint64_t>(600 + r), 7, 17, 12};
    auto a = AgreeOnStep(t, h, send, absl::Seconds(20), slots, &meta);
    if (!a.ok()) return a.status();
    const bool fits = r < 2;
    if (a->meta_received != fits) {
      return absl::InternalError(absl::StrCat("round ", r, ": meta_received ", a->meta_received));
    }
    for (size_t q = 0; q < a->slot_routes.size(); ++q) {
      int64_t want = 0;  // member q - 1's routes
      if (q >= 1 && static_cast<int>(q) <= p) {
        for (int j = 0; j < p; ++j) want += matrix[(q - 1) * p + j];
      }
      if (a->slot_routes[q] != want) {
        return absl::InternalError(absl::StrCat("round ", r, ": slot ", q, " routes ", a->slot_routes[q]));
      }
    }
    std::vector<int64_t> send_bytes(p), recv_bytes(p);
    int64_t total = 0;
    for (int j = 0; j < p; ++j) {
      send_bytes[j] = send[j] * 4;
      recv_bytes[j] = a->recv_counts[j] * 4;
      total += a->recv_counts[j];
    }
    std::vector<int32_t> exchanged(total);
    absl::Status s = t.AllToAllV(h.step_id, meta.data(), send_bytes, exchanged.data(), recv_bytes, absl::Seconds(20));
    if (!s.ok()) return s;
    if (fits && a->recv_meta != exchanged) {
      return absl::InternalError(absl::StrCat("round ", r, ": metadata differs from the all-to-all-v's"));
    }
    if (!fits && !a->recv_meta.empty()) return absl::InternalError("metadata delivered without every member's");
  }
  return absl::OkStatus();
}

// What a step with a dead peer must end in, on a live member: DEADLINE_EXCEEDED or UNAVAILABLE
// (the agreement's status `s`), within the timeout (2 s of slack). OK when it did.
inline absl::Status DeadPeerFailure(const absl::Status& s, absl::Duration took, absl::Duration timeout) {
  if (s.ok()) return absl::InternalError("a step with a dead peer succeeded");
  if (s.code() != absl::StatusCode::kDeadlineExceeded && s.code() != absl::StatusCode::kUnavailable) return s;
  if (took > timeout + absl::Seconds(2)) {
    return absl::InternalError(absl::StrCat("failure took ", absl::FormatDuration(took), ", beyond the timeout"));
  }
  return absl::OkStatus();
}

// The member at `dead_slot` never takes part: everyone else must fail within the timeout.
inline absl::Status SilentPeerTimesOut(Transport& t, absl::Duration timeout) {
  std::vector<int64_t> send(t.size(), 1);
  const absl::Time start = absl::Now();
  auto agreement = AgreeOnStep(t, StepHeader{300, 7, 17, 12}, send, timeout);
  const absl::Duration took = absl::Now() - start;
  return DeadPeerFailure(agreement.status(), took, timeout);
}

// The member at `dead_slot` takes part in one step, then dies. Every other member must see an
// error (DEADLINE_EXCEEDED or UNAVAILABLE) within the timeout: at the latest on the next step.
inline absl::Status KilledPeerFailsFast(Transport& t, int dead_slot, absl::Duration timeout,
                                        const std::function<void()>& die) {
  std::vector<int64_t> send(t.size(), 1);
  for (uint64_t seq : {299u, 300u}) {
    if (seq == 300u && t.slot() == dead_slot) die();
    const absl::Time start = absl::Now();
    auto agreement = AgreeOnStep(t, StepHeader{seq, 7, 17, 12}, send, timeout);
    const absl::Duration took = absl::Now() - start;
    if (agreement.ok() && seq == 299u) continue;  // the peer was still alive for this step
    return DeadPeerFailure(agreement.status(), took, timeout);
  }
  return absl::InternalError("unreachable");
}

}  // namespace moe::testing

#endif  // MOE_TESTS_TRANSPORT_EXCHANGE_SCENARIOS_H_
