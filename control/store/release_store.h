// Durable release registry for moe-controller (issue 5): SQLite in WAL mode with synchronous=FULL.
// Every lifecycle transition is committed here before the controller acts on it, so a controller
// killed at any point reopens the file and resumes from the last committed transition.
//
// Thread-safe. Writes go through one connection, one transaction at a time (write_mu_); reads
// through a second, query-only connection, so a reader (a Watch stream, the metrics collector, a
// status RPC) sees committed rows only, never those of a transaction still open on the writer.
//
// Requests are idempotent by client request id: repeating a request id with the same content
// returns the recorded result; reusing it for a different request is ALREADY_EXISTS.
#ifndef MOE_CONTROL_STORE_RELEASE_STORE_H_
#define MOE_CONTROL_STORE_RELEASE_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

#include "runtime/release/lifecycle.h"

struct sqlite3;

namespace moe {

struct ReleaseRecord {
  std::string release_id;
  std::string bundle_digest;  // digest of the release bundle (0x0C) registered with it
  ReleaseState state = ReleaseState::kBuilt;
  int64_t revision = 0;            // number of transitions applied
  int64_t placement_version = 0;   // the placement generation the release serves (0: none yet)
  std::string placement_manifest;  // its PlacementManifest as JSON, recorded with the version
};

struct StoredTransition {
  int64_t seq = 0;  // global commit order
  std::string request_id;
  int part = 0;  // position within the request's batch
  std::string release_id;
  ReleaseState from = ReleaseState::kBuilt;
  ReleaseState to = ReleaseState::kBuilt;
  std::string reason;
};

// Every write request names a request id (requests are idempotent by it): INVALID_ARGUMENT
// naming `request_id` when it is empty. The store and the release manager check it first.
absl::Status RequireRequestId(const std::string& request_id);

// The single-writer lock of a registry file: an exclusive flock on "<store>.lock", held from
// Acquire until destruction (the kernel drops it when the process dies, SIGKILL included, so a
// restarted controller is never locked out by a dead one). The holder's pid and hostname are
// written into the lock file so that a refused process can name it. Two moe-controllers on one
// registry would each accept writes the other does not serialize with (its write mutex, its
// idempotency checks, the rank agents it drives); the second one refuses to start instead.
class RegistryLock {
 public:
  // FAILED_PRECONDITION naming the holder ("held by pid P on host H") when another open file
  // description holds the lock (another process, or another RegistryLock in this one);
  // UNAVAILABLE when the lock file cannot be created.
  static absl::StatusOr<std::unique_ptr<RegistryLock>> Acquire(const std::string& store_path);
  ~RegistryLock();
  RegistryLock(const RegistryLock&) = delete;
  RegistryLock& operator=(const RegistryLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  RegistryLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_;
};

class ReleaseStore {
 public:
  // Opens or creates the database at `path` (":memory:" is refused: it is not durable).
  static absl::StatusOr<std::unique_ptr<ReleaseStore>> Open(const std::string& path);
  ~ReleaseStore();
  ReleaseStore(const ReleaseStore&) = delete;
  ReleaseStore& operator=(const ReleaseStore&) = delete;

  // Adds a release in BUILT. INVALID_ARGUMENT for an empty id or digest; ALREADY_EXISTS for a known
  // release id registered with another digest (the same id and digest is an idempotent repeat).
  // `bundle`: the release bundle's JSON, stored in the same commit (optional).
  absl::StatusOr<ReleaseRecord> Register(const std::string& request_id, const std::string& release_id,
                                         const std::string& bundle_digest, const std::string& bundle = "");
  // The bundle JSON registered with the release ("" when it was registered with a digest only).
  absl::StatusOr<std::string> Bundle(const std::string& release_id) const;

  // Commits one transition, checked against the one legal-transition table and the stored state.
  // NOT_FOUND for an unknown release, FAILED_PRECONDITION for an illegal move; nothing is written
  // on error.
  absl::StatusOr<StoredTransition> Transition(const std::string& request_id, const std::string& release_id,
                                              ReleaseState to, const std::string& reason);

  struct Move {
    std::string release_id;
    ReleaseState to;
    std::string reason;
    int64_t placement_version = 0;   // > 0: recorded on the release in the same commit,
    std::string placement_manifest;  // together with this
  };
  // Commits several transitions atomically under one request id (promotion: candidate ACTIVE and
  // prior DRAINING; rollback: candidate DRAINING and prior ACTIVE). Each move is checked against
  // the state left by the moves before it; if any is illegal nothing is written.
  absl::StatusOr<std::vector<StoredTransition>> Apply(const std::string& request_id, const std::vector<Move>& moves);

  // The transitions committed under `request_id` (empty when the id is new), for callers that
  // derive a batch from current state and must answer a retry with the recorded result.
  absl::StatusOr<std::vector<StoredTransition>> Recorded(const std::string& request_id) const;
  // Whether `request_id` names a committed request of any kind (a registration records no
  // transitions): a request of another kind under it is refused before anything is driven.
  absl::StatusOr<bool> HasRequest(const std::string& request_id) const;

  absl::StatusOr<ReleaseRecord> Get(const std::string& release_id) const;
  absl::StatusOr<std::vector<ReleaseRecord>> List() const;
  // Transitions of one release (or of all, for an empty id) in commit order.
  // Transitions in seq order (of one release, or all when `release_id` is empty), those with
  // seq > after_seq only.
  absl::StatusOr<std::vector<StoredTransition>> History(const std::string& release_id, int64_t after_seq = 0) const;
  // Checks the file (PRAGMA integrity_check) and that every release's history is a legal chain from
  // BUILT ending in its stored state. INTERNAL naming the first inconsistency.
  absl::Status Verify() const;

  // Process-group epochs (control/controller/group_coordinator.h): the highest recorded (0 when
  // none), and a new one, so epochs never repeat across controller restarts. ALREADY_EXISTS-like
  // INTERNAL when `epoch` was recorded before.
  absl::StatusOr<int64_t> LastEpoch() const;
  // The highest recorded epoch and its peers as recorded ("0,1,3"); {0, ""} when none.
  absl::StatusOr<std::pair<int64_t, std::string>> LastEpochPeers() const;
  absl::Status RecordEpoch(int64_t epoch, const std::string& reason, const std::string& peers, int64_t created_ms);

  // Tests only: called inside every write transaction just before its COMMIT (on the writing
  // thread, write_mu_ held: it may read, not write).
  void SetBeforeCommitForTest(std::function<void()> hook) { before_commit_ = std::move(hook); }

 private:
  ReleaseStore(sqlite3* db, sqlite3* read_db) : db_(db), read_db_(read_db) {}
  static absl::Status VerifyOn(sqlite3* db);
  absl::Mutex write_mu_;
  sqlite3* db_;  // the writer: used under write_mu_ (Open's migration before any other use)
  mutable absl::Mutex read_mu_;
  sqlite3* read_db_ ABSL_PT_GUARDED_BY(read_mu_);  // query_only
  std::function<void()> before_commit_;
};

}  // namespace moe

#endif  // MOE_CONTROL_STORE_RELEASE_STORE_H_
