#include "bench/stats.h"

#include <vector>

#include "gtest/gtest.h"

namespace moe::bench {
namespace {

TEST(StatsTest, MedianIsTheMiddleSampleUpperForEvenCounts) {
  EXPECT_EQ(Median({3, 1, 2}), 2);
  EXPECT_EQ(Median({4, 1, 3, 2}), 3);
  EXPECT_EQ(Median({7}), 7);
  EXPECT_EQ(Median({}), 0);
}

TEST(StatsTest, QuantileIndexesTheSortedSamplesWithoutInterpolation) {
  std::vector<double> v;
  for (int i = 299; i >= 0; --i) v.push_back(i);
  EXPECT_EQ(Quantile(v, 0.5), 150);
  EXPECT_EQ(Quantile(v, 0.9), 270);
  EXPECT_EQ(Quantile(v, 0), 0);
  EXPECT_EQ(Quantile(v, 1), 299);  // clamped to the last sample
}

}  // namespace
}  // namespace moe::bench
