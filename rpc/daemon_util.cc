#include "rpc/daemon_util.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <fstream>

#include <arpa/inet.h>
#include <grpcpp/health_check_service_interface.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "CivetServer.h"
#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "spdlog/spdlog.h"

#include "runtime/transport/file_rendezvous.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC address (loopback by default; port 0 = pick one)");
ABSL_FLAG(std::string, port_file, "", "write the chosen gRPC port here");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0", "Prometheus exposer address");
ABSL_FLAG(std::string, metrics_port_file, "", "write the chosen metrics port here");
ABSL_FLAG(std::string, log_level, "info", "spdlog level");
ABSL_FLAG(std::string, tls_cert, "",
          "mutual TLS on the TCP port and the daemon's own TCP clients: this process's certificate chain (PEM); "
          "with --tls_key and --tls_ca, re-read every 10 s");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: the private key of --tls_cert (PEM)");
ABSL_FLAG(std::string, tls_ca, "", "mutual TLS: the CA bundle peers' certificates must chain to (PEM)");
ABSL_FLAG(std::string, health_listen, "",
          "host:port of a plaintext gRPC server with only grpc.health.v1 (the same statuses as the daemon's "
          "other servers), for probes that present no client certificate (Kubernetes' gRPC probes); empty: none");

namespace moe {

namespace {

std::string ResolvePortZero(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || address.substr(colon + 1) != "0") return address;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = 0;
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return absl::StrCat(address.substr(0, colon), ":", port);
}

}  // namespace

void WriteFileAtomically(const std::string& path, const std::string& text) {
  if (path.empty()) return;
  // PublishFile writes <dir>/<name> through <dir>/<name>.tmp: the same path and temporary as
  // `path` and `path`.tmp ("/x" splits into "" and "x", "x" into "." and "x").
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  // Best effort, as before (a reader of a missing port file times out and says so); now logged.
  if (absl::Status s = PublishFile(dir, name, text); !s.ok()) spdlog::warn("{}: {}", path, std::string(s.message()));
}

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartExposer(const std::string& address,
                                                                  const std::string& port_file) {
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    static CivetCallbacks callbacks;
    callbacks.log_message = [](const struct mg_connection*, const char* message) {
      spdlog::warn("metrics exposer: {}", message);
      return 1;
    };
    exposer = std::make_unique<prometheus::Exposer>(ResolvePortZero(address), 2, &callbacks);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("--metrics_listen ", address, ": ", e.what()));
  }
  WriteFileAtomically(port_file, absl::StrCat(exposer->GetListeningPorts().at(0)));
  return exposer;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& flag) {
  if (path.empty())
    return absl::InvalidArgumentError(absl::StrCat(flag, ": required (control RPCs are authenticated)"));
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read"));
  std::string token(absl::StripAsciiWhitespace(line));
  if (token.size() < 16) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": token shorter than 16"));
  return token;
}

void SdNotify(const std::string& socket_path, const std::string& state) {
  if (socket_path.empty()) return;
  static std::atomic<bool> warned{false};
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    if (!warned.exchange(true)) spdlog::warn("NOTIFY_SOCKET {}: path too long", socket_path);
    return;
  }
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  if (addr.sun_path[0] == '@') addr.sun_path[0] = '\0';  // an abstract socket
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + socket_path.size());
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  const ssize_t n = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr), len);
  if (n < 0 && !warned.exchange(true)) spdlog::warn("NOTIFY_SOCKET {}: {}", socket_path, std::strerror(errno));
  ::close(fd);
}

SdWatchdog::SdWatchdog(std::string socket, absl::Duration interval)
    : socket_(std::move(socket)), interval_(interval), thread_([this] {
        do {
          SdNotify(socket_, "WATCHDOG=1");
        } while (!stop_.WaitForNotificationWithTimeout(interval_));
      }) {}

SdWatchdog::~SdWatchdog() {
  stop_.Notify();
  thread_.join();
}

absl::Duration SdWatchdogInterval(const char* watchdog_usec) {
  int64_t us = 0;
  if (watchdog_usec == nullptr || !absl::SimpleAtoi(watchdog_usec, &us) || us <= 0) return absl::ZeroDuration();
  return absl::Microseconds(us) / 2;
}

std::unique_ptr<SdWatchdog> StartSdWatchdog(const std::string& socket, absl::Duration interval) {
  if (socket.empty() || interval <= absl::ZeroDuration()) return nullptr;
  return std::make_unique<SdWatchdog>(socket, interval);
}

std::shared_ptr<prometheus::Registry> BuildInfoRegistry(const std::string& name,
                                                        std::map<std::string, std::string> labels) {
  auto registry = std::make_shared<prometheus::Registry>();
  labels["version"] = kRuntimeVersion;
  prometheus::BuildGauge()
      .Name(name)
      .Help("Build of this process (value 1): release, and what it runs")
      .Register(*registry)
      .Add(labels)
      .Set(1);
  return registry;
}

void SetHealth(const std::vector<grpc::Server*>& servers, const std::string& service, bool serving) {
  for (grpc::Server* s : servers) {
    if (s == nullptr || s->GetHealthCheckService() == nullptr) continue;
    if (service.empty()) {
      s->GetHealthCheckService()->SetServingStatus(serving);
    } else {
      s->GetHealthCheckService()->SetServingStatus(service, serving);
    }
  }
}

absl::StatusOr<std::unique_ptr<grpc::Server>> ServeGrpc(const std::vector<grpc::Service*>& services,
                                                        const GrpcServeOptions& o, int* port) {
  grpc::EnableDefaultHealthCheckService(o.health);
  grpc::ServerBuilder builder;
  *port = 0;
  if (!o.listen.empty()) builder.AddListeningPort(o.listen, ServerCredentials(o.tls), port);
  // NOTE: with SO_REUSEPORT gRPC clones a port-0 listener once per poller, each clone on a port
  // of its own that nobody publishes: one socket per address only.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (o.keepalive) {
    // Long-lived streams (the process group's Join): ping idle connections every 2 s, drop one
    // that does not answer within 2 s (a host that went away), and accept the clients' pings.
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  }
  for (grpc::Service* s : services) builder.RegisterService(s);
  if (o.generic != nullptr) builder.RegisterCallbackGenericService(o.generic);
  if (o.max_message_bytes > 0) {
    builder.SetMaxReceiveMessageSize(o.max_message_bytes);
    builder.SetMaxSendMessageSize(o.max_message_bytes);
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  grpc::EnableDefaultHealthCheckService(false);
  if (server == nullptr || (!o.listen.empty() && *port == 0)) {
    return absl::UnavailableError(absl::StrCat(o.flag, " ", o.listen, ": cannot bind"));
  }
  return server;
}

absl::StatusOr<HealthOnlyServer> ServeHealthOnly(const std::string& listen) {
  HealthOnlyServer h;
  if (listen.empty()) return h;
  h.unimplemented = std::make_unique<grpc::CallbackGenericService>();
  GrpcServeOptions o;
  o.listen = listen;
  o.flag = "--health_listen";
  o.generic = h.unimplemented.get();
  int port = 0;
  auto server = ServeGrpc({}, o, &port);
  if (!server.ok()) return server.status();
  h.server = *std::move(server);
  return h;
}

sigset_t BlockTerminationSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

void DisableMutexDeadlockDetection() { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); }

}  // namespace moe
