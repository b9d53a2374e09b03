// The CPU reference of Scatter (kernels/api.h: ScatterParams), on host memory. The CUDA
// implementation must match it exactly.
#include <cstdint>
#include <cstring>

#include "kernels/api.h"
#include "kernels/numeric.h"

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

absl::Status ExpertKernels::PackFp8Rows(const PackFp8Params& p, Stream) {
  if (absl::Status s = CheckPackFp8(p); !s.ok()) return s;
  const int groups = p.d / 128;
  const int64_t packed = Fp8PackedRowBytes(p.d), pad_at = p.d + 4 * static_cast<int64_t>(groups);
  for (int64_t t = 0; t < p.tokens; ++t) {
    const uint8_t* first = nullptr;  // the token's row, quantized once, copied to its other routes
    for (int j = 0; j < p.k; ++j) {
      const int32_t to = p.dest[t * p.k + j];
      if (to < 0 || to >= p.out_rows) continue;
      uint8_t* row = p.out + static_cast<int64_t>(to) * packed;
      if (first != nullptr) {
        if (row != first) std::memcpy(row, first, static_cast<size_t>(packed));
        continue;
      }
      for (int g = 0; g < groups; ++g) {
        const float scale = QuantizeFp8Group(p.x + t * p.d + g * 128, 128, row + g * 128);
        std::memcpy(row + p.d + 4 * g, &scale, 4);
      }
      std::memset(row + pad_at, 0, static_cast<size_t>(packed - pad_at));
      first = row;
    }
  }
  return absl::OkStatus();
}

}  // namespace moe::kernels
