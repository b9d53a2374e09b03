#include "runtime/checkpoint/synthetic.h"

#include <cmath>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "kernels/numeric.h"
#include "runtime/checkpoint/hf_checkpoint.h"
#include "runtime/hash.h"
#include "runtime/status.h"

namespace moe {
namespace {

void Fill(std::vector<uint16_t>* out, size_t n, uint64_t seed, float scale) {
  out->resize(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t x = SplitMix64(seed ^ SplitMix64(i));
    const float u =
        (static_cast<float>(x & 0xffffff) / 16777216.0f + static_cast<float>((x >> 24) & 0xffffff) / 16777216.0f) -
        1.0f;
    (*out)[i] = kernels::FloatToBf16(u * scale);
  }
}

std::string AsBytes(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

}  // namespace

void SyntheticExpert(int expert, const ExpertShape& s, uint64_t seed, std::vector<uint16_t>* w_gate_up,
                     std::vector<uint16_t>* w_down) {
  Fill(w_gate_up, static_cast<size_t>(2) * s.d_ff * s.d, SplitMix64(seed * 1000003 + 2 * expert),
       1.7f / std::sqrt(static_cast<float>(s.d)));
  Fill(w_down, static_cast<size_t>(s.d) * s.d_ff, SplitMix64(seed * 1000003 + 2 * expert + 1),
       1.7f / std::sqrt(static_cast<float>(s.d_ff)));
}

std::string ExpertDigest(const std::vector<uint16_t>& w_gate_up, const std::vector<uint16_t>& w_down) {
  return ExpertDigest(w_gate_up.data(), w_gate_up.size(), w_down.data(), w_down.size());
}

SafetensorsFile SyntheticCheckpoint(const ExpertShape& shape, uint64_t seed, const std::string& checkpoint_version) {
  SafetensorsFile f;
  f.metadata[checkpoint_keys::kVersion] = checkpoint_version;
  f.metadata[checkpoint_keys::kNumExperts] = absl::StrCat(shape.num_experts);
  f.metadata[checkpoint_keys::kD] = absl::StrCat(shape.d);
  f.metadata[checkpoint_keys::kDff] = absl::StrCat(shape.d_ff);
  f.metadata[checkpoint_keys::kSeed] = absl::StrCat(seed);
  for (int e = 0; e < shape.num_experts; ++e) {
    std::vector<uint16_t> gu, dn;
    SyntheticExpert(e, shape, seed, &gu, &dn);
    f.metadata[checkpoint_keys::Digest(e)] = ExpertDigest(gu, dn);
    f.tensors[checkpoint_keys::GateUp(e)] = TensorBlob{"BF16", {2LL * shape.d_ff, shape.d}, AsBytes(gu)};
    f.tensors[checkpoint_keys::Down(e)] = TensorBlob{"BF16", {shape.d, shape.d_ff}, AsBytes(dn)};
  }
  return f;
}

}  // namespace moe
