#include "control/controller/reconciler.h"

#include <string>
#include <utility>

#include "spdlog/spdlog.h"

namespace moe {

Reconciler::Reconciler(std::function<absl::Status()> reconcile, absl::Duration interval)
    : reconcile_(std::move(reconcile)), interval_(interval) {
  thread_ = std::thread([this] { Run(); });
}

Reconciler::~Reconciler() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void Reconciler::Kick() {
  absl::MutexLock lock(&mu_);
  kicked_ = true;
}

int64_t Reconciler::runs() const {
  absl::MutexLock lock(&mu_);
  return runs_;
}

void Reconciler::Run() {
  std::string last;
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return kicked_ || stopping_; };
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      const absl::Condition cond(&woken);
      if (interval_ > absl::ZeroDuration()) {
        mu_.AwaitWithTimeout(cond, interval_);
      } else {
        mu_.Await(cond);
      }
      if (stopping_) return;
      kicked_ = false;  // kicks from here on ask for the run after this one
    }
    const absl::Status s = reconcile_();
    const std::string now = s.ok() ? "" : std::string(s.message());
    if (now != last && !s.ok()) spdlog::warn("reconcile: {}", now);  // each new failure once
    last = now;
    absl::MutexLock lock(&mu_);
    ++runs_;
  }
}

}  // namespace moe
