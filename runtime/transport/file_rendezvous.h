// Rendezvous through a directory every member can read (a local or shared file system): each
// member publishes a small file (an address, an NCCL unique id) and waits for its peers' files.
// A file is written beside its final name and renamed into place, so a reader sees all of it or
// nothing. Blocking, thread-compatible; nothing is cleaned up (the directory belongs to the caller).
#ifndef MOE_RUNTIME_TRANSPORT_FILE_RENDEZVOUS_H_
#define MOE_RUNTIME_TRANSPORT_FILE_RENDEZVOUS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace moe {

// Writes `contents` to <dir>/<name> atomically (through <dir>/<name>.tmp). UNAVAILABLE when the
// file cannot be written.
absl::Status PublishFile(const std::string& dir, const std::string& name, absl::string_view contents);

// Waits until each of <dir>/<names[i]> has been published (exists and is not empty) and returns
// their contents in the order of `names`. DEADLINE_EXCEEDED after `timeout`, naming every file
// still missing.
absl::StatusOr<std::vector<std::string>> AwaitFiles(const std::string& dir, const std::vector<std::string>& names,
                                                    absl::Duration timeout);

}  // namespace moe

#endif  // MOE_RUNTIME_TRANSPORT_FILE_RENDEZVOUS_H_
