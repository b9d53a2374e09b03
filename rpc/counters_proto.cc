#include "rpc/counters_proto.h"

namespace moe {

v1::GenerationCounters GenerationCountersToProto(int64_t version, const GenerationCounters& c) {
  v1::GenerationCounters out;
  out.set_version(version);
  out.set_steps(c.steps);
  out.set_failed_steps(c.failed_steps);
  out.set_aborted_steps(c.aborted_steps);
  out.set_rejected_steps(c.rejected_steps);
  out.set_count_failures(c.count_failures);
  out.set_canary_steps(c.canary_steps);
  out.set_decode_steps(c.decode_steps);
  out.set_fallback_steps(c.fallback_steps);
  out.set_routes_attempted(c.routes_attempted);
  out.set_routes_dropped(c.routes_dropped);
  out.set_shadow_samples(c.shadow_samples);
  out.set_shadow_mismatches(c.shadow_mismatches);
  out.set_shadow_failures(c.shadow_failures);
  out.set_stale_accepts(c.stale_accepts);
  return out;
}

GenerationCounters GenerationCountersFromProto(const v1::GenerationCounters& p) {
  GenerationCounters c;
  c.steps = p.steps();
  c.failed_steps = p.failed_steps();
  c.aborted_steps = p.aborted_steps();
  c.rejected_steps = p.rejected_steps();
  c.count_failures = p.count_failures();
  c.canary_steps = p.canary_steps();
  c.decode_steps = p.decode_steps();
  c.fallback_steps = p.fallback_steps();
  c.routes_attempted = p.routes_attempted();
  c.routes_dropped = p.routes_dropped();
  c.shadow_samples = p.shadow_samples();
  c.shadow_mismatches = p.shadow_mismatches();
  c.shadow_failures = p.shadow_failures();
  c.stale_accepts = p.stale_accepts();
  return c;
}

}  // namespace moe
