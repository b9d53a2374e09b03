// What one rank observed per placement generation since it started: the promotion gate's inputs
// (spec 0x0DC, 0x0D denominators) as the rank sees them. The executor counts them
// (runtime/exec/layer_executor.h), the rank agent reports them, and the controller aggregates
// them over the ranks (runtime/release/evidence.h). A leaf: plain data, thread-compatible.
#ifndef MOE_RUNTIME_RELEASE_GENERATION_COUNTERS_H_
#define MOE_RUNTIME_RELEASE_GENERATION_COUNTERS_H_

#include <cstdint>

namespace moe {

struct GenerationCounters {
  int64_t steps = 0;  // answered under this generation: prefill, decode and canary
  int64_t failed_steps = 0;
  int64_t aborted_steps = 0;   // refused by the step agreement before payload (not failures)
  int64_t rejected_steps = 0;  // the engine's input refused by this rank's checks (not failures)
  int64_t canary_steps = 0;
  int64_t decode_steps = 0;
  int64_t fallback_steps = 0;     // decode steps that ran eagerly
  int64_t routes_attempted = 0;   // routes the engine admitted (its router's drops are not counted)
  int64_t routes_dropped = 0;     // admitted routes not delivered: none (no capacity-drop path)
  int64_t shadow_samples = 0;     // steps also run on this generation as a shadow
  int64_t shadow_mismatches = 0;  // ... whose output differed from the active one's
  int64_t shadow_failures = 0;    // ... whose shadow pass failed
  // Steps served by a generation that is not the one they had to use (0x0DB stale-handle
  // acceptance): expected_generation differs from the serving one, or a canary step's generation
  // is no longer PREPARED / ACTIVE. The fences reject such steps first, so this counts breaches.
  int64_t stale_accepts = 0;
  // Steps the agreement aborted because a member's route counts did not conserve (its count row
  // and its slot counts disagree; runtime/exec/step_exchange.h): 0x0DC's N_count_failure.
  int64_t count_failures = 0;
};

}  // namespace moe

#endif  // MOE_RUNTIME_RELEASE_GENERATION_COUNTERS_H_
