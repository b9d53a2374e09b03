#include "runtime/exec/recorded_work.h"

#include <utility>

namespace moe {

namespace {
constexpr int kMaxFailures = 2;  // recordings tried per key before it stays eager
}  // namespace

RecordedWork::RecordedWork(kernels::ExpertKernels* kernels, int capacity)
    : kernels_(kernels), capacity_(capacity < 1 ? 1 : capacity) {}

RecordedWork::~RecordedWork() {
  for (auto& [key, e] : entries_) Drop(e);
}

void RecordedWork::Drop(Entry& e) {
  if (e.work != nullptr) kernels_->DropCaptured(e.work);
  e.work = nullptr;
}

absl::Status RecordedWork::Eager(absl::FunctionRef<absl::Status(kernels::Stream)> enqueue) {
  ++stats_.eager;
  return enqueue(nullptr);
}

absl::Status RecordedWork::Run(const Key& key, absl::FunctionRef<absl::Status(kernels::Stream)> enqueue,
                               bool* launched) {
  bool unused = false;
  bool& ran_recording = launched != nullptr ? *launched : unused;
  ran_recording = false;
  if (!supported_) return Eager(enqueue);
  const uint64_t now = ++clock_;
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    if (static_cast<int>(entries_.size()) >= capacity_) {
      auto oldest = entries_.begin();
      for (auto i = entries_.begin(); i != entries_.end(); ++i) {
        if (i->second.used < oldest->second.used) oldest = i;
      }
      if (now - oldest->second.used <= 2 * static_cast<uint64_t>(capacity_)) {
        ++stats_.full;  // every kept key ran recently: keep them, run this one eagerly
        return Eager(enqueue);
      }
      if (oldest->second.work != nullptr) ++stats_.evicted;
      Drop(oldest->second);
      entries_.erase(oldest);
    }
    it = entries_.emplace(key, Entry{}).first;
  }
  Entry& e = it->second;
  e.used = now;
  if (e.work != nullptr) {
    absl::StatusOr<bool> ran = kernels_->LaunchCaptured(e.work, nullptr);
    if (!ran.ok()) return ran.status();
    if (*ran) {
      ++stats_.launches;
      ran_recording = true;
      return absl::OkStatus();
    }
    ++stats_.stale;  // memory it may name was freed: start again from an eager step
    Drop(e);
    e.eager_runs = 0;
  }
  if (e.eager_runs == 0 || e.failures >= kMaxFailures) {
    ++e.eager_runs;
    return Eager(enqueue);
  }
  absl::StatusOr<kernels::Stream> stream = kernels_->BeginCapture();
  if (!stream.ok()) {
    if (stream.status().code() == absl::StatusCode::kUnimplemented) supported_ = false;
    ++e.failures;
    ++stats_.failed;
    stats_.last_failure = std::string(stream.status().message());
    return Eager(enqueue);
  }
  absl::Status enqueued = enqueue(*stream);
  absl::StatusOr<void*> work = kernels_->EndCapture(*stream);  // always: it ends the capture
  if (!enqueued.ok() || !work.ok()) {
    if (work.ok()) kernels_->DropCaptured(*work);
    ++e.failures;
    ++stats_.failed;
    stats_.last_failure = std::string(!enqueued.ok() ? enqueued.message() : work.status().message());
    return Eager(enqueue);  // nothing of the recording ran
  }
  e.work = *work;
  ++stats_.recorded;
  absl::StatusOr<bool> ran = kernels_->LaunchCaptured(e.work, nullptr);
  if (!ran.ok()) return ran.status();
  if (!*ran) {  // memory changed between the recording's end and its launch: not expected
    ++stats_.stale;
    Drop(e);
    e.eager_runs = 0;
    return Eager(enqueue);
  }
  ++stats_.launches;
  ran_recording = true;
  return absl::OkStatus();
}

}  // namespace moe
