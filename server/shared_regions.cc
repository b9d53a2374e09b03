#include "server/shared_regions.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <sys/mman.h>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"

namespace moe {
namespace {

bool NameCharOk(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
}

// The region's current size, FAILED_PRECONDITION when the object no longer covers `end`.
absl::Status CheckCovers(int fd, uint64_t end, const std::string& name, const char* field) {
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(field, ".region: fstat('", name, "'): ", std::strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) < end) {
    return absl::FailedPreconditionError(absl::StrCat(field, ".region: '", name, "' shrank to ", st.st_size,
                                                      " bytes, the step needs ", end,
                                                      " (register it again after resizing it)"));
  }
  return absl::OkStatus();
}

}  // namespace

SharedRegions::Region::~Region() {
  if (fd >= 0) close(fd);
}

SharedRegions::~SharedRegions() = default;

int SharedRegions::size() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(regions_.size());
}

absl::Status SharedRegions::Register(const std::string& name, uint64_t bytes, std::optional<uid_t> caller_uid) {
  if (!caller_uid.has_value()) {
    return absl::FailedPreconditionError(
        "shared regions are for engines on the rank's host: call RegisterRegion on its --engine_socket");
  }
  const std::string& prefix = options_.name_prefix;
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0 || name.size() > 255) {
    return absl::InvalidArgumentError(absl::StrCat("name: '", name, "' must start with '", prefix,
                                                   "' (the daemon's --shm_prefix) and be at most 255 characters"));
  }
  for (size_t i = 1; i < name.size(); ++i) {
    if (!NameCharOk(name[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("name: '", name, "': only letters, digits, '-', '_' and '.' may follow the leading '/'"));
    }
  }
  if (bytes == 0) return absl::InvalidArgumentError("bytes: must be positive");
  if (bytes > static_cast<uint64_t>(INT64_MAX)) return absl::InvalidArgumentError("bytes: too large");
  const int fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    const int e = errno;
    const std::string why = absl::StrCat("name: shm_open('", name, "') failed: ", std::strerror(e));
    switch (e) {
      case ENOENT:
        return absl::NotFoundError(why);
      case EACCES:
      case EPERM:
        return absl::PermissionDeniedError(why);
      case ELOOP:
        return absl::InvalidArgumentError(absl::StrCat(why, " (a symbolic link is not a region)"));
      case EMFILE:
      case ENFILE:
        return absl::ResourceExhaustedError(why);
      default:
        return absl::UnavailableError(why);
    }
  }
  auto region = std::make_shared<Region>();
  region->fd = fd;
  region->bytes = bytes;
  region->owner = *caller_uid;
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("name: '", name, "' is not a regular shared-memory object"));
  }
  // The caller's own object only: one of the daemon's (a daemon-owned segment under the prefix)
  // or of another engine is not this caller's to hand to a step.
  if (st.st_uid != *caller_uid) {
    return absl::PermissionDeniedError(
        absl::StrCat("name: '", name, "' is owned by uid ", st.st_uid, ", not by the caller (uid ", *caller_uid, ")"));
  }
  if ((st.st_mode & S_IWOTH) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("name: '", name, "' is writable by every user (mode ", st.st_mode & 0777, "); create it 0600"));
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    return absl::InvalidArgumentError(absl::StrCat("bytes: region '", name, "' is smaller than ", bytes, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it != regions_.end() && it->second->owner != *caller_uid) {
    // The object changed owner since another engine registered it (unlinked and made again).
    return absl::PermissionDeniedError(
        absl::StrCat("name: '", name, "' is registered by another engine; it must unregister it first"));
  }
  if (it == regions_.end() && static_cast<int>(regions_.size()) >= options_.max_regions) {
    // At the cap, regions whose object was unlinked are dropped first: no engine can name them
    // again, and an engine that died without unregistering (its objects unlinked after it, e.g.
    // by Python's resource tracker) would otherwise hold its slots for good. Below the cap an
    // unlinked region stays (an engine may unlink its object early and keep stepping on it).
    for (auto r = regions_.begin(); r != regions_.end();) {
      struct stat held {};
      if (fstat(r->second->fd, &held) == 0 && held.st_nlink == 0) {
        r = regions_.erase(r);  // a step still reading it keeps it open
      } else {
        ++r;
      }
    }
  }
  if (it == regions_.end() && static_cast<int>(regions_.size()) >= options_.max_regions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("name: ", options_.max_regions, " regions are registered already; unregister one first"));
  }
  regions_[name] = std::move(region);  // a step still reading the old one keeps it open
  return absl::OkStatus();
}

absl::Status SharedRegions::Unregister(const std::string& name, std::optional<uid_t> caller_uid) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it == regions_.end() || !caller_uid.has_value() || it->second->owner != *caller_uid) {
    return absl::NotFoundError(absl::StrCat("name: region '", name, "' is not registered by this caller"));
  }
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SharedRegions::Region>> SharedRegions::Find(const std::string& name,
                                                                           std::optional<uid_t> caller_uid,
                                                                           uint64_t offset, uint64_t bytes,
                                                                           const char* field) {
  if (!caller_uid.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        field,
        ".region: shared regions are for engines on the rank's host (its --engine_socket); send the rows inline"));
  }
  std::shared_ptr<Region> r;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    // Another engine's region is answered as unknown: its name tells this caller nothing.
    if (it == regions_.end() || it->second->owner != *caller_uid) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ".region: '", name, "' is not registered by this caller"));
    }
    r = it->second;
  }
  if (offset > r->bytes || bytes > r->bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": offset ", offset, " + bytes ", bytes,
                                                   " is outside region '", name, "' of ", r->bytes, " bytes"));
  }
  return r;
}

absl::Status SharedRegions::CheckRange(const std::string& name, std::optional<uid_t> caller_uid, uint64_t offset,
                                       uint64_t bytes, const char* field) {
  auto r = Find(name, caller_uid, offset, bytes, field);
  if (!r.ok()) return r.status();
  return CheckCovers((*r)->fd, offset + bytes, name, field);
}

absl::Status SharedRegions::Read(const std::string& name, std::optional<uid_t> caller_uid, uint64_t offset,
                                 uint64_t bytes, void* out, const char* field) {
  auto r = Find(name, caller_uid, offset, bytes, field);
  if (!r.ok()) return r.status();
  const int fd = (*r)->fd;
  if (absl::Status s = CheckCovers(fd, offset + bytes, name, field); !s.ok()) return s;
  char* to = static_cast<char*>(out);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = pread(fd, to + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // Shrunk between the fstat and the read: the same answer as a shrink seen before it.
      return absl::FailedPreconditionError(absl::StrCat(field, ".region: '", name, "' ended at byte ", offset + done,
                                                        " while reading ", bytes, " bytes from offset ", offset,
                                                        n < 0 ? absl::StrCat(": ", std::strerror(errno)) : ""));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SharedRegions::Write(const std::string& name, std::optional<uid_t> caller_uid, uint64_t offset,
                                  uint64_t bytes, const void* in, const char* field) {
  auto r = Find(name, caller_uid, offset, bytes, field);
  if (!r.ok()) return r.status();
  const int fd = (*r)->fd;
  if (absl::Status s = CheckCovers(fd, offset + bytes, name, field); !s.ok()) return s;
  const char* from = static_cast<const char*>(in);
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = pwrite(fd, from + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(field, ".region: writing '", name, "' at byte ", offset + done,
                                                        " failed",
                                                        n < 0 ? absl::StrCat(": ", std::strerror(errno)) : ""));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace moe
