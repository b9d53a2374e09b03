// The control plane's release logic, apart from its gRPC edge (control_plane_service.h, which
// authorizes a call, decodes it, calls one method here and encodes the answer): registry
// transitions through the durable store (control/store), requests made idempotent by their request
// ids, the SHADOW -> CANARY admission, the promotion gate (spec 0x0DC), the ordered rollback
// (0x0EA) and placement loads over the rank agents.
//
// Errors are absl::Status whose code and message the service hands to the client as they are.
// Mutating methods are serialized (one at a time), so a promotion or rollback reads and writes one
// consistent registry, and each commit is one atomic store batch: a controller killed mid-request
// leaves either all of it or none of it. Every method is synchronous and thread-safe.
#ifndef MOE_CONTROL_CONTROLLER_RELEASE_MANAGER_H_
#define MOE_CONTROL_CONTROLLER_RELEASE_MANAGER_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "control/controller/agent_pool.h"
#include "control/store/release_store.h"
#include "runtime/placement/topology.h"
#include "runtime/release/lifecycle.h"

namespace moe {

// Admission of a placement load against the weight memory its migration needs (0x08F): the peak
// of the overlap from the ACTIVE release's placement. Off when budget_bytes is 0.
struct MigrationBudget {
  int64_t budget_bytes = 0;
  int64_t expert_bytes = 0;  // one expert copy's parameters
};

// How the ranks try a candidate: in SHADOW every shadow_every-th step also runs on it (outputs
// compared), in CANARY every canary_every-th step is served by it as well. SHADOW -> CANARY is
// refused, and the candidate drained, when the ranks counted more than max_shadow_mismatches
// shadow mismatches plus failed shadow passes of it (0x0E: runner parity differs -> block canary).
struct TrialPolicy {
  int64_t shadow_every = 4;
  int64_t canary_every = 4;
  int64_t max_shadow_mismatches = 0;
};

class ReleaseManager {
 public:
  virtual ~ReleaseManager() = default;

  // A new release, BUILT (a retry with the same request id answers the same record).
  virtual absl::StatusOr<ReleaseRecord> Register(const std::string& request_id, const std::string& release_id,
                                                 const std::string& bundle_digest) = 0;
  // One registry transition other than to ACTIVE (that is Promote's), driving the ranks' trials
  // after it commits; SHADOW -> CANARY is admitted only while runner parity holds.
  virtual absl::StatusOr<StoredTransition> Transition(const std::string& request_id, const std::string& release_id,
                                                      ReleaseState to, const std::string& reason) = 0;
};

// The production manager: the registry in `store`, the releases' placements driven onto `agents`.
class StoreReleaseManager final : public ReleaseManager {
 public:
  // `agents` (may be null or empty: the registry alone) are the ranks the releases' placements
  // are driven onto; `topology` is theirs (one rank per agent, required with agents): placement
  // manifests are read, digested and migrated against it. Neither `store` nor `agents` is owned.
  StoreReleaseManager(ReleaseStore* store, PromotionThresholds thresholds = {}, AgentPool* agents = nullptr,
                      std::optional<Topology> topology = std::nullopt, absl::Duration drain_timeout = absl::Seconds(60),
                      MigrationBudget migration = {}, TrialPolicy trial = {});

  absl::StatusOr<ReleaseRecord> Register(const std::string& request_id, const std::string& release_id,
                                         const std::string& bundle_digest) override;
  absl::StatusOr<StoredTransition> Transition(const std::string& request_id, const std::string& release_id,
                                              ReleaseState to, const std::string& reason) override;

  // NOTE: only while some mutating RPCs are still served by ControlPlaneServiceImpl itself: they
  // take this lock so that every mutating request stays serialized.
  absl::Mutex* write_mu() { return &write_mu_; }

 private:
  bool drives_ranks() const { return agents_ != nullptr && !agents_->empty(); }
  // SHADOW -> CANARY admission (under write_mu_): OK to go on; otherwise the refusal, with the
  // candidate committed DRAINING (request `<request_id>/blocked`) and trials stopped.
  absl::Status AdmitCanary(const std::string& request_id, const std::string& release_id);

  ReleaseStore* store_;
  const PromotionThresholds thresholds_;
  AgentPool* agents_;
  const std::optional<Topology> topology_;  // the agents' ranks; set whenever agents_ is non-empty
  const absl::Duration drain_timeout_;
  const MigrationBudget migration_;
  const TrialPolicy trial_;
  absl::Mutex write_mu_;  // one mutating request at a time
};

}  // namespace moe

#endif  // MOE_CONTROL_CONTROLLER_RELEASE_MANAGER_H_
