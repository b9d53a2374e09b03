// Process plumbing shared by moe-rankd and moe-controller: the flags both declare (where they
// listen, where they write their ports, the log level), port files, the gRPC server with health
// checking, the Prometheus exposer on a (possibly zero) port, and blocking
// termination signals for a sigwait() in main.
#ifndef MOE_RPC_DAEMON_UTIL_H_
#define MOE_RPC_DAEMON_UTIL_H_

#include <signal.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

#include "rpc/tls.h"

ABSL_DECLARE_FLAG(std::string, listen);
ABSL_DECLARE_FLAG(std::string, port_file);
ABSL_DECLARE_FLAG(std::string, metrics_listen);
ABSL_DECLARE_FLAG(std::string, metrics_port_file);
ABSL_DECLARE_FLAG(std::string, log_level);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, health_listen);

namespace moe {

// The project's release number (moectl --version, every daemon's moe_build_info).
inline constexpr char kRuntimeVersion[] = "0.1.0";

// Registers the gauge `name` with value 1 and the build's labels (Prometheus' *_build_info
// idiom: one series a process, joined onto others with `* on(instance) group_left(...)`).
// `labels` gets version = kRuntimeVersion added.
std::shared_ptr<prometheus::Registry> BuildInfoRegistry(const std::string& name,
                                                        std::map<std::string, std::string> labels);

// Sets gRPC's health status of `service` on each server that serves health (null servers are
// skipped); "" sets every service's, the whole server's ("") included. Readiness of a daemon's
// API is its service name, liveness "".
void SetHealth(const std::vector<grpc::Server*>& servers, const std::string& service, bool serving);

// systemd's notification protocol (sd_notify(3)) without libsystemd: sends `state` ("READY=1",
// "STOPPING=1", "WATCHDOG=1", "STATUS=...") as one datagram to `socket` (the NOTIFY_SOCKET the
// service manager set; "@name" is an abstract socket). No-op for "". Best effort: a failure is
// logged once, never returned.
void SdNotify(const std::string& socket, const std::string& state);

// While the returned object lives, sends WATCHDOG=1 to `socket` every `interval` (half the
// WatchdogSec the manager set through WATCHDOG_USEC). Null for "" or a zero interval.
class SdWatchdog;
std::unique_ptr<SdWatchdog> StartSdWatchdog(const std::string& socket, absl::Duration interval);
// Half the period in `watchdog_usec` (the WATCHDOG_USEC value; null or invalid: zero).
absl::Duration SdWatchdogInterval(const char* watchdog_usec);
class SdWatchdog {
 public:
  SdWatchdog(std::string socket, absl::Duration interval);
  ~SdWatchdog();
  SdWatchdog(const SdWatchdog&) = delete;
  SdWatchdog& operator=(const SdWatchdog&) = delete;

 private:
  std::string socket_;
  absl::Duration interval_;
  absl::Notification stop_;
  std::thread thread_;
};

// Writes `text` to `path` through a rename (runtime/transport's PublishFile), so a reader never
// sees a partial file. No-op for ""; a failure is logged, not returned (best effort).
void WriteFileAtomically(const std::string& path, const std::string& text);

// Starts prometheus-cpp's exposer on `address` ("host:0" picks a free port: civetweb cannot bind
// port 0 itself) and writes the bound port to `port_file`. UNAVAILABLE naming the flag on failure.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartExposer(const std::string& address,
                                                                  const std::string& port_file);

// The bearer token in the first line of `path` (whitespace stripped). INVALID_ARGUMENT naming
// `flag` when the file is unreadable or the token shorter than 16 characters.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& flag);

struct GrpcServeOptions {
  std::string listen;             // "host:port" (port 0: the kernel picks); empty: no TCP port
  std::string flag = "--listen";  // names `listen` in errors
  int max_message_bytes = 0;      // > 0: gRPC's send and receive limits
  bool health = true;             // grpc.health.v1.Health on this server
  TlsFiles tls;                   // mutual TLS on `listen` (rpc/tls.h); none: plaintext
  bool keepalive = false;         // HTTP/2 keepalive both ways (servers of long-lived streams)
  // Answers the methods no service has (not owned; must outlive the server). One server each.
  grpc::CallbackGenericService* generic = nullptr;
};

// Serves `services` (and health as asked) and sets *port to the bound TCP port (0 without one).
// No daemon serves gRPC reflection: linking gRPC's reflection library turns it on for every
// server of the process, the TCP ones included. Connections can also be added from descriptors
// (rpc/unix_socket.h). Exactly one listening socket per address (gRPC's SO_REUSEPORT clones of a port-0 listener are
// off). UNAVAILABLE naming the flag when the address cannot be bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> ServeGrpc(const std::vector<grpc::Service*>& services,
                                                        const GrpcServeOptions& options, int* port);

// A plaintext server with only grpc.health.v1 on `listen` (--health_listen), for probes that
// cannot present a client certificate; no server when `listen` is empty. The caller sets its
// statuses with the other servers' (SetHealth). It serves no other service and reads nothing but
// the service name, so it stays plaintext under mutual TLS. gRPC starts no server without a
// method of its own: a generic service, owned here and outliving the server, answers every
// method but health's UNIMPLEMENTED. UNAVAILABLE naming the flag when the address cannot be
// bound.
struct HealthOnlyServer {
  std::unique_ptr<grpc::CallbackGenericService> unimplemented;
  std::unique_ptr<grpc::Server> server;  // declared last: destroyed first
  grpc::Server* get() const { return server.get(); }
};
absl::StatusOr<HealthOnlyServer> ServeHealthOnly(const std::string& listen);

// Blocks SIGTERM and SIGINT in the calling thread (and every thread it starts later).
sigset_t BlockTerminationSignals();

// Turns off absl::Mutex's deadlock detection for the process. Debian's Abseil is built without
// NDEBUG, which leaves it on: every lock and unlock then updates a global lock graph (about 70
// acquisitions per engine step between gRPC and the executor; 14-22 us a decode step on the
// build machine). Serving processes call it first thing in main.
void DisableMutexDeadlockDetection();

}  // namespace moe

#endif  // MOE_RPC_DAEMON_UTIL_H_
