// A rank's random input for executor tests: BF16 rows of d columns, k = 2 distinct experts a
// token (of `experts`), gates g and 1 - g, and, when asked, one in ten first routes dropped by the
// router. Draws from `rng` in a fixed order, so a seed gives the same steps.
#ifndef MOE_TESTS_RUNTIME_RANDOM_STEP_H_
#define MOE_TESTS_RUNTIME_RANDOM_STEP_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/numeric.h"
#include "runtime/exec/step.h"

namespace moe::testing {

struct RandomRankInput {
  std::vector<uint16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> gates;
  std::vector<uint8_t> admitted;  // empty: every route admitted
  int64_t tokens = 0;
  int d = 0;

  // The executor's view (this input must outlive the step).
  LayerStepInput Step(uint64_t step, int64_t layer, Phase phase = Phase::kPrefill) const {
    LayerStepInput in;
    in.step_id = step;
    in.layer = layer;
    in.phase = phase;
    in.hidden = hidden.data();
    in.tokens = tokens;
    in.d = d;
    in.topk_ids = ids.data();
    in.topk_weights = gates.data();
    in.k = 2;
    in.admitted = admitted.empty() ? nullptr : admitted.data();
    return in;
  }
};

inline RandomRankInput RandomTwoRouteInput(std::mt19937& rng, int64_t tokens, int d, int experts, bool drop_some) {
  RandomRankInput in;
  in.tokens = tokens;
  in.d = d;
  std::normal_distribution<float> n(0, 1);
  for (int64_t i = 0; i < tokens * d; ++i) in.hidden.push_back(kernels::FloatToBf16(n(rng)));
  for (int64_t t = 0; t < tokens; ++t) {
    const int e0 = static_cast<int>(rng() % experts);
    const int e1 = (e0 + 1 + static_cast<int>(rng() % (experts - 1))) % experts;
    in.ids.push_back(e0);
    in.ids.push_back(e1);
    const float g = std::uniform_real_distribution<float>(0, 1)(rng);
    in.gates.push_back(g);
    in.gates.push_back(1 - g);
    if (drop_some) {
      in.admitted.push_back(rng() % 10 != 0);
      in.admitted.push_back(1);
    }
  }
  return in;
}

}  // namespace moe::testing

#endif  // MOE_TESTS_RUNTIME_RANDOM_STEP_H_
