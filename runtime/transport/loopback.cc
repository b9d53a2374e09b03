#include <cstring>
#include <deque>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#include "runtime/transport/step_gather.h"
#include "runtime/transport/transport.h"

namespace moe {

// Mailboxes of positional collectives keyed by (kind, position, source, destination); the step
// agreement's streams, one FIFO per (source, destination).
struct LoopbackFabric::State {
  absl::Mutex mu;
  std::map<std::tuple<int, uint64_t, int, int>, std::string> box ABSL_GUARDED_BY(mu);
  std::map<std::pair<int, int>, std::deque<std::pair<StepGatherHeader, std::string>>> streams ABSL_GUARDED_BY(mu);
};

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(LoopbackFabric::State* state, int slot, int size) : state_(state), slot_(slot), size_(size) {}
  const char* name() const override { return "loopback"; }
  int slot() const override { return slot_; }
  int size() const override { return size_; }

  absl::Status AllGather(uint64_t seq, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    std::vector<int64_t> send(size_, bytes), recv(size_, bytes);
    std::string packed;
    for (int i = 0; i < size_; ++i) packed.append(static_cast<const char*>(in), bytes);
    return Exchange(kGather, seq, packed.data(), send, out, recv, timeout);
  }

  absl::Status AllToAllV(uint64_t seq, const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes, absl::Duration timeout) override {
    return Exchange(kAllToAll, seq, send, send_bytes, recv, recv_bytes, timeout);
  }

  absl::Status StepGather(uint64_t step, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    Channel channel(this);
    return RunStepGather(channel, backlog_, slot_, size_, step, in, bytes, out, timeout);
  }
  void AbandonStep(uint64_t step) override {
    Channel channel(this);
    AbandonStepGather(channel, slot_, size_, step);
  }

 private:
  class Channel final : public StepGatherChannel {
   public:
    explicit Channel(LoopbackTransport* t) : t_(t) {}
    absl::Status Send(int peer, const StepGatherHeader& header, const void* payload, int64_t bytes) override {
      absl::MutexLock lock(&t_->state_->mu);
      t_->state_->streams[{t_->slot_, peer}].emplace_back(header,
                                                          std::string(static_cast<const char*>(payload), bytes));
      return absl::OkStatus();
    }
    absl::StatusOr<bool> Poll(int peer, StepGatherHeader* header, void* payload, int64_t capacity,
                              int64_t* bytes) override {
      absl::MutexLock lock(&t_->state_->mu);
      auto& q = t_->state_->streams[{peer, t_->slot_}];
      if (q.empty()) return false;
      *header = q.front().first;
      *bytes = std::min<int64_t>(capacity, static_cast<int64_t>(q.front().second.size()));
      if (*bytes > 0) std::memcpy(payload, q.front().second.data(), *bytes);
      q.pop_front();
      return true;
    }
    void Idle() override { absl::SleepFor(absl::Microseconds(20)); }

   private:
    LoopbackTransport* t_;
  };

  static constexpr int kGather = 1;
  static constexpr int kAllToAll = 2;

  absl::Status Exchange(int kind, uint64_t seq, const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                        absl::Span<const int64_t> recv_bytes, absl::Duration timeout) {
    if (static_cast<int>(send_bytes.size()) != size_ || static_cast<int>(recv_bytes.size()) != size_) {
      return absl::InvalidArgumentError("split vectors must have one entry per peer slot");
    }
    // Matched by position: this member's n-th collective pairs with every peer's n-th.
    const uint64_t position = ++collectives_;
    {
      absl::MutexLock lock(&state_->mu);
      int64_t off = 0;
      for (int i = 0; i < size_; ++i) {
        state_->box[{kind, position, slot_, i}] = std::string(static_cast<const char*>(send) + off, send_bytes[i]);
        off += send_bytes[i];
      }
    }
    const absl::Time deadline = absl::Now() + timeout;
    int64_t off = 0;
    for (int i = 0; i < size_; ++i) {
      const auto key = std::make_tuple(kind, position, i, slot_);
      absl::MutexLock lock(&state_->mu);
      auto arrived = [&]() { return state_->box.count(key) != 0; };
      if (!state_->mu.AwaitWithDeadline(absl::Condition(&arrived), deadline)) {
        return absl::DeadlineExceededError(absl::StrCat("loopback: peer slot ", i, " did not send within ",
                                                        absl::FormatDuration(timeout), " (seq ", seq, ")"));
      }
      auto it = state_->box.find(key);
      if (static_cast<int64_t>(it->second.size()) != recv_bytes[i]) {
        return absl::InternalError(
            absl::StrCat("loopback: peer slot ", i, " sent ", it->second.size(), " bytes, expected ", recv_bytes[i]));
      }
      std::memcpy(static_cast<char*>(recv) + off, it->second.data(), it->second.size());
      state_->box.erase(it);
      off += recv_bytes[i];
    }
    return absl::OkStatus();
  }

  LoopbackFabric::State* state_;
  int slot_;
  int size_;
  uint64_t collectives_ = 0;
  StepGatherBacklog backlog_;
};

LoopbackFabric::LoopbackFabric(int size) : state_(std::make_unique<State>()), size_(size) {}
LoopbackFabric::~LoopbackFabric() = default;

std::unique_ptr<Transport> LoopbackFabric::Endpoint(int slot) {
  return std::make_unique<LoopbackTransport>(state_.get(), slot, size_);
}

}  // namespace moe
