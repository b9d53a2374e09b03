// The CPU reference of the route-planning calls (kernels/api.h: SealRoutesParams,
// RankByKeyParams, ComposeIndexParams), on host memory. The CUDA implementation must match it
// exactly.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/api.h"

namespace moe::kernels {

absl::Status ExpertKernels::SealRoutes(const SealRoutesParams& p, Stream) {
  if (absl::Status s = CheckSealRoutes(p); !s.ok()) return s;
  p.status[0] = -1;
  p.status[1] = -1;
  for (int64_t i = 0; i < p.routes; ++i) {
    p.keys[i] = -1;
    p.gates_out[i] = 0.0f;
    if (p.local != nullptr) p.local[i] = -1;
    if (p.admitted != nullptr && p.admitted[i] == 0) continue;
    const int32_t e = p.ids[i];
    const float g = p.gates[i];
    if (e < 0 || e >= p.num_experts || !std::isfinite(g) || g < 0.0f) {
      if (p.status[0] < 0) p.status[0] = i;
      continue;
    }
    const int32_t key = p.key_of_expert[e];
    if (key < 0 && p.status[1] < 0) p.status[1] = i;
    p.keys[i] = key;
    p.gates_out[i] = g;
    if (p.local != nullptr && key >= 0 && key < p.num_keys) p.local[i] = p.local_of_key[key];
  }
  return absl::OkStatus();
}

absl::Status ExpertKernels::RankByKey(const RankByKeyParams& p, Stream) {
  if (absl::Status s = CheckRankByKey(p); !s.ok()) return s;
  // A route's key (-1 for a dropped or bad one, `*bad` set for a bad one), computed in both
  // passes instead of kept: the reference allocates nothing.
  auto key_of = [&](int64_t i, bool* bad) {
    int32_t key = p.raw[i];
    *bad = false;
    if (p.key_map != nullptr && key >= 0) {
      *bad = key >= p.map_size || p.key_map[key] < 0;
      key = *bad ? -1 : p.key_map[key];
    } else if (p.key_map != nullptr) {
      *bad = key != -1;
    }
    *bad = *bad || key >= p.num_keys;
    return *bad ? -1 : key;
  };
  p.status[0] = -1;
  for (int64_t i = 0; i < p.num_keys; ++i) p.counts[i] = 0;
  for (int64_t i = 0; i < p.n; ++i) {
    bool bad;
    const int32_t key = key_of(i, &bad);
    if (bad && p.status[0] < 0) p.status[0] = i;
    if (key >= 0) ++p.counts[key];
  }
  p.offsets[0] = 0;
  for (int k = 0; k < p.num_keys; ++k) p.offsets[k + 1] = p.offsets[k] + p.counts[k];
  // The counts again, as each key's cursor: they end where the first pass left them.
  for (int64_t k = 0; k < p.num_keys; ++k) p.counts[k] = 0;
  for (int64_t i = 0; i < p.n; ++i) {
    bool bad;
    const int32_t key = key_of(i, &bad);
    if (key < 0) {
      p.position[i] = -1;
      continue;
    }
    const int64_t pos = p.offsets[key] + p.counts[key]++;
    p.position[i] = static_cast<int32_t>(pos);
    if (p.order != nullptr) p.order[pos] = static_cast<int32_t>(i / p.order_divisor);
    if (p.values != nullptr) p.values[pos] = p.key_values[key];
  }
  return absl::OkStatus();
}

absl::Status ExpertKernels::ComposeIndex(const ComposeIndexParams& p, Stream) {
  if (absl::Status s = CheckComposeIndex(p); !s.ok()) return s;
  for (int64_t i = 0; i < p.n; ++i) {
    const int32_t j = p.b[i];
    p.out[i] = j >= 0 && j < p.a_n ? p.a[j] : -1;
  }
  return absl::OkStatus();
}

}  // namespace moe::kernels
