// The semantic handoff: accepted route rows as the router produced them (spec 0x01A0, 0x03A).
//
// Route r carries I_r = (s, r, p, t, j, e, g): execution scope, route id (its index here),
// origin partition (source rank), origin token row, route slot in [0, k), logical expert and
// combine gate, plus the router's admission state. The runtime never recomputes or edits these
// fields. Freeze() seals them (a fingerprint over every field, verified before planning, so a
// mutated logical expert or gate fails before any physical decision is made); their canonical
// SHA-256 digest, the handoff's identity, is FrozenHandoff::Digest().
//
// Storage is columnar (one vector per field), never one heap object per route.
#ifndef MOE_RUNTIME_SEMANTIC_H_
#define MOE_RUNTIME_SEMANTIC_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

#include "runtime/ids.h"

namespace moe {

struct SemanticHandoff {
  std::string contract_version = "moe.semantic.v1";
  ExecutionScopeId scope;
  int32_t num_experts = 0;
  int32_t top_k = 0;
  int32_t num_partitions = 0;  // source ranks of the group (members, even with zero tokens)

  std::vector<Rank> origin;             // p
  std::vector<int32_t> token;           // t, row inside the origin partition
  std::vector<int32_t> route_slot;      // j in [0, k)
  std::vector<LogicalExpertId> expert;  // e
  std::vector<float> gate;              // g, FP32
  std::vector<uint8_t> admitted;        // 1 = accepted by the router, 0 = dropped

  int32_t size() const { return static_cast<int32_t>(origin.size()); }
  void Reserve(size_t n);
  void Add(Rank p, int32_t t, int32_t j, LogicalExpertId e, float g, bool admitted_route = true);
  // Column lengths agree; ranks, tokens, route slots and experts in range; gates finite and
  // non-negative; (p, t, j) unique. INVALID_ARGUMENT naming the field otherwise.
  absl::Status Validate() const;
};

using Sha256 = std::array<uint8_t, 32>;
std::string HexDigest(const Sha256& digest);

// SHA-256 over the canonical encoding: the contract version (length-prefixed), scope, expert
// count, top-k and partitions as 64-bit little-endian words, then the columns in a fixed order,
// each as its name (length-prefixed), its length (64-bit) and its values little-endian at their
// width: origin, token, route_slot, logical_expert as 32-bit integers, gate as its IEEE-754 bits,
// admitted as one byte. (The columns are hashed in place: 21 bytes a route.)
Sha256 SemanticDigest(const SemanticHandoff& handoff);

// A sealed handoff. Not thread-safe (a step's own object).
struct FrozenHandoff {
  SemanticHandoff routes;
  uint64_t fingerprint = 0;  // SemanticFingerprint at freeze: what VerifyFrozen compares

  // The canonical SHA-256 (the handoff's identity across processes: traces, audit records),
  // computed on first use from the sealed routes after VerifyFrozen, so it is the digest of what
  // was frozen; FAILED_PRECONDITION when they have been mutated. Serving a step never needs it
  // (ranks agree on the step's header and counts, not on this digest), so the hot path does not
  // pay SHA-256 over 21 bytes a route: ~0.24 ms at 16384 routes.
  absl::StatusOr<Sha256> Digest() const;

 private:
  mutable bool has_digest_ = false;
  mutable Sha256 digest_{};
};

// A fast 64-bit fingerprint over the same fields as SemanticDigest (every scalar, every column
// with its length), four independent multiply-xorshift lanes over 8-byte words (~20x cheaper
// than SHA-256). It detects changes to a frozen handoff in this process's memory; it is not an
// identity across processes (the digest is).
uint64_t SemanticFingerprint(const SemanticHandoff& h);

// Validates and seals a handoff.
absl::StatusOr<FrozenHandoff> Freeze(SemanticHandoff handoff);
// FAILED_PRECONDITION when the routes no longer match what was sealed (their fingerprint:
// SHA-256 here cost a 2048-token step ~0.2 ms of host time on the H200 machine).
absl::Status VerifyFrozen(const FrozenHandoff& frozen);

}  // namespace moe

#endif  // MOE_RUNTIME_SEMANTIC_H_
