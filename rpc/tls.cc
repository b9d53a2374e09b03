#include "rpc/tls.h"

#include <fstream>
#include <sstream>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace moe {

namespace {

absl::Status CheckPem(const std::string& path, const std::string& flag, const char* what) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": required with the other TLS files"));
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read"));
  std::stringstream buf;
  buf << in.rdbuf();
  if (!absl::StrContains(buf.str(), "-----BEGIN ") || !absl::StrContains(buf.str(), what)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": not a PEM ", what));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& f, const std::string& prefix) {
  if (!f.enabled()) return absl::OkStatus();
  if (absl::Status s = CheckPem(f.cert, prefix + "cert", "CERTIFICATE"); !s.ok()) return s;
  if (absl::Status s = CheckPem(f.key, prefix + "key", "PRIVATE KEY"); !s.ok()) return s;
  return CheckPem(f.ca, prefix + "ca", "CERTIFICATE");
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsFiles& f) {
  if (!f.enabled()) return grpc::InsecureServerCredentials();
  auto provider =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(f.key, f.cert, f.ca, kTlsRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions o(provider);
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(o);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsFiles& f) {
  if (!f.enabled()) return grpc::InsecureChannelCredentials();
  auto provider =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(f.key, f.cert, f.ca, kTlsRefreshSeconds);
  grpc::experimental::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(provider);
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(o);
}

}  // namespace moe
