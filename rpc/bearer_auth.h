// Bearer-token check for control-plane services (moe-controller, rank agents): the token is
// compared in constant time; a missing or wrong token is UNAUTHENTICATED. A service with a
// read-only role (moe-controller's --read_token_file) checks the presented token against each
// role's with BearerIs.
#ifndef MOE_RPC_BEARER_AUTH_H_
#define MOE_RPC_BEARER_AUTH_H_

#include <string>

#include <grpcpp/grpcpp.h>
#include <openssl/crypto.h>

namespace moe {

inline grpc::Status CheckBearer(const grpc::ServerContext* ctx, const std::string& token) {
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "authorization: bearer token required");
  const std::string presented(it->second.data(), it->second.size());
  const std::string expected = "Bearer " + token;
  if (token.empty() || presented.size() != expected.size() ||
      CRYPTO_memcmp(presented.data(), expected.data(), expected.size()) != 0) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "authorization: token rejected");
  }
  return grpc::Status::OK;
}

// Whether the call carries exactly `token` (an empty token never matches).
inline bool BearerIs(const grpc::ServerContext* ctx, const std::string& token) { return CheckBearer(ctx, token).ok(); }

}  // namespace moe

#endif  // MOE_RPC_BEARER_AUTH_H_
