#include "server/tensor_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#include "kernels/numeric.h"

namespace moe {
namespace {

// Value `i` of the rows is not finite: named `hidden.data[i]` for rows sent inline, and by its
// place among the values read for a shared-region reference (`hidden_region`), which has no data.
absl::Status NotFinite(const char* field, int64_t i, absl::string_view why = "") {
  const absl::string_view f(field);
  const std::string tail = why.empty() ? "" : absl::StrCat(" (", why, ")");
  if (absl::EndsWith(f, "_region")) {
    return absl::InvalidArgumentError(absl::StrCat(f, ": value ", i, " is not finite", tail));
  }
  return absl::InvalidArgumentError(absl::StrCat(f, ".data[", i, "]: not finite", tail));
}

float HalfToFloat(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0)
    v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31)
    v = man ? NAN : INFINITY;
  else
    v = std::ldexp(1.0f + man / 1024.0f, exp - 15);
  return sign ? -v : v;
}

uint16_t FloatToHalf(float f) {
  // Round to nearest even (overflow to inf; values at or below half the smallest subnormal,
  // 2^-25, round to zero; above it they round to a subnormal).
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;
  if (a <= std::ldexp(1.0f, -25)) return sign;
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1 + 15;
  if (exp <= 0) {  // subnormal
    const float scaled = std::nearbyint(a * std::ldexp(1.0f, 24));
    return sign | static_cast<uint16_t>(scaled);
  }
  uint32_t man = static_cast<uint32_t>(std::nearbyint((m * 2.0f - 1.0f) * 1024.0f));
  if (man == 1024) {
    man = 0;
    ++exp;
  }
  if (exp >= 31) return sign | 0x7c00;
  return sign | static_cast<uint16_t>(exp << 10) | static_cast<uint16_t>(man);
}

}  // namespace

int WireWidth(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16:
      return 2;
    case v1::DTYPE_FP32:
      return 4;
    default:
      return 0;
  }
}

namespace {

absl::Status CheckShape(const v1::Tensor& t, size_t size, const char* field) {
  auto need = WireBytes(t, field);
  if (!need.ok()) return need.status();
  if (static_cast<uint64_t>(size) != static_cast<uint64_t>(*need)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: ", size, " bytes, dtype x shape needs ", *need));
  }
  return absl::OkStatus();
}

// Converts checked wire bytes into `out` (t.rows() * t.cols() values).
absl::Status Convert(const v1::Tensor& t, const char* p, const char* field, std::vector<uint16_t>* out) {
  const int64_t n = t.rows() * t.cols();
  out->resize(n);
  if (t.dtype() == v1::DTYPE_BF16) {
    std::memcpy(out->data(), p, n * 2);  // the wire format is the internal format
    return CheckFiniteBf16(out->data(), n, field);
  }
  for (int64_t i = 0; i < n; ++i) {
    float v;
    if (t.dtype() == v1::DTYPE_FP16) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      v = HalfToFloat(h);
    } else {
      std::memcpy(&v, p + 4 * i, 4);
    }
    if (!std::isfinite(v)) return NotFinite(field, i);
    const uint16_t b = kernels::FloatToBf16(v);
    // A finite FP32 value at or above ~3.3961e38 rounds to BF16 infinity.
    if ((b & 0x7f80) == 0x7f80) return NotFinite(field, i, "after rounding to BF16");
    (*out)[i] = b;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> WireBytes(const v1::Tensor& t, const char* field) {
  if (t.rows() < 0 || t.cols() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape [", t.rows(), ", ", t.cols(), "] is not valid"));
  }
  const int width = WireWidth(t.dtype());
  if (width == 0) return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: must be BF16, FP16 or FP32"));
  int64_t n = 0, bytes = 0;
  if (__builtin_mul_overflow(t.rows(), t.cols(), &n) || __builtin_mul_overflow(n, int64_t{width}, &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape [", t.rows(), ", ", t.cols(), "] x ", width, " bytes overflows 64 bits"));
  }
  return bytes;
}

namespace {

// Whether rows[0, n) holds a NaN or an infinity. NaN and infinity have every exponent bit set.
// Four values a 64-bit word: a lane of (v & exp) ^ exp is zero exactly for them, and adding
// 0x7fff sets the lane's top bit exactly when it is not zero (lanes are at most 0x7f80: no carry
// into the next). 3-4x faster than a loop over values, which the compiler leaves scalar at -O2.
bool AnyNonFiniteBf16(const uint16_t* rows, int64_t n) {
  constexpr uint64_t kExp = 0x7f807f807f807f80ull, kAdd = 0x7fff7fff7fff7fffull, kTop = 0x8000800080008000ull;
  uint64_t all = kTop;
  const int64_t words = n / 4;
  for (int64_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, rows + 4 * i, 8);
    all &= ((w & kExp) ^ kExp) + kAdd;
  }
  bool bad = (all & kTop) != kTop;
  for (int64_t i = words * 4; i < n; ++i) bad = bad || (rows[i] & 0x7f80) == 0x7f80;
  return bad;
}

// Rows from this many values up are checked by kCheckThreads threads (a prefill step's 8 MiB
// took one thread ~1.5 ms on the H200 machine, more than the step's experts).
constexpr int64_t kParallelCheckValues = int64_t{1} << 20;
constexpr int kCheckThreads = 4;

}  // namespace

absl::Status CheckFiniteBf16(const uint16_t* rows, int64_t n, const char* field) {
  bool bad = false;
  if (n < kParallelCheckValues) {
    bad = AnyNonFiniteBf16(rows, n);
  } else {
    // Parts of a multiple of 4 values; the last one ends at n whatever the rounding left.
    const int64_t chunk = ((n + kCheckThreads - 1) / kCheckThreads + 3) / 4 * 4;
    bool part[kCheckThreads] = {};
    std::vector<std::thread> threads;
    threads.reserve(kCheckThreads - 1);
    for (int t = 1; t < kCheckThreads; ++t) {
      const int64_t begin = std::min(n, t * chunk);
      const int64_t end = t + 1 == kCheckThreads ? n : std::min(n, (t + 1) * chunk);
      auto check = [&part, rows, t, begin, end] { part[t] = AnyNonFiniteBf16(rows + begin, end - begin); };
      try {
        threads.emplace_back(check);
      } catch (const std::system_error&) {
        check();  // no thread to be had (many requests at once): this one checks the part itself
      }
    }
    part[0] = AnyNonFiniteBf16(rows, std::min(n, chunk));
    for (auto& th : threads) th.join();
    for (bool b : part) bad = bad || b;
  }
  if (!bad) return absl::OkStatus();
  // The index is looked for only when a value is bad.
  for (int64_t i = 0; i < n; ++i) {
    if ((rows[i] & 0x7f80) == 0x7f80) return NotFinite(field, i);
  }
  return absl::OkStatus();
}

FiniteCheckPool::FiniteCheckPool(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
}

FiniteCheckPool::~FiniteCheckPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& t : threads_) t.join();
}

void FiniteCheckPool::Work() {
  while (true) {
    Part part;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](FiniteCheckPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stop_ || !p->parts_.empty(); },
          this));
      if (parts_.empty()) return;  // stopping
      part = std::move(parts_.front());
      parts_.pop_front();
    }
    Check& c = *part.check;
    const bool bad = AnyNonFiniteBf16(c.rows_ + part.begin, part.end - part.begin);
    absl::MutexLock lock(&c.mu_);
    c.bad_ = c.bad_ || bad;
    --c.pending_;
  }
}

std::shared_ptr<FiniteCheckPool::Check> FiniteCheckPool::Start(const uint16_t* rows, int64_t n, const char* field) {
  auto check = std::make_shared<Check>();
  check->rows_ = rows;
  check->n_ = n;
  check->field_ = field;
  if (n < kMinValues || threads_.empty()) {
    absl::MutexLock lock(&check->mu_);
    check->bad_ = AnyNonFiniteBf16(rows, n);
    return check;
  }
  const int parts = static_cast<int>(threads_.size());
  const int64_t chunk = (n / parts + 3) / 4 * 4;
  {
    absl::MutexLock lock(&check->mu_);
    check->pending_ = parts;
  }
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < parts; ++i)
    parts_.push_back({check, std::min(n, i * chunk), i + 1 == parts ? n : std::min(n, (i + 1) * chunk)});
  return check;
}

absl::Status FiniteCheckPool::Check::Await() {
  bool bad = false;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](Check* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu_) { return c->pending_ == 0; }, this));
    bad = bad_;
  }
  return bad ? CheckFiniteBf16(rows_, n_, field_) : absl::OkStatus();
}

absl::StatusOr<std::vector<uint16_t>> DecodeToBf16(const v1::Tensor& t, const char* data, size_t size,
                                                   const char* field) {
  absl::Status s = CheckShape(t, size, field);
  if (!s.ok()) return s;
  std::vector<uint16_t> out;
  s = Convert(t, data, field, &out);
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<Bf16Rows> ReadBf16(const v1::Tensor& t, const char* data, size_t size, const char* field) {
  absl::Status s = CheckShape(t, size, field);
  if (!s.ok()) return s;
  Bf16Rows rows;
  if (t.dtype() == v1::DTYPE_BF16 && reinterpret_cast<uintptr_t>(data) % alignof(uint16_t) == 0) {
    rows.view_ = reinterpret_cast<const uint16_t*>(data);
    s = CheckFiniteBf16(rows.view_, t.rows() * t.cols(), field);
    if (!s.ok()) return s;
    return rows;
  }
  s = Convert(t, data, field, &rows.owned_);
  if (!s.ok()) return s;
  return rows;
}

void EncodeBytes(absl::Span<const uint16_t> rows, v1::DType dtype, char* out) {
  if (dtype == v1::DTYPE_BF16 || dtype == v1::DTYPE_UNSPECIFIED) {
    std::memcpy(out, rows.data(), rows.size() * 2);
    return;
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const float v = kernels::Bf16ToFloat(rows[i]);
    if (dtype == v1::DTYPE_FP32) {
      std::memcpy(out + 4 * i, &v, 4);
    } else {
      const uint16_t h = FloatToHalf(v);
      std::memcpy(out + 2 * i, &h, 2);
    }
  }
}

void EncodeFromBf16(absl::Span<const uint16_t> rows, int64_t n, int64_t d, v1::DType dtype, v1::Tensor* out) {
  out->set_dtype(dtype == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_BF16 : dtype);
  out->set_rows(n);
  out->set_cols(d);
  std::string* data = out->mutable_data();
  data->resize(rows.size() * WireWidth(out->dtype()));
  EncodeBytes(rows, out->dtype(), data->data());
}

}  // namespace moe
