// Synthetic expert checkpoints: deterministic BF16 SwiGLU weights per logical expert (every
// replica of an expert is bit-identical), written as safetensors with a SHA-256 digest per
// expert in the metadata, and loaded per rank in the manifest's local slot order.
#ifndef MOE_RUNTIME_CHECKPOINT_SYNTHETIC_H_
#define MOE_RUNTIME_CHECKPOINT_SYNTHETIC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/checkpoint/expert_checkpoint.h"
#include "runtime/checkpoint/expert_loader.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/exec/layer_executor.h"
#include "runtime/placement/manifest.h"

namespace moe {

// w_gate_up [2 d_ff, d] and w_down [d, d_ff] of one logical expert (BF16 bits).
void SyntheticExpert(int expert, const ExpertShape& shape, uint64_t seed, std::vector<uint16_t>* w_gate_up,
                     std::vector<uint16_t>* w_down);

// The layout of runtime/checkpoint/expert_checkpoint.h: both tensors of every expert, its
// digest, the version and the shape.
SafetensorsFile SyntheticCheckpoint(const ExpertShape& shape, uint64_t seed, const std::string& checkpoint_version);

// Hex SHA-256 of an expert's two tensors (what "digest.<e>" holds).
std::string ExpertDigest(const std::vector<uint16_t>& w_gate_up, const std::vector<uint16_t>& w_down);

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_SYNTHETIC_H_
