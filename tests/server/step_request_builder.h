// The valid StepRequest that tests of the engine API start from (tests/server and the hostile
// client of tests/integration): BF16 rows, every route admitted, token t routed to experts
// (t + j) % experts for j < k (distinct while k <= experts).
#ifndef MOE_TESTS_SERVER_STEP_REQUEST_BUILDER_H_
#define MOE_TESTS_SERVER_STEP_REQUEST_BUILDER_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "proto/moe/v1/expert_layer.pb.h"

namespace moe::testing {

struct StepRequestShape {
  int tokens = 4;
  int d = 64;
  int k = 2;
  int experts = 8;
};

// Element i of the hidden rows (row-major, before BF16 rounding); called for i = 0, 1, ... in
// order, so a generator may draw from a random source.
using HiddenValue = std::function<float(int i)>;

// Route j of every token gets gates[j % gates.size()].
v1::StepRequest ValidStepRequest(uint64_t step_id, v1::Phase phase, const StepRequestShape& shape,
                                 const HiddenValue& hidden, const std::vector<float>& gates = {0.5f});

}  // namespace moe::testing

#endif  // MOE_TESTS_SERVER_STEP_REQUEST_BUILDER_H_
