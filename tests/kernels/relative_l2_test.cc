#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

#include "kernels/numeric.h"

namespace moe::kernels {
namespace {

TEST(RelativeL2Test, IsTheNormOfTheDifferenceOverTheNormOfTheReference) {
  const std::vector<float> want = {3, 4};  // ||want|| = 5
  EXPECT_EQ(RelativeL2(want, want), 0.0);
  EXPECT_DOUBLE_EQ(RelativeL2(std::vector<float>{3, 5}, want), 1.0 / 5);
  EXPECT_DOUBLE_EQ(RelativeL2(std::vector<float>{6, 8}, want), 1.0);
  // Scale-free: both sides scaled by 1000 give the same value.
  EXPECT_DOUBLE_EQ(RelativeL2(std::vector<float>{3000, 5000}, std::vector<float>{3000, 4000}), 1.0 / 5);
}

TEST(RelativeL2Test, AZeroReferenceGivesTheAbsoluteError) {
  const std::vector<float> zero = {0, 0};
  EXPECT_EQ(RelativeL2(zero, zero), 0.0);
  EXPECT_DOUBLE_EQ(RelativeL2(std::vector<float>{3, 4}, zero), 5.0);
  EXPECT_EQ(RelativeL2(std::vector<float>{}, std::vector<float>{}), 0.0);
  RelativeL2Error none;
  EXPECT_EQ(none.Value(), 0.0);
}

TEST(RelativeL2Test, NaNAndMismatchedLengthsFailEveryBound) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(RelativeL2(std::vector<float>{nan, 1}, std::vector<float>{1, 1})));
  EXPECT_TRUE(std::isnan(RelativeL2(std::vector<float>{1, 1}, std::vector<float>{nan, 1})));
  EXPECT_TRUE(std::isnan(RelativeL2(std::vector<float>{1}, std::vector<float>{1, 1})));
  EXPECT_FALSE(RelativeL2(std::vector<float>{nan}, std::vector<float>{1}) < 1.0);
}

TEST(RelativeL2Test, Bf16ElementsWidenExactly) {
  const std::vector<uint16_t> got = {FloatToBf16(3), FloatToBf16(5)};
  EXPECT_DOUBLE_EQ(RelativeL2Bf16(got, std::vector<uint16_t>{FloatToBf16(3), FloatToBf16(4)}), 1.0 / 5);
  EXPECT_DOUBLE_EQ(RelativeL2Bf16(got, std::vector<float>{3, 4}), 1.0 / 5);
  EXPECT_DOUBLE_EQ(RelativeL2Bf16(got, std::vector<double>{3, 4}), 1.0 / 5);
  EXPECT_TRUE(std::isnan(RelativeL2Bf16(std::vector<uint16_t>{0x7fc0}, std::vector<double>{1})));  // BF16 NaN
}

TEST(RelativeL2Test, TheAccumulatorMatchesTheArrayForm) {
  const std::vector<float> got = {1.5f, -2, 0.25f}, want = {1, -2.5f, 0};
  RelativeL2Error e;
  for (size_t i = 0; i < got.size(); ++i) e.Add(got[i], want[i]);
  EXPECT_DOUBLE_EQ(e.Value(), RelativeL2(got, want));
  EXPECT_DOUBLE_EQ(e.Value(), std::sqrt((0.25 + 0.25 + 0.0625) / (1 + 6.25)));
}

}  // namespace
}  // namespace moe::kernels
