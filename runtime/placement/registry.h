// Generation registry with refcount fences (spec 0x02B2, 0x02B3, 0x08G).
//
// States: PREPARED (loaded beside the active one, not eligible) -> ACTIVE (eligible for new
// dispatches) -> DRAINING (ineligible for new dispatches, still valid for pinned handles) ->
// RETIRED (no dispatch or combine may resolve through it). Exactly one generation is ACTIVE at
// a time; activating another demotes the previous one to DRAINING atomically.
//
// A dispatch acquires a GenerationLease on the ACTIVE generation; retirement is denied while
// any lease on that generation is held. Combine resolves the lease's own generation through
// RequireLive(), never "the active one".
//
// Thread-safety: all methods are safe to call concurrently (one mutex; no call blocks).
#ifndef MOE_RUNTIME_PLACEMENT_REGISTRY_H_
#define MOE_RUNTIME_PLACEMENT_REGISTRY_H_

#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

#include "runtime/ids.h"
#include "runtime/placement/manifest.h"

namespace moe {

enum class GenerationState { kPrepared, kActive, kDraining, kRetired };
const char* GenerationStateName(GenerationState s);

class GenerationRegistry;

// A held reference on one generation. Movable, not copyable. Releases on destruction if the
// holder did not release explicitly (error paths must not leak a fence).
class GenerationLease {
 public:
  GenerationLease() = default;
  GenerationLease(GenerationLease&& other) noexcept;
  GenerationLease& operator=(GenerationLease&& other) noexcept;
  GenerationLease(const GenerationLease&) = delete;
  GenerationLease& operator=(const GenerationLease&) = delete;
  ~GenerationLease();

  bool held() const { return registry_ != nullptr; }
  PlacementVersion version() const { return manifest_->version(); }
  HandleId handle() const { return handle_; }
  const std::shared_ptr<const PlacementManifest>& manifest() const { return manifest_; }
  // Returns the reference to the registry. FAILED_PRECONDITION if already released.
  absl::Status Release();

 private:
  friend class GenerationRegistry;
  GenerationLease(GenerationRegistry* registry, std::shared_ptr<const PlacementManifest> manifest, HandleId handle)
      : registry_(registry), manifest_(std::move(manifest)), handle_(handle) {}

  GenerationRegistry* registry_ = nullptr;
  std::shared_ptr<const PlacementManifest> manifest_;
  HandleId handle_;
};

struct GenerationInfo {
  PlacementVersion version;
  GenerationState state;
  int64_t refcount;
  std::shared_ptr<const PlacementManifest> manifest;
};

class GenerationRegistry {
 public:
  GenerationRegistry() = default;
  GenerationRegistry(const GenerationRegistry&) = delete;
  GenerationRegistry& operator=(const GenerationRegistry&) = delete;

  // Adds a generation in PREPARED. ALREADY_EXISTS for a known version; FAILED_PRECONDITION for a
  // manifest of another process-group epoch than the last Rebind's (one verified against the
  // group before it re-formed, registered after).
  absl::Status Prepare(std::shared_ptr<const PlacementManifest> manifest);
  // PREPARED -> ACTIVE; the previous ACTIVE generation (if any) becomes DRAINING.
  // A DRAINING generation may be re-activated (rollback); RETIRED may not.
  absl::Status Activate(PlacementVersion v);
  // ACTIVE -> DRAINING without a replacement (stop new dispatch).
  absl::Status StopDispatch(PlacementVersion v);
  // DRAINING -> RETIRED. FAILED_PRECONDITION while any lease is held or if ACTIVE.
  absl::Status Retire(PlacementVersion v);
  // Forgets a PREPARED generation, as if it had never been prepared (a placement load that failed
  // on another rank): it never served, so no handle names it, and the version may be prepared
  // again, with other slots too. NOT_FOUND for an unknown version; FAILED_PRECONDITION once it
  // has been activated (it is then retired, never forgotten) or while a trial lease holds it.
  absl::Status Discard(PlacementVersion v);
  bool CanRetire(PlacementVersion v) const;

  // Acquires a lease on the ACTIVE generation for `handle`. UNAVAILABLE when none is active.
  absl::StatusOr<GenerationLease> AcquireActive(HandleId handle);
  // The manifest of a live (ACTIVE or DRAINING) generation. FAILED_PRECONDITION otherwise.
  absl::StatusOr<std::shared_ptr<const PlacementManifest>> RequireLive(PlacementVersion v) const;
  // Trial passes (shadow and canary steps of a candidate): a lease on a PREPARED generation,
  // counted by the same refcount fence, so the candidate cannot retire under a trial step.
  absl::StatusOr<GenerationLease> AcquireTrial(PlacementVersion v, HandleId handle);
  // The manifest of a trial handle's generation at combine: PREPARED, or promoted / stopped since
  // the step began. FAILED_PRECONDITION once RETIRED (which its lease prevents).
  absl::StatusOr<std::shared_ptr<const PlacementManifest>> RequireTrial(PlacementVersion v) const;

  // Binds every generation that is not RETIRED to a re-formed process group
  // (PlacementManifest::Rebound), all or nothing. FAILED_PRECONDITION while any lease is held
  // (the caller has stopped steps first) or when a generation has a slot outside `group`.
  absl::Status Rebind(const ProcessGroup& group, const Topology& topology);

  absl::StatusOr<GenerationState> State(PlacementVersion v) const;
  int64_t Refcount(PlacementVersion v) const;
  // -1 if none is active.
  int64_t ActiveVersion() const;
  std::vector<GenerationInfo> List() const;

 private:
  friend class GenerationLease;
  struct Entry {
    std::shared_ptr<const PlacementManifest> manifest;
    GenerationState state = GenerationState::kPrepared;
    // Handle ids holding a lease, unordered: a few at a time, and a vector keeps its memory, so
    // a step's lease allocates nothing once the generation has served one.
    std::vector<int64_t> holders;
    bool Hold(int64_t handle);     // false: already held by that handle
    bool Release(int64_t handle);  // false: not held by it
  };
  absl::Status ReleaseLease(PlacementVersion v, HandleId handle);

  mutable absl::Mutex mu_;
  std::map<int64_t, Entry> generations_ ABSL_GUARDED_BY(mu_);
  int64_t active_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t bound_epoch_ ABSL_GUARDED_BY(mu_) = 0;  // the last Rebind's epoch (0: none yet)
};

}  // namespace moe

#endif  // MOE_RUNTIME_PLACEMENT_REGISTRY_H_
