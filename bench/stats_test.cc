#include "bench/stats.h"

#include <vector>

#include "gtest/gtest.h"

namespace moe::bench {
namespace {

// 0x0DA's convention, nearest rank x_(ceil(q n)): for an even count the median is the lower
// middle sample.
TEST(StatsTest, MedianIsTheNearestRankLowerForEvenCounts) {
  EXPECT_EQ(Median({3, 1, 2}), 2);
  EXPECT_EQ(Median({4, 1, 3, 2}), 2);
  EXPECT_EQ(Median({7}), 7);
  EXPECT_EQ(Median({}), 0);
}

TEST(StatsTest, QuantileIsTheNearestRankWithoutInterpolation) {
  std::vector<double> v;
  for (int i = 299; i >= 0; --i) v.push_back(i);
  EXPECT_EQ(Quantile(v, 0.5), 149);  // x_(150)
  EXPECT_EQ(Quantile(v, 0.9), 269);  // x_(270)
  EXPECT_EQ(Quantile(v, 0), 0);      // rank clamps to 1
  EXPECT_EQ(Quantile(v, 1), 299);
  // Twenty values of our own that give the spec's results (0x0DA: p50 = 11, p95 = 23, max 24).
  const std::vector<double> spec = {4, 5, 5, 6, 7, 8, 9, 10, 10, 11, 12, 13, 14, 15, 17, 18, 20, 22, 23, 24};
  EXPECT_EQ(Quantile(spec, 0.50), 11);
  EXPECT_EQ(Quantile(spec, 0.95), 23);
  EXPECT_EQ(Quantile(spec, 1.0), 24);
  // q n within rounding of an integer is that integer: 0.07 x 100 gives rank 7, not 8.
  std::vector<double> hundred;
  for (int i = 1; i <= 100; ++i) hundred.push_back(i);
  EXPECT_EQ(Quantile(hundred, 0.07), 7);
  EXPECT_EQ(Quantile(hundred, 0.99), 99);
}

}  // namespace
}  // namespace moe::bench
