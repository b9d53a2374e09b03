// The wire codecs against the compiler's own IEEE binary16 (_Float16): every FP16 value decodes
// to the BF16 rounding of its exact value, every BF16 value in FP16's range encodes to the
// nearest FP16 (ties to even), and the length / finiteness checks name the field.
#include "server/tensor_codec.h"

#include <cmath>
#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/numeric.h"

namespace moe {
namespace {

uint16_t Bits(_Float16 h) {
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

_Float16 Half(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return h;
}

TEST(TensorCodecTest, EveryFp16ValueDecodesToItsBf16Rounding) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FP16);
  t.set_rows(1);
  t.set_cols(1);
  int checked = 0;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float exact = static_cast<float>(Half(static_cast<uint16_t>(b)));
    const uint16_t wire = static_cast<uint16_t>(b);
    auto out = DecodeToBf16(t, reinterpret_cast<const char*>(&wire), 2, "hidden");
    if (!std::isfinite(exact)) {
      EXPECT_FALSE(out.ok()) << std::hex << b;
      continue;
    }
    ASSERT_TRUE(out.ok()) << std::hex << b << ": " << out.status();
    ASSERT_EQ((*out)[0], kernels::FloatToBf16(exact)) << std::hex << b;
    ++checked;
  }
  EXPECT_EQ(checked, 0x10000 - 2 * 0x400);  // all but the infinities and NaNs
}

TEST(TensorCodecTest, EveryBf16ValueEncodesToTheNearestFp16) {
  int checked = 0;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float v = kernels::Bf16ToFloat(static_cast<uint16_t>(b));
    if (!std::isfinite(v)) continue;
    const std::vector<uint16_t> rows = {static_cast<uint16_t>(b)};
    uint16_t got;
    EncodeBytes(rows, v1::DTYPE_FP16, reinterpret_cast<char*>(&got));
    const uint16_t want = Bits(static_cast<_Float16>(v));  // round to nearest even, overflow to inf
    if (std::isnan(static_cast<float>(Half(want)))) continue;
    ASSERT_EQ(got, want) << std::hex << b << " (" << v << ")";
    ++checked;
  }
  EXPECT_GT(checked, 60000);
}

TEST(TensorCodecTest, LengthAndFinitenessErrorsNameTheField) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FP16);
  t.set_rows(2);
  t.set_cols(3);
  t.set_data(std::string(11, '\0'));
  auto bad = DecodeToBf16(t, "hidden");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("hidden.data: 11 bytes"));
  std::string data(12, '\0');
  const uint16_t inf = 0x7c00;
  std::memcpy(&data[8], &inf, 2);
  t.set_data(data);
  bad = DecodeToBf16(t, "hidden");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("hidden.data[4]: not finite"));
}

}  // namespace
}  // namespace moe
