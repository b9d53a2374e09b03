#include "runtime/checkpoint/synthetic.h"

#include <openssl/evp.h>

#include <cmath>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/numeric.h"
#include "runtime/hash.h"

namespace moe {
namespace {

void Fill(std::vector<uint16_t>* out, size_t n, uint64_t seed, float scale) {
  out->resize(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t x = SplitMix64(seed ^ SplitMix64(i));
    const float u = (static_cast<float>(x & 0xffffff) / 16777216.0f + static_cast<float>((x >> 24) & 0xffffff) / 16777216.0f) - 1.0f;
    (*out)[i] = kernels::FloatToBf16(u * scale);
  }
}

std::string AsBytes(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

}  // namespace

void SyntheticExpert(int expert, const ExpertShape& s, uint64_t seed, std::vector<uint16_t>* w_gate_up,
                     std::vector<uint16_t>* w_down) {
  Fill(w_gate_up, static_cast<size_t>(2) * s.d_ff * s.d, SplitMix64(seed * 1000003 + 2 * expert), 1.7f / std::sqrt(static_cast<float>(s.d)));
  Fill(w_down, static_cast<size_t>(s.d) * s.d_ff, SplitMix64(seed * 1000003 + 2 * expert + 1), 1.7f / std::sqrt(static_cast<float>(s.d_ff)));
}

std::string ExpertDigest(const std::vector<uint16_t>& w_gate_up, const std::vector<uint16_t>& w_down) {
  unsigned char md[32];
  unsigned int len = 0;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  EVP_DigestUpdate(ctx, w_gate_up.data(), w_gate_up.size() * 2);
  EVP_DigestUpdate(ctx, w_down.data(), w_down.size() * 2);
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : md) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

SafetensorsFile SyntheticCheckpoint(const ExpertShape& shape, uint64_t seed, const std::string& checkpoint_version) {
  SafetensorsFile f;
  f.metadata["checkpoint"] = checkpoint_version;
  f.metadata["num_experts"] = absl::StrCat(shape.num_experts);
  f.metadata["d"] = absl::StrCat(shape.d);
  f.metadata["d_ff"] = absl::StrCat(shape.d_ff);
  f.metadata["seed"] = absl::StrCat(seed);
  for (int e = 0; e < shape.num_experts; ++e) {
    std::vector<uint16_t> gu, dn;
    SyntheticExpert(e, shape, seed, &gu, &dn);
    f.metadata[absl::StrCat("digest.", e)] = ExpertDigest(gu, dn);
    f.tensors[absl::StrCat("experts.", e, ".w_gate_up")] = TensorBlob{"BF16", {2LL * shape.d_ff, shape.d}, AsBytes(gu)};
    f.tensors[absl::StrCat("experts.", e, ".w_down")] = TensorBlob{"BF16", {shape.d, shape.d_ff}, AsBytes(dn)};
  }
  return f;
}

absl::StatusOr<LocalExperts> LoadLocalExperts(const SafetensorsFile& ckpt, const PlacementManifest& m, Rank rank) {
  int d = 0, d_ff = 0;
  auto md = [&](const char* key, int* out) -> absl::Status {
    auto it = ckpt.metadata.find(key);
    if (it == ckpt.metadata.end() || !absl::SimpleAtoi(it->second, out) || *out <= 0) {
      return absl::DataLossError(absl::StrCat("checkpoint metadata '", key, "' missing or invalid"));
    }
    return absl::OkStatus();
  };
  absl::Status s = md("d", &d);
  if (!s.ok()) return s;
  s = md("d_ff", &d_ff);
  if (!s.ok()) return s;
  LocalExperts out;
  out.d = d;
  out.d_ff = d_ff;
  for (PhysicalSlotId q : m.LocalSlots(rank)) {
    const SlotRecord& slot = m.slot(q);
    const int e = slot.expert.value();
    auto gu = ckpt.tensors.find(absl::StrCat("experts.", e, ".w_gate_up"));
    auto dn = ckpt.tensors.find(absl::StrCat("experts.", e, ".w_down"));
    if (gu == ckpt.tensors.end() || dn == ckpt.tensors.end()) {
      return absl::FailedPreconditionError(absl::StrCat("slot ", slot.name, ": checkpoint has no tensors for expert ", e));
    }
    if (gu->second.data.size() != static_cast<size_t>(2) * d_ff * d * 2 || dn->second.data.size() != static_cast<size_t>(d) * d_ff * 2) {
      return absl::FailedPreconditionError(absl::StrCat("slot ", slot.name, ": expert ", e, " tensors have the wrong shape"));
    }
    std::vector<uint16_t> wgu(gu->second.data.size() / 2), wd(dn->second.data.size() / 2);
    std::memcpy(wgu.data(), gu->second.data.data(), gu->second.data.size());
    std::memcpy(wd.data(), dn->second.data.data(), dn->second.data.size());
    const std::string digest = ExpertDigest(wgu, wd);
    if (!slot.parameter_digest.empty() && slot.parameter_digest.value() != digest) {
      return absl::FailedPreconditionError(absl::StrCat("slot ", slot.name, ": parameter digest ", digest.substr(0, 12),
                                                        "... does not match the manifest's ",
                                                        slot.parameter_digest.value().substr(0, 12)));
    }
    out.w_gate_up.insert(out.w_gate_up.end(), wgu.begin(), wgu.end());
    out.w_down.insert(out.w_down.end(), wd.begin(), wd.end());
  }
  return out;
}

}  // namespace moe
