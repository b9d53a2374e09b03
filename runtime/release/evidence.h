// The promotion gate's inputs as the ranks observed them (spec 0x0DC, 0x0D denominators). The
// controller turns every rank agent's status into a RankReport (proto types stay at its edge) and
// aggregates them here, so that each clause is computed from evidence that can fail:
//
//   HashOK      every rank holds the candidate PREPARED under a manifest whose digest equals the
//               digest the controller computed itself over the manifest it recorded for the
//               release (the ranks checked every slot's parameter digest against those slots);
//   ManifestOK  every rank holds the candidate PREPARED;
//   FaultsOK    no failed candidate step and no failed shadow pass on any rank;
//   RollbackOK  the prior ACTIVE release's generation is re-activatable on every rank (ACTIVE,
//               PREPARED or DRAINING: not RETIRED, weights in memory);
//   counts      shadow samples and canary steps as the group ran them (the smallest per-rank
//               count: each is a collective step every rank counts); routes, steps (all steps,
//               r_fallback's denominator), fallback steps, shadow mismatches, stale accepts and
//               failures summed over the ranks.
//
// Pure functions; thread-compatible.
#ifndef MOE_RUNTIME_RELEASE_EVIDENCE_H_
#define MOE_RUNTIME_RELEASE_EVIDENCE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/placement/registry.h"
#include "runtime/release/generation_counters.h"
#include "runtime/release/lifecycle.h"

namespace moe {

struct RankReport {
  std::string name;                                // names the rank in findings, e.g. "rank 2 (127.0.0.1:4417)"
  std::optional<GenerationState> candidate_state;  // nullopt: the rank does not hold the candidate
  std::string candidate_digest;                    // the manifest digest the rank reports for it (empty: none)
  std::optional<GenerationState> prior_state;      // the prior release's generation here (nullopt: not held)
  GenerationCounters counters;                     // of the candidate's generation since the rank started
};

struct EvidenceExpectation {
  int64_t candidate_version = 0;
  // The digest the controller computed over the manifest it recorded for the candidate; empty
  // when there is none to compute (then `manifest_problem` says why, and HashOK is false).
  std::string manifest_digest;
  std::string manifest_problem;
  // The placement generation of the release that is ACTIVE now (the one a rollback re-activates);
  // 0 when there is none (then `prior_problem` says why, and RollbackOK is false).
  int64_t prior_version = 0;
  std::string prior_problem;
};

struct GateEvidence {
  PromotionInputs inputs;
  std::vector<std::string> findings;  // why a non-count clause is false, one line each
};

GateEvidence AggregateRankEvidence(const std::vector<RankReport>& ranks, const EvidenceExpectation& expect);

}  // namespace moe

#endif  // MOE_RUNTIME_RELEASE_EVIDENCE_H_
