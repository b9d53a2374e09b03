// Order statistics of the benches' timing samples.
#ifndef MOE_BENCH_STATS_H_
#define MOE_BENCH_STATS_H_

#include <utility>
#include <vector>

#include "runtime/quantile.h"

namespace moe::bench {

// The spec's nearest-rank quantile (0x0DA, runtime/quantile.h): x_(ceil(q n)) of the n samples in
// ascending order, no interpolation; 0 when there are none. q in [0, 1].
inline double Quantile(std::vector<double> v, double q) { return NearestRank(std::move(v), q); }

// Quantile(v, 0.5): x_(ceil(n / 2)), the lower of the two middle samples for an even count.
inline double Median(std::vector<double> v) { return Quantile(std::move(v), 0.5); }

}  // namespace moe::bench

#endif  // MOE_BENCH_STATS_H_
