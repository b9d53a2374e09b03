// Shared-memory regions an engine registers with its co-located moe-rankd (POSIX shm, mapped
// read-write). Steps reference byte ranges in them instead of carrying rows inline.
// Thread-safety: all methods are safe to call concurrently.
#ifndef MOE_SERVER_SHARED_REGIONS_H_
#define MOE_SERVER_SHARED_REGIONS_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace moe {

class SharedRegions {
 public:
  ~SharedRegions();
  // Maps an existing POSIX shared-memory object of at least `bytes` bytes.
  absl::Status Register(const std::string& name, uint64_t bytes);
  absl::Status Unregister(const std::string& name);
  // A pointer to [offset, offset + bytes) of a registered region. `field` names the request
  // field in errors: FAILED_PRECONDITION for an unknown region, INVALID_ARGUMENT out of bounds.
  absl::StatusOr<char*> Resolve(const std::string& name, uint64_t offset, uint64_t bytes, const char* field);

 private:
  struct Mapping {
    void* base = nullptr;
    uint64_t bytes = 0;
  };
  absl::Mutex mu_;
  std::map<std::string, Mapping> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_SHARED_REGIONS_H_
