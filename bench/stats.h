// Order statistics of the benches' timing samples.
#ifndef MOE_BENCH_STATS_H_
#define MOE_BENCH_STATS_H_

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace moe::bench {

// The sample at index floor(q * n) of the n samples in ascending order (the last one when that
// index is n), with no interpolation; 0 when there are none. q in [0, 1].
inline double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

// Quantile(v, 0.5): the middle sample, the upper of the two middle ones for an even count.
inline double Median(std::vector<double> v) { return Quantile(std::move(v), 0.5); }

}  // namespace moe::bench

#endif  // MOE_BENCH_STATS_H_
