// Gate-weighted combine over the semantic key (spec 0x03C3, 0x0AE).
//
// y[token[i], :] += gate[i] * rows[i, :] with FP32 accumulation. The gate is applied here,
// after the expert, exactly once. Rows come back in the origin's send order; `token` and
// `gate` are the handle's inverse coordinates for those positions.
#ifndef MOE_RUNTIME_PLAN_COMBINE_H_
#define MOE_RUNTIME_PLAN_COMBINE_H_

#include <cstdint>

#include "absl/status/status.h"

namespace moe {

struct CombineArgs {
  const float* rows = nullptr;     // [n, d]
  const int32_t* token = nullptr;  // [n], origin token of each row
  const float* gate = nullptr;     // [n]
  int64_t n = 0;
  int d = 0;
  int64_t num_tokens = 0;
  float* out = nullptr;  // [num_tokens, d], accumulated into (caller zeroes it)
};

absl::Status WeightedScatterAdd(const CombineArgs& args);

}  // namespace moe

#endif  // MOE_RUNTIME_PLAN_COMBINE_H_
