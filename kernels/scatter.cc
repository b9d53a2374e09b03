// The CPU reference of Scatter (kernels/api.h: ScatterParams), on host memory. The CUDA
// implementation must match it exactly.
#include <cstdint>
#include <cstring>

#include "kernels/api.h"

namespace moe::kernels {

absl::Status ExpertKernels::Scatter(const ScatterParams& p, Stream) {
  if (absl::Status s = CheckScatter(p); !s.ok()) return s;
  const size_t row_bytes = static_cast<size_t>(p.d) * 2;
  const int64_t ld = p.out_ld > 0 ? p.out_ld : p.d;
  for (int64_t i = 0; i < p.in_rows; ++i) {
    for (int j = 0; j < p.fanout; ++j) {
      const int32_t to = p.dest[i * p.fanout + j];
      if (to < 0 || to >= p.out_rows) continue;
      std::memcpy(p.out + static_cast<int64_t>(to) * ld, p.in + i * p.d, row_bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace moe::kernels
