// What the process-group Join stream (proto/moe/v1/process_group.proto) carries beside its
// messages, shared by its two ends: moe-controller's coordinator and moe-rankd's member.
#ifndef MOE_RPC_GROUP_PROTOCOL_H_
#define MOE_RPC_GROUP_PROTOCOL_H_

#include <string_view>

namespace moe {

// Trailing metadata on a Join the coordinator refuses for good: the joining process was replaced
// by a newer one of the same rank ("replaced"). The member stops serving and stops rejoining;
// any other refusal is retried.
inline constexpr std::string_view kFencedTrailer = "moe-fenced";

}  // namespace moe

#endif  // MOE_RPC_GROUP_PROTOCOL_H_
