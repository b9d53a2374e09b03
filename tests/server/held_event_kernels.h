// The CPU reference kernels presented as device-resident, with IPC events the test fires by hand:
// a GPU whose work runs after the call that enqueued it (steps with rows "in device memory" and a
// done event answer before their work has finished and keep their generation lease until then).
#ifndef MOE_TESTS_SERVER_HELD_EVENT_KERNELS_H_
#define MOE_TESTS_SERVER_HELD_EVENT_KERNELS_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "kernels/api.h"

namespace moe::testing {

class HeldEventKernels final : public kernels::ExpertKernels {
 public:
  struct Event {
    std::atomic<bool> fired{true};
    int records = 0;
  };
  HeldEventKernels() : cpu_(kernels::CreateCpuKernels()) {}

  const char* name() const override { return "cpu-held-events"; }
  bool device_resident() const override { return true; }
  absl::Status Gather(const kernels::GatherParams& p, kernels::Stream s) override { return cpu_->Gather(p, s); }
  absl::Status HistogramScan(const kernels::HistogramParams& p, kernels::Stream s) override {
    return cpu_->HistogramScan(p, s);
  }
  absl::Status RouteRows(const kernels::RouteRowsParams& p, kernels::Stream s) override {
    return cpu_->RouteRows(p, s);
  }
  absl::Status Swiglu(const kernels::SwigluParams& p, kernels::Stream s) override { return cpu_->Swiglu(p, s); }
  absl::Status Combine(const kernels::CombineParams& p, kernels::Stream s) override { return cpu_->Combine(p, s); }
  absl::Status Quantize(const kernels::QuantizeParams& p, kernels::Stream s) override { return cpu_->Quantize(p, s); }
  absl::Status Dequantize(const kernels::DequantizeParams& p, kernels::Stream s) override {
    return cpu_->Dequantize(p, s);
  }
  absl::Status LocalLayer(const kernels::LocalLayerParams& p, kernels::Stream s) override {
    return cpu_->LocalLayer(p, s);
  }
  absl::Status SwigluFp8(const kernels::SwigluFp8Params& p, kernels::Stream s) override {
    return cpu_->SwigluFp8(p, s);
  }

  absl::StatusOr<void*> CreateIpcEvent(std::string* handle) override {
    events_.push_back(std::make_unique<Event>());
    *handle = std::string(64, static_cast<char>(events_.size()));
    return events_.back().get();
  }
  // The work before the record "runs" until Fire (hold_work_) or is done at once.
  absl::Status RecordEvent(void* event, kernels::Stream) override {
    auto* e = static_cast<Event*>(event);
    ++e->records;
    e->fired = !hold_work_;
    return absl::OkStatus();
  }
  absl::StatusOr<bool> EventDone(void* event) override { return static_cast<Event*>(event)->fired.load(); }
  void CloseIpcEvent(void* event) override { ++closed_; }

  void Fire(void* event) { static_cast<Event*>(event)->fired = true; }
  bool hold_work_ = true;
  int closed_ = 0;

 private:
  std::unique_ptr<kernels::ExpertKernels> cpu_;
  std::vector<std::unique_ptr<Event>> events_;
};

}  // namespace moe::testing

#endif  // MOE_TESTS_SERVER_HELD_EVENT_KERNELS_H_
