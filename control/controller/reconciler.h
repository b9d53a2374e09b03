// The controller's reconcile loop on a thread of its own: every `interval` and whenever Kick() is
// called, it runs `reconcile` (StoreReleaseManager::Reconcile: the ranks' active generation made
// the ACTIVE release's placement again).
//
// Why a thread of its own: Reconcile takes the release manager's writer lock, which a
// LoadPlacement holds while the ranks load weights (minutes for a large checkpoint). Callers that
// must not wait that long (the process-group coordinator's tick thread, which also runs the
// survivors' grace, re-forms and adoption deadlines) Kick() instead; Kick() never blocks on the
// reconcile itself.
//
// Thread-safe. Kicks that arrive while a reconcile runs are folded into one more run after it.
#ifndef MOE_CONTROL_CONTROLLER_RECONCILER_H_
#define MOE_CONTROL_CONTROLLER_RECONCILER_H_

#include <cstdint>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace moe {

class Reconciler {
 public:
  // Starts the thread. `interval` <= 0: runs only when kicked. `reconcile` is called on the
  // reconciler's thread only, one call at a time; each new failure message is logged once.
  Reconciler(std::function<absl::Status()> reconcile, absl::Duration interval);
  // Stops the thread after the run in progress (if any) returns.
  ~Reconciler();
  Reconciler(const Reconciler&) = delete;
  Reconciler& operator=(const Reconciler&) = delete;

  // Asks for a run as soon as the thread is free; returns at once.
  void Kick();

  // Runs completed so far (tests).
  int64_t runs() const;

 private:
  void Run();

  const std::function<absl::Status()> reconcile_;
  const absl::Duration interval_;
  mutable absl::Mutex mu_;
  bool kicked_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t runs_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace moe

#endif  // MOE_CONTROL_CONTROLLER_RECONCILER_H_
