// The CPU reference's grouped SwiGLU (kernels/cpu) at decode and prefill sizes: E = 8 experts,
// d = 2048, d_ff 64 (the engine API benchmark's experts) and 768, m rows per expert; median of
// 9 calls. Build twice to compare the instruction sets: plain (x86-64-v3) and --config=portable.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "bench/stats.h"
#include "kernels/api.h"
#include "kernels/numeric.h"
using namespace moe::kernels;
int main() {
  const int e = 8, d = 2048;
  auto k = CreateCpuKernels();
  for (int f : {64, 768})
    for (int m : {1, 4, 32, 256}) {
      std::vector<uint16_t> wgu(size_t(e) * 2 * f * d, FloatToBf16(0.01f)), wd(size_t(e) * d * f, FloatToBf16(0.01f));
      std::vector<uint16_t> x(size_t(e) * m * d, FloatToBf16(0.5f)), y(x.size());
      std::vector<int64_t> off(e + 1);
      for (int i = 0; i <= e; ++i) off[i] = int64_t(i) * m;
      SwigluParams p;
      p.weights = {wgu.data(), wd.data(), e, d, f};
      p.x = x.data();
      p.rows = int64_t(e) * m;
      p.host_offsets = off.data();
      p.y = y.data();
      std::vector<double> us;
      for (int r = 0; r < 9; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        if (!k->Swiglu(p, nullptr).ok()) return 1;
        us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      std::printf("d_ff=%d m=%d: %.0f us\n", f, m, moe::bench::Median(us));
    }
}
