// The CPU reference's projection: FP32 activation rows times BF16 weight rows, the weights read
// as they are stored (no widened copy), each output summed in one fixed order.
#ifndef MOE_KERNELS_CPU_DOT_BF16_H_
#define MOE_KERNELS_CPU_DOT_BF16_H_

#include <cstdint>

namespace moe::kernels::cpu {

// out[r * n_out + c] = sum_k x[r * n_k + k] * w[c * n_k + k] for r < m, c < n_out (w: BF16
// bits, nn.Linear layout [n_out, n_k]). Every output is summed the same way whatever m and the
// other rows: eight partial sums over k = j (mod 8) by multiply-adds in k order, added as
// (j, j + 4), then (j, j + 2), then (0, 1), then the n_k % 8 tail in k order. A row's result
// therefore does not depend on its batch (the layout's padding, the step's other rows). AVX2
// with fused multiply-adds when the build targets them (x86-64-v3, the default), plain loops
// otherwise (--config=portable: the same order, unfused; the bits are fixed within a build).
void DotRowsBf16(const float* x, int64_t m, int n_k, const uint16_t* w, int n_out, float* out);

}  // namespace moe::kernels::cpu

#endif  // MOE_KERNELS_CPU_DOT_BF16_H_
