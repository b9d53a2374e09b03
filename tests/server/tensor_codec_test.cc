// The wire codecs against the compiler's own IEEE binary16 (_Float16): every FP16 value decodes
// to the BF16 rounding of its exact value, every BF16 value in FP16's range encodes to the
// nearest FP16 (ties to even), and the length / finiteness checks name the field.
#include "server/tensor_codec.h"

#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
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
  // A finite FP32 value too large for BF16 would round to infinity: refused the same way.
  t.set_dtype(v1::DTYPE_FP32);
  t.set_rows(1);
  t.set_cols(2);
  const float big[2] = {1.0f, 3.4e38f};
  t.set_data(std::string(reinterpret_cast<const char*>(big), sizeof(big)));
  bad = DecodeToBf16(t, "hidden");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("hidden.data[1]: not finite (after rounding"));
}

// BF16 rows on the wire are read in place; other dtypes, or BF16 bytes at an odd address, are
// converted into an owned copy; either way the values equal DecodeToBf16's and errors match.
TEST(TensorCodecTest, ReadBf16ViewsBf16AndConvertsTheRest) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  t.set_rows(2);
  t.set_cols(4);
  std::string bytes(1 + 16, '\0');
  for (int i = 0; i < 8; ++i) {
    const uint16_t v = kernels::FloatToBf16(0.5f * static_cast<float>(i) - 1.0f);
    std::memcpy(&bytes[1 + 2 * i], &v, 2);
  }
  // Aligned BF16 bytes: a view, no copy.
  std::string aligned = bytes.substr(1);
  t.set_data(aligned);
  auto rows = ReadBf16(t, t.data().data(), t.data().size(), "hidden");
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_TRUE(rows->is_view());
  EXPECT_EQ(rows->data(), reinterpret_cast<const uint16_t*>(t.data().data()));
  const auto decoded = *DecodeToBf16(t, "hidden");
  EXPECT_EQ(std::vector<uint16_t>(rows->data(), rows->data() + 8), decoded);
  // The same bytes at an odd address (e.g. an odd offset in a shared region): an owned copy.
  auto odd = ReadBf16(t, bytes.data() + 1, 16, "hidden_region");
  ASSERT_TRUE(odd.ok()) << odd.status();
  EXPECT_FALSE(odd->is_view());
  EXPECT_EQ(std::vector<uint16_t>(odd->data(), odd->data() + 8), decoded);
  // FP32 on the wire: converted.
  v1::Tensor f = t;
  f.set_dtype(v1::DTYPE_FP32);
  std::string fbytes(32, '\0');
  for (int i = 0; i < 8; ++i) {
    const float v = 0.5f * static_cast<float>(i) - 1.0f;
    std::memcpy(&fbytes[4 * i], &v, 4);
  }
  f.set_data(fbytes);
  auto conv = ReadBf16(f, f.data().data(), f.data().size(), "hidden");
  ASSERT_TRUE(conv.ok()) << conv.status();
  EXPECT_FALSE(conv->is_view());
  EXPECT_EQ(std::vector<uint16_t>(conv->data(), conv->data() + 8), decoded);
  // A length that does not match dtype x shape: the same error as DecodeToBf16.
  auto bad = ReadBf16(t, t.data().data(), 15, "hidden");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("hidden.data: 15 bytes"));
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// Shapes whose byte count wraps in 64 bits are refused, not reduced modulo 2^64 (rows 2^62 x
// cols 2 x 2 bytes is 0 mod 2^64, which an empty data field used to match).
TEST(TensorCodecTest, WireBytesRefusesShapesThatOverflow) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  t.set_rows(int64_t{1} << 62);
  t.set_cols(2);
  auto bytes = WireBytes(t, "hidden");
  ASSERT_FALSE(bytes.ok());
  EXPECT_NE(bytes.status().message().find("overflows"), std::string::npos) << bytes.status();
  EXPECT_FALSE(ReadBf16(t, "", 0, "hidden").ok());
  t.set_rows(3);
  t.set_cols(5);
  t.set_dtype(v1::DTYPE_FP32);
  ASSERT_TRUE(WireBytes(t, "hidden").ok());
  EXPECT_EQ(*WireBytes(t, "hidden"), 60);
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

// Every BF16 value at every position of a word (and in the tail): rejected exactly when it is
// NaN or infinite, and the error names its index.
TEST(TensorCodecTest, CheckFiniteBf16FindsExactlyTheNonFiniteValues) {
  std::vector<uint16_t> rows(11, 0x3f80);  // 1.0
  for (uint32_t v = 0; v <= 0xffff; ++v) {
    const bool finite = std::isfinite(kernels::Bf16ToFloat(static_cast<uint16_t>(v)));
    for (int at : {0, 3, 6, 10}) {
      rows[at] = static_cast<uint16_t>(v);
      const absl::Status s = CheckFiniteBf16(rows.data(), static_cast<int64_t>(rows.size()), "hidden");
      ASSERT_EQ(s.ok(), finite) << std::hex << v << " at " << at;
      if (!finite) {
        ASSERT_NE(s.message().find("hidden.data[" + std::to_string(at) + "]"), std::string::npos);
      }
      rows[at] = 0x3f80;
    }
  }
}

// Rows large enough to be checked by several threads: a NaN or an infinity in any thread's part,
// at its edges and in the odd tail, is found and named.
// Sizes whose quarter is a multiple of 4 with 1-3 values over (2^20 + 1, 2^21 + 3) once left those
// last values to no thread.
TEST(TensorCodecTest, CheckFiniteBf16SplitAcrossThreadsMissesNoPart) {
  for (const int64_t n : {(int64_t{1} << 20) * 3 + 7, (int64_t{1} << 20) + 1, (int64_t{1} << 21) + 3}) {
    std::vector<uint16_t> rows(n, 0xbf80);  // -1.0
    EXPECT_TRUE(CheckFiniteBf16(rows.data(), n, "hidden").ok()) << n;
    for (int64_t at : {int64_t{0}, n / 4 - 1, n / 4, n / 2 + 1, 3 * n / 4, n - 5, n - 2, n - 1}) {
      for (uint16_t bad : {uint16_t{0x7fc0}, uint16_t{0xff80}}) {  // NaN, -inf
        rows[at] = bad;
        const absl::Status s = CheckFiniteBf16(rows.data(), n, "hidden");
        EXPECT_FALSE(s.ok()) << n << " at " << at;
        EXPECT_NE(s.message().find("hidden.data[" + std::to_string(at) + "]"), std::string::npos) << s;
        rows[at] = 0xbf80;
      }
    }
  }
}

// The pool's check, started and awaited later, answers what CheckFiniteBf16 answers: OK for
// finite rows, the first bad index otherwise (whichever part of the rows it is in), in line for
// small rows, and checks started from several threads at once do not mix.
TEST(TensorCodecTest, FiniteCheckPoolAnswersAsTheInlineCheck) {
  FiniteCheckPool pool(3);
  const int64_t n = 3 * FiniteCheckPool::kMinValues + 5;
  std::vector<uint16_t> rows(n, kernels::FloatToBf16(0.25f));
  EXPECT_TRUE(pool.Start(rows.data(), n, "hidden")->Await().ok());
  for (int64_t bad : {int64_t{0}, n / 2, n - 1}) {
    std::vector<uint16_t> r = rows;
    r[bad] = 0xff80;                           // -inf
    if (bad > 0) r[n - 1 - bad / 3] = 0x7fc0;  // a second bad value, later or earlier
    auto check = pool.Start(r.data(), n, "hidden");
    const absl::Status got = check->Await();
    const absl::Status want = CheckFiniteBf16(r.data(), n, "hidden");
    EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(got.message(), want.message());
    EXPECT_EQ(check->Await().message(), want.message());  // idempotent
  }
  std::vector<uint16_t> small(100, 0);
  small[42] = 0x7f80;
  auto inline_check = pool.Start(small.data(), 100, "hidden");
  EXPECT_THAT(std::string(inline_check->Await().message()), ::testing::HasSubstr("hidden.data[42]"));
  std::vector<uint16_t> dirty = rows;
  dirty[n - 3] = 0x7fc0;
  std::vector<absl::Status> results(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back(
        [&, t] { results[t] = pool.Start(t % 2 == 0 ? rows.data() : dirty.data(), n, "hidden")->Await(); });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < 8; ++t) {
    if (t % 2 == 0) {
      EXPECT_TRUE(results[t].ok()) << t << ": " << results[t];
    } else {
      EXPECT_THAT(std::string(results[t].message()), ::testing::HasSubstr(absl::StrCat("hidden.data[", n - 3, "]")));
    }
  }
}

}  // namespace
}  // namespace moe
