// TLS for the project's gRPC connections over TCP (moe-controller, the rank agents, the engine API
// on a rank's TCP port, moectl): mutual TLS from PEM files named by flags, with gRPC's file
// watcher re-reading them every kTlsRefreshSeconds, so a rotated certificate (new files moved into
// place) is used without a restart. Unix-socket connections stay as they are (admitted by uid).
//
// A server with TLS requires every client to present a certificate chained to `ca` and verifies
// it; a client verifies the server's chain against `ca` and its name against the address it
// dialed (the certificate's subjectAltName must hold that host or IP), and presents its own.
// Bearer tokens still apply on top.
#ifndef MOE_RPC_TLS_H_
#define MOE_RPC_TLS_H_

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"

namespace moe {

inline constexpr unsigned kTlsRefreshSeconds = 10;

struct TlsFiles {
  std::string cert;  // this process's certificate chain (PEM)
  std::string key;   // its private key (PEM)
  std::string ca;    // the CA bundle peers are verified against (PEM)
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// All three files or none, each readable and in PEM: INVALID_ARGUMENT naming the flag
// (`prefix` + "cert" / "key" / "ca", e.g. "--tls_") otherwise.
absl::Status CheckTlsFiles(const TlsFiles& files, const std::string& prefix = "--tls_");

// Insecure credentials when `files` is not enabled, else mutual TLS as above.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsFiles& files);
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsFiles& files);

}  // namespace moe

#endif  // MOE_RPC_TLS_H_
