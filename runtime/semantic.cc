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

#include "runtime/status.h"

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

namespace {

// Four lanes so that the multiplies of consecutive words overlap.
class Fingerprinter {
 public:
  void Word(uint64_t w) {
    uint64_t& l = lane_[n_++ & 3];
    l = (l ^ w) * 0x9e3779b97f4a7c15ull;
    l ^= l >> 29;
  }
  void Bytes(const void* p, size_t bytes) {
    Word(bytes);
    const auto* b = static_cast<const uint8_t*>(p);
    size_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
      uint64_t w[4];
      std::memcpy(w, b + i, 32);
      for (int j = 0; j < 4; ++j) {
        lane_[j] = (lane_[j] ^ w[j]) * 0x9e3779b97f4a7c15ull;
        lane_[j] ^= lane_[j] >> 29;
      }
    }
    for (; i + 8 <= bytes; i += 8) {
      uint64_t w;
      std::memcpy(&w, b + i, 8);
      Word(w);
    }
    if (i < bytes) {
      uint64_t w = 0;
      std::memcpy(&w, b + i, bytes - i);
      Word(w);
    }
  }
  template <typename T>
  void Column(const std::vector<T>& col) {
    static_assert(std::is_trivially_copyable_v<T>);
    Bytes(col.data(), col.size() * sizeof(T));
  }
  uint64_t Finish() const {
    uint64_t h = 0;
    for (int j = 0; j < 4; ++j) {
      uint64_t l = lane_[j] ^ (static_cast<uint64_t>(j) << 56);
      l *= 0xff51afd7ed558ccdull;
      l ^= l >> 33;
      h = (h ^ l) * 0xc4ceb9fe1a85ec53ull;
      h ^= h >> 29;
    }
    return h;
  }

 private:
  uint64_t lane_[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull};
  uint64_t n_ = 0;
};

}  // namespace

uint64_t SemanticFingerprint(const SemanticHandoff& h) {
  Fingerprinter f;
  f.Bytes(h.contract_version.data(), h.contract_version.size());
  f.Word(static_cast<uint64_t>(h.scope.value()));
  f.Word(static_cast<uint64_t>(static_cast<uint32_t>(h.num_experts)) << 32 | static_cast<uint32_t>(h.top_k));
  f.Word(static_cast<uint32_t>(h.num_partitions));
  f.Column(h.origin);
  f.Column(h.token);
  f.Column(h.route_slot);
  f.Column(h.expert);
  f.Column(h.gate);
  f.Column(h.admitted);
  return f.Finish();
}

absl::StatusOr<FrozenHandoff> Freeze(SemanticHandoff handoff) {
  absl::Status valid = handoff.Validate();
  if (!valid.ok()) return valid;
  FrozenHandoff f;
  f.fingerprint = SemanticFingerprint(handoff);
  f.routes = std::move(handoff);
  return f;
}

absl::Status VerifyFrozen(const FrozenHandoff& frozen) {
  const uint64_t now = SemanticFingerprint(frozen.routes);
  if (now != frozen.fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        "semantic handoff mutated after freeze: fingerprint ", absl::Hex(now, absl::kZeroPad16), " != sealed ",
        absl::Hex(frozen.fingerprint, absl::kZeroPad16), " (scope ", frozen.routes.scope.value(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Sha256> FrozenHandoff::Digest() const {
  if (!has_digest_) {
    RETURN_IF_ERROR(VerifyFrozen(*this));
    digest_ = SemanticDigest(routes);
    has_digest_ = true;
  }
  return digest_;
}

}  // namespace moe
