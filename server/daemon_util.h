// Process plumbing shared by moe-rankd and moe-controller: port files, the Prometheus exposer on
// a (possibly zero) port, and blocking termination signals for a sigwait() in main.
#ifndef MOE_SERVER_DAEMON_UTIL_H_
#define MOE_SERVER_DAEMON_UTIL_H_

#include <signal.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/exposer.h"

namespace moe {

// Writes `text` to `path` through a rename, so a reader never sees a partial file. No-op for "".
void WriteFileAtomically(const std::string& path, const std::string& text);

// Starts prometheus-cpp's exposer on `address` ("host:0" picks a free port: civetweb cannot bind
// port 0 itself) and writes the bound port to `port_file`. UNAVAILABLE naming the flag on failure.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartExposer(const std::string& address,
                                                                  const std::string& port_file);

// The bearer token in the first line of `path` (whitespace stripped). INVALID_ARGUMENT naming
// `flag` when the file is unreadable or the token shorter than 16 characters.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& flag);

// Blocks SIGTERM and SIGINT in the calling thread (and every thread it starts later).
sigset_t BlockTerminationSignals();

}  // namespace moe

#endif  // MOE_SERVER_DAEMON_UTIL_H_
