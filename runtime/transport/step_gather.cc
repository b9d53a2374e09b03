#include "runtime/transport/step_gather.h"

#include <algorithm>
#include <cstring>
#include <memory>
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
    if (i != me) ch.SendWithoutWaiting(i, h).IgnoreError();  // a failed peer is reported by the next call
  }
}

// One call of RunStepGather: which peers' records of `step` have arrived, and each peer's
// record of another step that no LEFT has withdrawn yet.
class GatherAttempt {
 public:
  GatherAttempt(StepGatherChannel& ch, StepGatherBacklog& backlog, int me, int size, uint64_t step, int64_t bytes,
                void* out)
      : ch_(ch),
        backlog_(backlog),
        me_(me),
        size_(size),
        step_(step),
        bytes_(bytes),
        out_(static_cast<char*>(out)),
        have_(backlog.have),
        pending_(backlog.pending),
        missing_(size - 1) {
    have_.assign(size, false);  // the backlog's vectors keep their capacity: nothing allocated
    pending_.assign(size, std::nullopt);
    if (backlog.scratch == nullptr) backlog.scratch.reset(new char[kMaxStepGatherRecordBytes]);
    scratch_ = backlog.scratch.get();
    have_[me] = true;
  }

  // RECORD(step, in) to every peer.
  absl::Status SendRecord(const void* in) {
    StepGatherHeader mine;
    mine.type = StepGatherHeader::kRecord;
    mine.step = step_;
    for (int i = 0; i < size_; ++i) {
      if (i == me_) continue;
      if (absl::Status s = ch_.Send(i, mine, in, bytes_); !s.ok()) return Fail(s);
    }
    return absl::OkStatus();
  }

  // Reads every peer's stream until each peer's record of `step` is in `out`, or the attempt fails.
  absl::Status CollectRecords(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (missing_ > 0) {
      bool moved = false;
      for (int i = 0; i < size_; ++i) {
        if (have_[i]) continue;
        if (absl::Status s = ReadPeer(i, &moved); !s.ok()) return s;
      }
      if (missing_ == 0) break;
      if (ch_.Interrupted()) {
        Leave(ch_, me_, size_, step_, std::nullopt);
        return absl::UnavailableError(
            absl::StrCat("step_id ", step_, ": transport interrupted, the process group is being re-formed"));
      }
      if (absl::Now() > deadline) {
        int first = -1;
        for (int i = 0; i < size_ && first < 0; ++i) {
          if (!have_[i]) first = i;
        }
        Leave(ch_, me_, size_, step_, std::nullopt);
        return absl::DeadlineExceededError(absl::StrCat("peer slot ", first, " did not join step_id ", step_,
                                                        " within ", absl::FormatDuration(timeout)));
      }
      if (!moved) ch_.Idle();
    }
    return absl::OkStatus();
  }

  // Every record is here. A peer that gave up this step after sending its record has already
  // said so if its LEFT arrived: read what has arrived (kept for later steps) and abort if so.
  absl::Status CheckLeftAfterRecords() {
    for (int i = 0; i < size_; ++i) {
      if (i == me_) continue;
      BacklogArrived(i);
      for (const StepGatherBacklog::Message& m : backlog_.from[i]) {
        if (m.header.type == StepGatherHeader::kLeft &&
            (m.header.step == step_ || (m.header.mismatch != 0 && m.header.mismatch_step == step_))) {
          Leave(ch_, me_, size_, step_, std::nullopt);
          return absl::AbortedError(
              absl::StrCat("step aborted before payload exchange: peer slot ", i, " gave up step_id ", step_));
        }
      }
    }
    return absl::OkStatus();
  }

 private:
  // Sends LEFT(step) (with `mismatch` when set) to every peer, then returns `s`.
  absl::Status Fail(absl::Status s, std::optional<uint64_t> mismatch = std::nullopt) {
    Leave(ch_, me_, size_, step_, mismatch);
    return s;
  }

  // The next message from peer i: the backlog first, then the channel.
  absl::StatusOr<bool> Next(int i, StepGatherHeader* h, int64_t* got) {
    auto& q = backlog_.from[i];
    if (q.empty()) return ch_.Poll(i, h, scratch_, kMaxStepGatherRecordBytes, got);
    *h = q.front().header;
    *got = std::min<int64_t>(kMaxStepGatherRecordBytes, static_cast<int64_t>(q.front().payload.size()));
    if (*got > 0) std::memcpy(scratch_, q.front().payload.data(), *got);
    q.pop_front();
    return true;
  }

  // Everything that has arrived from peer i, in order, until its record of this step.
  absl::Status ReadPeer(int i, bool* moved) {
    while (!have_[i]) {
      StepGatherHeader h;
      int64_t got = 0;
      auto polled = Next(i, &h, &got);
      if (!polled.ok()) return Fail(polled.status());
      if (!*polled) break;
      *moved = true;
      if (absl::Status s = Take(i, h, got); !s.ok()) return s;
    }
    if (!have_[i] && pending_[i].has_value()) {
      const uint64_t theirs = *pending_[i];
      return Fail(absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                                  " has step_id ", theirs, ", this member has step_id ", step_)),
                  theirs);
    }
    return absl::OkStatus();
  }

  // One message from peer i (its payload, `got` bytes, in scratch_).
  absl::Status Take(int i, const StepGatherHeader& h, int64_t got) {
    if (h.type == StepGatherHeader::kRecord) {
      if (h.step != step_) {
        pending_[i] = h.step;
        return absl::OkStatus();
      }
      if (got != bytes_) {
        return Fail(absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i, " sent a ",
                                                    got, "-byte agreement record, this member ", bytes_)));
      }
      std::memcpy(out_ + i * bytes_, scratch_, bytes_);
      have_[i] = true;
      --missing_;
    } else if (h.type == StepGatherHeader::kLeft) {
      if (pending_[i] == h.step) pending_[i].reset();
      if (h.mismatch != 0 && h.mismatch_step == step_) {
        return Fail(absl::AbortedError(absl::StrCat("step aborted before payload exchange: peer slot ", i,
                                                    " has step_id ", h.step, ", this member has step_id ", step_)),
                    h.step);
      }
      if (h.step == step_) {
        return Fail(absl::AbortedError(
            absl::StrCat("step aborted before payload exchange: peer slot ", i, " gave up step_id ", step_)));
      }
    }
    return absl::OkStatus();
  }

  // Moves whatever has arrived from peer i on the channel into its backlog.
  void BacklogArrived(int i) {
    while (true) {
      StepGatherBacklog::Message m;
      int64_t got = 0;
      auto polled = ch_.Poll(i, &m.header, scratch_, kMaxStepGatherRecordBytes, &got);
      if (!polled.ok() || !*polled) break;
      m.payload.assign(scratch_, static_cast<size_t>(got));
      backlog_.from[i].push_back(std::move(m));
    }
  }

  StepGatherChannel& ch_;
  StepGatherBacklog& backlog_;
  const int me_;
  const int size_;
  const uint64_t step_;
  const int64_t bytes_;
  char* const out_;
  std::vector<bool>& have_;                        // the backlog's, refilled
  std::vector<std::optional<uint64_t>>& pending_;  // the backlog's, refilled
  int missing_;
  char* scratch_ = nullptr;  // the backlog's: one message's payload, read whole (not zero-filled)
};

}  // namespace

void AbandonStepGather(StepGatherChannel& ch, int me, int size, uint64_t step) {
  Leave(ch, me, size, step, std::nullopt);
}

absl::Status RunStepGather(StepGatherChannel& ch, StepGatherBacklog& backlog, int me, int size, uint64_t step,
                           const void* in, int64_t bytes, void* out, absl::Duration timeout) {
  if (bytes < 0 || bytes > kMaxStepGatherRecordBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("step record of ", bytes, " bytes (at most ", kMaxStepGatherRecordBytes, ")"));
  }
  backlog.from.resize(size);
  GatherAttempt attempt(ch, backlog, me, size, step, bytes, out);
  if (absl::Status s = attempt.SendRecord(in); !s.ok()) return s;
  std::memcpy(static_cast<char*>(out) + me * bytes, in, bytes);
  if (absl::Status s = attempt.CollectRecords(timeout); !s.ok()) return s;
  return attempt.CheckLeftAfterRecords();
}

}  // namespace moe
