// Translation between a rank's per-generation counters (runtime/release/generation_counters.h)
// and their proto form (v1::GenerationCounters): the rank agent writes them into its status, the
// controller reads them back for the promotion gate. Field by field, by name; the generation's
// version travels beside the counters (the executor keys them by it). Pure functions.
#ifndef MOE_RPC_COUNTERS_PROTO_H_
#define MOE_RPC_COUNTERS_PROTO_H_

#include <cstdint>

#include "proto/moe/v1/rank_agent.pb.h"
#include "runtime/release/generation_counters.h"

namespace moe {

v1::GenerationCounters GenerationCountersToProto(int64_t version, const GenerationCounters& counters);
// Every counter of `proto` (its version is the caller's to read).
GenerationCounters GenerationCountersFromProto(const v1::GenerationCounters& proto);

}  // namespace moe

#endif  // MOE_RPC_COUNTERS_PROTO_H_
