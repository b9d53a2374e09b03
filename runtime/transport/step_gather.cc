#include "runtime/transport/step_gather.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe {
namespace {

// Ends a failed attempt: every peer learns that this member left `step`.
void Leave(StepGatherChannel& ch, int me, int size, uint64_t step, std::optional<uint64_t> mismatch) {
  StepGatherHeader h;
  h.type = StepGatherHeader::kLeft;
  h.step = step;
  h.mismatch = mismatch.has_value() ? 1 : 0;
  h.mismatch_step = mismatch.value_or(0);
  for (int i = 0; i < size; ++i) {
    if (i != me) ch.Send(i, h, nullptr, 0).IgnoreError();  // a failed peer is reported by the next call
  }
}

}  // namespace

absl::Status RunStepGather(StepGatherChannel& ch, StepGatherBacklog& backlog, int me, int size, uint64_t step,
                           const void* in, int64_t bytes, void* out, absl::Duration timeout) {
  backlog.from.resize(size);
  // The next message from peer i: the backlog first, then the channel.
  auto next = [&](int i, StepGatherHeader* h, void* payload, int64_t* got) -> absl::StatusOr<bool> {
    auto& q = backlog.from[i];
    if (q.empty()) return ch.Poll(i, h, payload, bytes, got);
    *h = q.front().header;
    *got = std::min<int64_t>(bytes, static_cast<int64_t>(q.front().payload.size()));
    if (*got > 0) std::memcpy(payload, q.front().payload.data(), *got);
    q.pop_front();
    return true;
  };
  StepGatherHeader mine;
  mine.type = StepGatherHeader::kRecord;
  mine.step = step;
  for (int i = 0; i < size; ++i) {
    if (i == me) continue;
    if (absl::Status s = ch.Send(i, mine, in, bytes); !s.ok()) {
      Leave(ch, me, size, step, std::nullopt);
      return s;
    }
  }
  std::memcpy(static_cast<char*>(out) + me * bytes, in, bytes);
  std::vector<bool> have(size, false);
  std::vector<std::optional<uint64_t>> pending(size);  // a peer's RECORD of another step, not yet left
  have[me] = true;
  int missing = size - 1;
  std::vector<char> scratch(bytes);
  const absl::Time deadline = absl::Now() + timeout;
  while (missing > 0) {
    bool moved = false;
    for (int i = 0; i < size; ++i) {
      if (have[i]) continue;
      // Everything that has arrived from peer i, in order, until its record of this step.
      while (!have[i]) {
        StepGatherHeader h;
        int64_t got = 0;
        char* slot = static_cast<char*>(out) + i * bytes;
        auto polled = next(i, &h, scratch.data(), &got);
        if (!polled.ok()) {
          Leave(ch, me, size, step, std::nullopt);
          return polled.status();
        }
        if (!*polled) break;
        moved = true;
        if (h.type == StepGatherHeader::kRecord) {
          if (h.step == step) {
            if (got != bytes) {
              Leave(ch, me, size, step, std::nullopt);
              return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " sent a ",
                                                     got, "-byte agreement record, this member ", bytes));
            }
            std::memcpy(slot, scratch.data(), bytes);
            have[i] = true;
            --missing;
          } else {
            pending[i] = h.step;
          }
        } else if (h.type == StepGatherHeader::kLeft) {
          if (pending[i] == h.step) pending[i].reset();
          if (h.mismatch != 0 && h.mismatch_step == step) {
            Leave(ch, me, size, step, h.step);
            return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                                   " has step_id ", h.step, ", this member has step_id ", step));
          }
          if (h.step == step) {
            Leave(ch, me, size, step, std::nullopt);
            return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                                   " gave up step_id ", step));
          }
        }
      }
      if (!have[i] && pending[i].has_value()) {
        const uint64_t theirs = *pending[i];
        Leave(ch, me, size, step, theirs);
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " has step_id ",
                                               theirs, ", this member has step_id ", step));
      }
    }
    if (missing == 0) break;
    if (absl::Now() > deadline) {
      int first = -1;
      for (int i = 0; i < size && first < 0; ++i) {
        if (!have[i]) first = i;
      }
      Leave(ch, me, size, step, std::nullopt);
      return absl::DeadlineExceededError(absl::StrCat("peer slot ", first, " did not join step_id ", step, " within ",
                                                      absl::FormatDuration(timeout)));
    }
    if (!moved) ch.Idle();
  }
  // Every record is here. A peer that gave up this step after sending its record has already
  // said so if its LEFT arrived: read what has arrived (kept for later steps) and abort if so.
  for (int i = 0; i < size; ++i) {
    if (i == me) continue;
    while (true) {
      StepGatherBacklog::Message m;
      m.payload.resize(bytes);
      int64_t got = 0;
      auto polled = ch.Poll(i, &m.header, m.payload.data(), bytes, &got);
      if (!polled.ok() || !*polled) break;
      m.payload.resize(got);
      backlog.from[i].push_back(std::move(m));
    }
    for (const StepGatherBacklog::Message& m : backlog.from[i]) {
      if (m.header.type == StepGatherHeader::kLeft && (m.header.step == step || (m.header.mismatch != 0 && m.header.mismatch_step == step))) {
        Leave(ch, me, size, step, std::nullopt);
        return absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                               " gave up step_id ", step));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace moe
