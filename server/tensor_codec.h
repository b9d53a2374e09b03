// Proto tensors <-> BF16 rows, with the length checks the API promises (INVALID_ARGUMENT naming
// the field when bytes do not match dtype x shape).
#ifndef MOE_SERVER_TENSOR_CODEC_H_
#define MOE_SERVER_TENSOR_CODEC_H_

#include <vector>

#include "absl/status/statusor.h"
#include "proto/moe/v1/expert_layer.pb.h"

namespace moe {

absl::StatusOr<std::vector<uint16_t>> DecodeToBf16(const v1::Tensor& t, const char* field);
void EncodeFromBf16(const std::vector<uint16_t>& rows, int64_t n, int64_t d, v1::DType dtype, v1::Tensor* out);

}  // namespace moe

#endif  // MOE_SERVER_TENSOR_CODEC_H_
