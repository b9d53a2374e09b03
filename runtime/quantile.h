// The project's one quantile convention (spec 0x0DA): nearest rank, Q_q = x_(ceil(q n)) of the n
// observations in ascending order, no interpolation (p50 of 20 values is the 10th, p95 the 19th).
// The promotion evidence, the benches and the engine driver all report quantiles through it.
#ifndef MOE_RUNTIME_QUANTILE_H_
#define MOE_RUNTIME_QUANTILE_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace moe {

// The 1-based nearest rank ceil(q n), clamped to [1, n]. q n is taken as the integer it is within
// rounding (0.07 x 100 is 7.000000000000001 in binary: rank 7, not 8).
inline size_t NearestRankIndex(size_t n, double q) {
  double x = q * static_cast<double>(n);
  const double whole = std::round(x);
  if (std::abs(x - whole) <= 1e-9 * std::max(1.0, std::abs(x))) x = whole;
  const double rank = std::ceil(x);
  if (!(rank >= 1)) return 1;  // also a NaN q
  return rank >= static_cast<double>(n) ? n : static_cast<size_t>(rank);
}

// Q_q of `values` (0 when there are none). q in [0, 1].
inline double NearestRank(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[NearestRankIndex(values.size(), q) - 1];
}

}  // namespace moe

#endif  // MOE_RUNTIME_QUANTILE_H_
