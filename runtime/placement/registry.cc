#include "runtime/placement/registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moe {

const char* GenerationStateName(GenerationState s) {
  switch (s) {
    case GenerationState::kPrepared:
      return "PREPARED";
    case GenerationState::kActive:
      return "ACTIVE";
    case GenerationState::kDraining:
      return "DRAINING";
    case GenerationState::kRetired:
      return "RETIRED";
  }
  return "UNKNOWN";
}

GenerationLease::GenerationLease(GenerationLease&& other) noexcept
    : registry_(other.registry_), manifest_(std::move(other.manifest_)), handle_(other.handle_) {
  other.registry_ = nullptr;
}

GenerationLease& GenerationLease::operator=(GenerationLease&& other) noexcept {
  if (this != &other) {
    if (held()) Release().IgnoreError();
    registry_ = other.registry_;
    manifest_ = std::move(other.manifest_);
    handle_ = other.handle_;
    other.registry_ = nullptr;
  }
  return *this;
}

GenerationLease::~GenerationLease() {
  if (held()) Release().IgnoreError();
}

absl::Status GenerationLease::Release() {
  if (!held()) return absl::FailedPreconditionError("generation lease already released");
  GenerationRegistry* registry = registry_;
  registry_ = nullptr;
  return registry->ReleaseLease(manifest_->version(), handle_);
}

namespace {
std::string Name(PlacementVersion v) { return absl::StrCat("placement-v", v.value()); }
}  // namespace

absl::Status GenerationRegistry::Prepare(std::shared_ptr<const PlacementManifest> manifest) {
  if (manifest == nullptr) return absl::InvalidArgumentError("manifest: null");
  absl::MutexLock lock(&mu_);
  const int64_t v = manifest->version().value();
  if (generations_.count(v) != 0)
    return absl::AlreadyExistsError(absl::StrCat(Name(manifest->version()), " is already registered"));
  if (bound_epoch_ != 0 && manifest->epoch().value() != bound_epoch_) {
    return absl::FailedPreconditionError(absl::StrCat(Name(manifest->version()), " names process-group epoch ",
                                                      manifest->epoch().value(), "; the group re-formed as epoch ",
                                                      bound_epoch_, " (prepare it again)"));
  }
  Entry& e = generations_[v];
  e.manifest = std::move(manifest);
  e.state = GenerationState::kPrepared;
  return absl::OkStatus();
}

absl::Status GenerationRegistry::Activate(PlacementVersion v) {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  if (it == generations_.end()) return absl::NotFoundError(absl::StrCat(Name(v), " is not registered"));
  Entry& e = it->second;
  if (e.state == GenerationState::kRetired) {
    return absl::FailedPreconditionError(absl::StrCat(Name(v), " is RETIRED and cannot be activated"));
  }
  if (e.state == GenerationState::kActive) return absl::OkStatus();
  if (active_ >= 0) generations_[active_].state = GenerationState::kDraining;
  e.state = GenerationState::kActive;
  active_ = v.value();
  return absl::OkStatus();
}

absl::Status GenerationRegistry::StopDispatch(PlacementVersion v) {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  if (it == generations_.end()) return absl::NotFoundError(absl::StrCat(Name(v), " is not registered"));
  if (it->second.state != GenerationState::kActive) {
    return absl::FailedPreconditionError(
        absl::StrCat(Name(v), " is ", GenerationStateName(it->second.state), ", not ACTIVE"));
  }
  it->second.state = GenerationState::kDraining;
  active_ = -1;
  return absl::OkStatus();
}

bool GenerationRegistry::CanRetire(PlacementVersion v) const {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  return it != generations_.end() && it->second.state != GenerationState::kActive &&
         it->second.state != GenerationState::kRetired && it->second.holders.empty();
}

absl::Status GenerationRegistry::Retire(PlacementVersion v) {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  if (it == generations_.end()) return absl::NotFoundError(absl::StrCat(Name(v), " is not registered"));
  Entry& e = it->second;
  if (e.state == GenerationState::kRetired) return absl::OkStatus();
  if (e.state == GenerationState::kActive) {
    return absl::FailedPreconditionError(absl::StrCat("retirement of ", Name(v), " denied: it is ACTIVE"));
  }
  if (!e.holders.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("retirement of ", Name(v), " denied: refcount = ", e.holders.size()));
  }
  e.state = GenerationState::kRetired;
  return absl::OkStatus();
}

absl::Status GenerationRegistry::Discard(PlacementVersion v) {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  if (it == generations_.end()) return absl::NotFoundError(absl::StrCat(Name(v), " is not registered"));
  const Entry& e = it->second;
  if (e.state != GenerationState::kPrepared) {
    return absl::FailedPreconditionError(absl::StrCat("discard of ", Name(v), " denied: it is ",
                                                      GenerationStateName(e.state),
                                                      " (only a PREPARED generation "
                                                      "that never served is discarded; retire it instead)"));
  }
  if (!e.holders.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("discard of ", Name(v), " denied: trial refcount = ", e.holders.size()));
  }
  generations_.erase(it);
  return absl::OkStatus();
}

bool GenerationRegistry::Entry::Hold(int64_t handle) {
  if (std::find(holders.begin(), holders.end(), handle) != holders.end()) return false;
  holders.push_back(handle);
  return true;
}

bool GenerationRegistry::Entry::Release(int64_t handle) {
  auto it = std::find(holders.begin(), holders.end(), handle);
  if (it == holders.end()) return false;
  *it = holders.back();
  holders.pop_back();
  return true;
}

absl::StatusOr<GenerationLease> GenerationRegistry::AcquireActive(HandleId handle) {
  absl::MutexLock lock(&mu_);
  if (active_ < 0) return absl::UnavailableError("no ACTIVE placement generation");
  Entry& e = generations_[active_];
  if (!e.Hold(handle.value())) {
    return absl::AlreadyExistsError(
        absl::StrCat("handle ", handle.value(), " already holds ", Name(e.manifest->version())));
  }
  return GenerationLease(this, e.manifest, handle);
}

absl::StatusOr<GenerationLease> GenerationRegistry::AcquireTrial(PlacementVersion v, HandleId handle) {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  if (it == generations_.end()) return absl::FailedPreconditionError(absl::StrCat(Name(v), " is not registered"));
  Entry& e = it->second;
  if (e.state != GenerationState::kPrepared) {
    return absl::FailedPreconditionError(
        absl::StrCat(Name(v), " is ", GenerationStateName(e.state), "; trial steps run on a PREPARED candidate"));
  }
  if (!e.Hold(handle.value())) {
    return absl::AlreadyExistsError(absl::StrCat("handle ", handle.value(), " already holds ", Name(v)));
  }
  return GenerationLease(this, e.manifest, handle);
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> GenerationRegistry::RequireTrial(PlacementVersion v) const {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  if (it == generations_.end()) return absl::FailedPreconditionError(absl::StrCat(Name(v), " is not registered"));
  // A candidate promoted (or stopped) while a trial step was in flight still holds its weights:
  // the step finishes against it. Only a retired generation is gone.
  if (it->second.state == GenerationState::kRetired) {
    return absl::FailedPreconditionError(absl::StrCat(Name(v), " is RETIRED"));
  }
  return it->second.manifest;
}

absl::StatusOr<std::shared_ptr<const PlacementManifest>> GenerationRegistry::RequireLive(PlacementVersion v) const {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  if (it == generations_.end()) return absl::FailedPreconditionError(absl::StrCat(Name(v), " is not registered"));
  if (it->second.state != GenerationState::kActive && it->second.state != GenerationState::kDraining) {
    return absl::FailedPreconditionError(
        absl::StrCat(Name(v), " is ", GenerationStateName(it->second.state), ", not live"));
  }
  return it->second.manifest;
}

absl::Status GenerationRegistry::ReleaseLease(PlacementVersion v, HandleId handle) {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  if (it == generations_.end() || !it->second.Release(handle.value())) {
    return absl::FailedPreconditionError(absl::StrCat("handle ", handle.value(), " holds no reference on ", Name(v)));
  }
  return absl::OkStatus();
}

absl::Status GenerationRegistry::Rebind(const ProcessGroup& group, const Topology& topology) {
  absl::MutexLock lock(&mu_);
  std::map<int64_t, std::shared_ptr<const PlacementManifest>> bound;
  for (const auto& [v, e] : generations_) {
    if (!e.holders.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("placement-v", v, ": ", e.holders.size(),
                                                        " dispatch handles still hold it; cannot rebind to epoch ",
                                                        group.epoch().value()));
    }
    if (e.state == GenerationState::kRetired) continue;
    absl::StatusOr<std::shared_ptr<const PlacementManifest>> m = e.manifest->Rebound(group, topology);
    if (!m.ok()) return m.status();
    bound[v] = *std::move(m);
  }
  for (auto& [v, m] : bound) generations_[v].manifest = std::move(m);
  bound_epoch_ = group.epoch().value();
  return absl::OkStatus();
}

absl::StatusOr<GenerationState> GenerationRegistry::State(PlacementVersion v) const {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  if (it == generations_.end()) return absl::NotFoundError(absl::StrCat(Name(v), " is not registered"));
  return it->second.state;
}

int64_t GenerationRegistry::Refcount(PlacementVersion v) const {
  absl::MutexLock lock(&mu_);
  auto it = generations_.find(v.value());
  return it == generations_.end() ? 0 : static_cast<int64_t>(it->second.holders.size());
}

int64_t GenerationRegistry::ActiveVersion() const {
  absl::MutexLock lock(&mu_);
  return active_;
}

std::vector<GenerationInfo> GenerationRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<GenerationInfo> out;
  for (const auto& [v, e] : generations_) {
    out.push_back(GenerationInfo{PlacementVersion(v), e.state, static_cast<int64_t>(e.holders.size()), e.manifest});
  }
  return out;
}

}  // namespace moe
