// Shared-memory regions an engine registers with its co-located moe-rankd (POSIX shm). Steps
// reference byte ranges in them instead of carrying rows inline.
//
// The daemon never maps a region: it keeps the object's descriptor and copies rows in with
// pread() and out with pwrite(), after an fstat() at every access. A region the engine shrinks
// (ftruncate) or removes while the rank holds it therefore ends in FAILED_PRECONDITION naming
// the field, never in a SIGBUS; rows are read once, at the step's start, so the engine changing
// them afterwards cannot make ranks see different inputs for one step.
//
// Only engines on the rank's host register regions: the caller's uid comes from its Unix-socket
// credentials. Only objects whose name starts with the configured prefix (default "/moe-") are
// opened, with O_NOFOLLOW; the object must be a regular file owned by the registering engine's
// user and not writable by other users. A region belongs to the uid that registered it: a step or
// an Unregister from another uid finds no such region, so one engine can neither read, write nor
// drop another's rows.
//
// Thread-safety: all methods are safe to call concurrently; a region unregistered while a step
// reads it stays open until that read ends.
#ifndef MOE_SERVER_SHARED_REGIONS_H_
#define MOE_SERVER_SHARED_REGIONS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <sys/types.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace moe {

struct SharedRegionOptions {
  std::string name_prefix = "/moe-";  // names must start with it ("/" + at least one character)
  // Registered at once (each holds a descriptor). At the cap, regions whose object has been
  // unlinked (an engine gone without unregistering) are dropped to make room.
  int max_regions = 64;
};

class SharedRegions {
 public:
  explicit SharedRegions(SharedRegionOptions options = {}) : options_(std::move(options)) {}
  ~SharedRegions();
  // Opens an existing POSIX shared-memory object of at least `bytes` bytes for the engine whose
  // uid is `caller_uid` (Unix-socket peer credentials; FAILED_PRECONDITION without one). Naming a
  // region this caller registered already registers it again (e.g. after resizing it).
  absl::Status Register(const std::string& name, uint64_t bytes, std::optional<uid_t> caller_uid);
  absl::Status Unregister(const std::string& name, std::optional<uid_t> caller_uid);
  // Copies [offset, offset + bytes) of a region `caller_uid` registered into `out`. `field` names
  // the request field in errors: FAILED_PRECONDITION for a region this caller has not registered
  // or one that shrank, INVALID_ARGUMENT for a range outside the registered size.
  absl::Status Read(const std::string& name, std::optional<uid_t> caller_uid, uint64_t offset, uint64_t bytes,
                    void* out, const char* field);
  // Checks that [offset, offset + bytes) lies in a region `caller_uid` registered (before a step runs).
  absl::Status CheckRange(const std::string& name, std::optional<uid_t> caller_uid, uint64_t offset, uint64_t bytes,
                          const char* field);
  // Copies `bytes` bytes from `in` to [offset, offset + bytes) of a region `caller_uid` registered.
  absl::Status Write(const std::string& name, std::optional<uid_t> caller_uid, uint64_t offset, uint64_t bytes,
                     const void* in, const char* field);
  int size();

 private:
  struct Region {
    ~Region();
    int fd = -1;
    uint64_t bytes = 0;  // the registered size
    uid_t owner = 0;     // the uid of the engine that registered it
  };
  absl::StatusOr<std::shared_ptr<Region>> Find(const std::string& name, std::optional<uid_t> caller_uid,
                                               uint64_t offset, uint64_t bytes, const char* field);

  const SharedRegionOptions options_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Region>> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_SHARED_REGIONS_H_
