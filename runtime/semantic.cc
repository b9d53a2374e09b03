#include "runtime/semantic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <openssl/evp.h>

#include "absl/strings/str_cat.h"

namespace moe {

void SemanticHandoff::Reserve(size_t n) {
  origin.reserve(n);
  token.reserve(n);
  route_slot.reserve(n);
  expert.reserve(n);
  gate.reserve(n);
  admitted.reserve(n);
}

void SemanticHandoff::Add(Rank p, int32_t t, int32_t j, LogicalExpertId e, float g, bool admitted_route) {
  origin.push_back(p);
  token.push_back(t);
  route_slot.push_back(j);
  expert.push_back(e);
  gate.push_back(g);
  admitted.push_back(admitted_route ? 1 : 0);
}

absl::Status SemanticHandoff::Validate() const {
  const size_t n = origin.size();
  if (token.size() != n || route_slot.size() != n || expert.size() != n || gate.size() != n || admitted.size() != n) {
    return absl::InvalidArgumentError("routes: column lengths disagree");
  }
  if (num_experts <= 0) return absl::InvalidArgumentError("num_experts: must be positive");
  if (top_k <= 0) return absl::InvalidArgumentError("top_k: must be positive");
  if (num_partitions <= 0) return absl::InvalidArgumentError("num_partitions: must be positive");
  // (p, t, j) unique: strictly increasing keys (how a rank seals its own routes) prove it in the
  // scan; any other order is checked by sorting the keys.
  using Key = std::tuple<int64_t, int32_t, int32_t>;
  const auto key_of = [this](size_t r) { return Key(origin[r].value(), token[r], route_slot[r]); };
  bool increasing = true;
  Key previous;
  for (size_t r = 0; r < n; ++r) {
    if (origin[r].value() < 0 || origin[r].value() >= num_partitions) {
      return absl::InvalidArgumentError(
          absl::StrCat("routes[", r, "].source_rank: ", origin[r].value(), " outside [0, ", num_partitions, ")"));
    }
    if (token[r] < 0) return absl::InvalidArgumentError(absl::StrCat("routes[", r, "].token: negative"));
    if (route_slot[r] < 0 || route_slot[r] >= top_k) {
      return absl::InvalidArgumentError(
          absl::StrCat("routes[", r, "].route_slot: ", route_slot[r], " outside [0, ", top_k, ")"));
    }
    if (expert[r].value() < 0 || expert[r].value() >= num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("routes[", r, "].logical_expert: ", expert[r].value(), " outside [0, ", num_experts, ")"));
    }
    if (!std::isfinite(gate[r]) || gate[r] < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("routes[", r, "].gate: ", gate[r], " is NaN, infinite or negative"));
    }
    const Key key = key_of(r);
    if (r > 0 && key <= previous) increasing = false;
    previous = key;
  }
  if (!increasing) {
    std::vector<std::pair<Key, size_t>> keys(n);
    for (size_t r = 0; r < n; ++r) keys[r] = {key_of(r), r};
    std::sort(keys.begin(), keys.end());
    for (size_t i = 1; i < n; ++i) {
      if (keys[i].first != keys[i - 1].first) continue;
      const size_t r = std::max(keys[i].second, keys[i - 1].second);  // the later of the two
      return absl::InvalidArgumentError(absl::StrCat("routes[", r, "]: duplicate (source_rank, token, route_slot) = (",
                                                     origin[r].value(), ", ", token[r], ", ", route_slot[r], ")"));
    }
  }
  return absl::OkStatus();
}

std::string HexDigest(const Sha256& digest) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(64);
  for (uint8_t b : digest) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

namespace {

class Hasher {
 public:
  Hasher() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Hasher() { EVP_MD_CTX_free(ctx_); }
  void U64(uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
    EVP_DigestUpdate(ctx_, b, 8);
  }
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Str(const std::string& s) {
    U64(s.size());
    EVP_DigestUpdate(ctx_, s.data(), s.size());
  }
  // A column of 1- or 4-byte values (int32, a 32-bit id, FP32 bits, flags): its name, its
  // length, then every value little-endian at its own width. On a little-endian host that is
  // how the vector stores them, so the column is hashed in place in one call.
  template <typename T>
  void Column(const char* name, const std::vector<T>& col) {
    static_assert((sizeof(T) == 4 || sizeof(T) == 1) && std::is_trivially_copyable_v<T>, "1- or 4-byte values");
    Str(name);
    U64(col.size());
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    EVP_DigestUpdate(ctx_, col.data(), col.size() * sizeof(T));
#else
    for (const T& v : col) {
      uint8_t b[sizeof(T)];
      std::memcpy(b, &v, sizeof(T));
      std::reverse(b, b + sizeof(T));
      EVP_DigestUpdate(ctx_, b, sizeof(T));
    }
#endif
  }
  Sha256 Finish() {
    Sha256 out{};
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, out.data(), &len);
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

}  // namespace

Sha256 SemanticDigest(const SemanticHandoff& h) {
  Hasher s;
  s.Str(h.contract_version);
  s.I64(h.scope.value());
  s.I64(h.num_experts);
  s.I64(h.top_k);
  s.I64(h.num_partitions);
  s.Column("origin", h.origin);
  s.Column("token", h.token);
  s.Column("route_slot", h.route_slot);
  s.Column("logical_expert", h.expert);
  s.Column("gate", h.gate);  // IEEE-754 bits
  s.Column("admitted", h.admitted);
  return s.Finish();
}

absl::StatusOr<FrozenHandoff> Freeze(SemanticHandoff handoff) {
  absl::Status valid = handoff.Validate();
  if (!valid.ok()) return valid;
  FrozenHandoff f;
  f.digest = SemanticDigest(handoff);
  f.routes = std::move(handoff);
  return f;
}

absl::Status VerifyFrozen(const FrozenHandoff& frozen) {
  const Sha256 now = SemanticDigest(frozen.routes);
  if (now != frozen.digest) {
    return absl::FailedPreconditionError(absl::StrCat("semantic handoff mutated after freeze: digest ", HexDigest(now),
                                                      " != sealed ", HexDigest(frozen.digest)));
  }
  return absl::OkStatus();
}

}  // namespace moe
