#include "server/shared_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace moe {

SharedRegions::~SharedRegions() {
  absl::MutexLock lock(&mu_);
  for (auto& [name, m] : regions_) munmap(m.base, m.bytes);
}

absl::Status SharedRegions::Register(const std::string& name, uint64_t bytes) {
  if (name.empty() || name[0] != '/' || name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("name: '", name, "' is not a POSIX shared-memory name (\"/name\")"));
  }
  if (bytes == 0) return absl::InvalidArgumentError("bytes: must be positive");
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("name: shm_open('", name, "') failed: ", std::strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("bytes: region '", name, "' is smaller than ", bytes, " bytes"));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return absl::ResourceExhaustedError(absl::StrCat("mmap of '", name, "': ", std::strerror(errno)));
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it != regions_.end()) munmap(it->second.base, it->second.bytes);
  regions_[name] = Mapping{base, bytes};
  return absl::OkStatus();
}

absl::Status SharedRegions::Unregister(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("name: region '", name, "' is not registered"));
  munmap(it->second.base, it->second.bytes);
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<char*> SharedRegions::Resolve(const std::string& name, uint64_t offset, uint64_t bytes,
                                             const char* field) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(field, ".region: '", name, "' is not registered"));
  }
  if (offset > it->second.bytes || bytes > it->second.bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": [", offset, ", ", offset + bytes, ") is outside region '",
                                                   name, "' of ", it->second.bytes, " bytes"));
  }
  return static_cast<char*>(it->second.base) + offset;
}

}  // namespace moe
