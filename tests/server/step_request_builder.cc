#include "tests/server/step_request_builder.h"

#include <cstring>
#include <string>

#include "kernels/numeric.h"

namespace moe::testing {

v1::StepRequest ValidStepRequest(uint64_t step_id, v1::Phase phase, const StepRequestShape& shape,
                                 const HiddenValue& hidden, const std::vector<float>& gates) {
  v1::StepRequest req;
  req.set_step_id(step_id);
  req.set_phase(phase);
  req.set_k(shape.k);
  req.mutable_hidden()->set_dtype(v1::DTYPE_BF16);
  req.mutable_hidden()->set_rows(shape.tokens);
  req.mutable_hidden()->set_cols(shape.d);
  std::string data(static_cast<size_t>(shape.tokens) * shape.d * 2, '\0');
  for (int i = 0; i < shape.tokens * shape.d; ++i) {
    const uint16_t b = kernels::FloatToBf16(hidden(i));
    std::memcpy(&data[2 * i], &b, 2);
  }
  req.mutable_hidden()->set_data(data);
  for (int t = 0; t < shape.tokens; ++t) {
    for (int j = 0; j < shape.k; ++j) {
      req.add_topk_ids((t + j) % shape.experts);
      req.add_topk_weights(gates[j % gates.size()]);
    }
  }
  return req;
}

}  // namespace moe::testing
