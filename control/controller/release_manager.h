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
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "control/controller/agent_pool.h"
#include "control/store/release_store.h"
#include "proto/moe/v1/placement.pb.h"
#include "runtime/placement/topology.h"
#include "runtime/release/evidence.h"
#include "runtime/release/lifecycle.h"

namespace moe {

// Admission of a placement load against the weight memory its migration needs (0x08F): the peak
// of the overlap from the ACTIVE release's placement. Off when budget_bytes is 0.
struct MigrationBudget {
  int64_t budget_bytes = 0;
  int64_t expert_bytes = 0;  // one expert copy's parameters in one MoE layer
};

// How the ranks try a candidate: in SHADOW every shadow_every-th step also runs on it (outputs
// compared), in CANARY every canary_every-th step is served by it as well. SHADOW -> CANARY is
// refused, and the candidate drained, when the ranks counted more than max_shadow_mismatches
// shadow mismatches plus failed shadow passes of it (0x0E: runner parity differs -> block canary).
struct TrialPolicy {
  int64_t shadow_every = 4;
  int64_t canary_every = 4;
  int64_t max_shadow_mismatches = 0;
  // 0x0E "active candidate faults -> roll back to prior generation": once the ranks count this
  // many faults (failed steps, count-conservation failures, stale accepts, summed over the ranks)
  // of the ACTIVE release's placement, the reconcile rolls it back to the release its promotion
  // drained. 0: off (a failed step may be a transport's fault, not the candidate's).
  int64_t auto_rollback_faults = 0;
};

// What a promotion committed.
struct Promotion {
  GateEvidence evidence;                      // what the gate judged (empty for a retry of a committed one)
  std::vector<StoredTransition> transitions;  // committed under the request id (the replaced release's DRAINING)
  ReleaseRecord release;                      // the promoted release as the store has it now
};

// Every rank agent's status in rank order, with its address; a rank that did not answer has its
// error instead.
using RankStatuses = std::vector<std::pair<absl::StatusOr<v1::AgentStatusResponse>, std::string>>;

class ReleaseManager {
 public:
  virtual ~ReleaseManager() = default;

  // Reads of the registry.
  virtual absl::StatusOr<ReleaseRecord> Get(const std::string& release_id) = 0;
  virtual absl::StatusOr<std::vector<ReleaseRecord>> List() = 0;
  // The committed transitions of `release_id` (empty: every release) with seq > after_seq, in order.
  virtual absl::StatusOr<std::vector<StoredTransition>> History(const std::string& release_id, int64_t after_seq) = 0;
  // The rank agents' statuses (none without agents).
  virtual RankStatuses ClusterStatus() = 0;

  // A new release, BUILT (a retry with the same request id answers the same record).
  // With `bundle_json` (a release bundle, control/bundle.h) the release's digest is the bundle's,
  // computed here; a `bundle_digest` given beside it must equal it (INVALID_ARGUMENT otherwise).
  virtual absl::StatusOr<ReleaseRecord> Register(const std::string& request_id, const std::string& release_id,
                                                 const std::string& bundle_digest, const std::string& bundle_json) = 0;
  // One registry transition other than to ACTIVE (that is Promote's), driving the ranks' trials
  // after it commits; SHADOW -> CANARY is admitted only while runner parity holds.
  virtual absl::StatusOr<StoredTransition> Transition(const std::string& request_id, const std::string& release_id,
                                                      ReleaseState to, const std::string& reason) = 0;
  // CANARY -> ACTIVE through the 0x0DC gate, the ACTIVE release (if any) drained in the same
  // commit, then the ranks switched. `evidence` is the operator's; nullopt: read from the ranks.
  virtual absl::StatusOr<Promotion> Promote(const std::string& request_id, const std::string& release_id,
                                            const std::optional<GateEvidence>& evidence) = 0;
  // 0x0EA: `release_id` DRAINING and the DRAINING `prior_release_id` ACTIVE in one commit, then the
  // ordered rollback on the ranks and the candidate RETIRED. Returns every transition committed
  // for the request (an empty `reason` is "rollback").
  virtual absl::StatusOr<std::vector<StoredTransition>> Rollback(const std::string& request_id,
                                                                 const std::string& release_id,
                                                                 const std::string& prior_release_id,
                                                                 const std::string& reason) = 0;
  // The placement `manifest` prepared on every rank, then the VERIFIED release recorded LOADED
  // with it; returns the release as the store has it.
  virtual absl::StatusOr<ReleaseRecord> LoadPlacement(const std::string& request_id, const std::string& release_id,
                                                      const v1::PlacementManifest& manifest) = 0;
  // After a restart, and periodically: the ranks' active generation is made the placement of the
  // release the store records ACTIVE (a controller killed between committing a promotion or
  // rollback and driving the ranks finishes it here). Idempotent. With
  // TrialPolicy.auto_rollback_faults, first rolls back an ACTIVE release whose faults reached it.
  virtual absl::Status Reconcile() = 0;
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

  absl::StatusOr<ReleaseRecord> Get(const std::string& release_id) override;
  absl::StatusOr<std::vector<ReleaseRecord>> List() override;
  absl::StatusOr<std::vector<StoredTransition>> History(const std::string& release_id, int64_t after_seq) override;
  RankStatuses ClusterStatus() override;
  absl::StatusOr<ReleaseRecord> Register(const std::string& request_id, const std::string& release_id,
                                         const std::string& bundle_digest, const std::string& bundle_json) override;
  absl::StatusOr<StoredTransition> Transition(const std::string& request_id, const std::string& release_id,
                                              ReleaseState to, const std::string& reason) override;
  absl::StatusOr<Promotion> Promote(const std::string& request_id, const std::string& release_id,
                                    const std::optional<GateEvidence>& evidence) override;
  absl::StatusOr<std::vector<StoredTransition>> Rollback(const std::string& request_id, const std::string& release_id,
                                                         const std::string& prior_release_id,
                                                         const std::string& reason) override;
  absl::StatusOr<ReleaseRecord> LoadPlacement(const std::string& request_id, const std::string& release_id,
                                              const v1::PlacementManifest& manifest) override;
  absl::Status Reconcile() override;

 private:
  // The registered bundle's verification (none for a digest-only release), before VERIFIED.
  absl::Status VerifyRegisteredBundle(const std::string& release_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  bool drives_ranks() const { return agents_ != nullptr && !agents_->empty(); }
  // SHADOW -> CANARY admission (under write_mu_): OK to go on; otherwise the refusal, with the
  // candidate committed DRAINING (request `<request_id>/blocked`) and trials stopped.
  // ALREADY_EXISTS when `request_id` names a committed request of another kind (a registration).
  absl::Status RefuseIdOfAnotherRequest(const std::string& request_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  absl::Status AdmitCanary(const std::string& request_id, const std::string& release_id);
  // A retried Promote / Rollback / LoadPlacement: the transitions recorded under `request_id`
  // (empty when new); ALREADY_EXISTS if the id was used for a different request.
  absl::StatusOr<std::vector<StoredTransition>> Replay(const std::string& request_id, const std::string& release_id,
                                                       ReleaseState first_to) const;
  // The promotion gate's inputs for `candidate`'s placement from every rank's status (spec
  // 0x0DC): counters, the manifest digest each rank holds against the one computed here over the
  // manifest the store recorded, and whether the ACTIVE release's placement is re-activatable.
  absl::StatusOr<GateEvidence> EvidenceFromRanks(const ReleaseRecord& candidate);
  // The evidence the gate judges (the operator's, or the ranks'), and whether the gate applies
  // (not to a retry of a promotion the store committed).
  absl::StatusOr<std::pair<GateEvidence, bool>> GateInputs(const std::string& request_id, const std::string& release_id,
                                                           const std::optional<GateEvidence>& evidence);
  // The promotion's commit (under write_mu_), or the one recorded under `request_id`.
  absl::StatusOr<std::vector<StoredTransition>> CommitPromotion(const std::string& request_id,
                                                                const std::string& release_id);
  // The rollback's commit (under write_mu_), or the one recorded under `request_id`.
  // TrialPolicy.auto_rollback_faults: the ACTIVE release rolled back when its faults reached it.
  absl::Mutex auto_rollback_mu_;
  std::string auto_rollback_warned_ ABSL_GUARDED_BY(auto_rollback_mu_);  // the release warned of, once
  std::string auto_rollback_failed_ ABSL_GUARDED_BY(auto_rollback_mu_);  // the last rollback failure logged
  absl::Status RollBackAFaultingRelease();
  absl::StatusOr<std::vector<StoredTransition>> CommitRollback(const std::string& request_id,
                                                               const std::string& release_id,
                                                               const std::string& prior_release_id,
                                                               const std::string& reason);
  // What a placement load takes from a release's stored bundle: its placement and the runtime
  // coordinates every rank checks (0x0CB).
  struct StoredBundle {
    v1::PlacementManifest placement;
    v1::RuntimeCoordinates runtime;
  };
  // The stored bundle of `release_id`, read and parsed once; nullopt for a release registered
  // with a digest only.
  absl::StatusOr<std::optional<StoredBundle>> ReadStoredBundle(const std::string& release_id) const;
  // LoadPlacement's checks, ranks and commit for a new request id (under write_mu_).
  absl::Status LoadNew(const std::string& request_id, const std::string& release_id,
                       const v1::PlacementManifest& manifest, const std::optional<StoredBundle>& bundle);
  // Peak weight bytes of migrating from the ACTIVE release's placement to `to` (on the ranks'
  // topology).
  absl::StatusOr<int64_t> MigrationPeak(const std::vector<ReleaseRecord>& releases,
                                        const v1::PlacementManifest& to) const;

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
