#include "runtime/plan/combine.h"

#include "absl/strings/str_cat.h"

namespace moe {

absl::Status WeightedScatterAdd(const CombineArgs& a) {
  if (a.d <= 0) return absl::InvalidArgumentError("d: must be positive");
  if (a.n > 0 && (a.rows == nullptr || a.token == nullptr || a.gate == nullptr || a.out == nullptr)) {
    return absl::InvalidArgumentError("combine: null buffer");
  }
  for (int64_t i = 0; i < a.n; ++i) {
    if (a.token[i] < 0 || a.token[i] >= a.num_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("token[", i, "] = ", a.token[i], " outside [0, ", a.num_tokens, ")"));
    }
  }
  for (int64_t i = 0; i < a.n; ++i) {
    const float g = a.gate[i];
    const float* row = a.rows + i * a.d;
    float* y = a.out + static_cast<int64_t>(a.token[i]) * a.d;
    for (int c = 0; c < a.d; ++c) y[c] += g * row[c];
  }
  return absl::OkStatus();
}

}  // namespace moe
