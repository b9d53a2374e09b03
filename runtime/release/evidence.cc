#include "runtime/release/evidence.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moe {

namespace {

std::string StateOf(const std::optional<GenerationState>& s) {
  return s.has_value() ? GenerationStateName(*s) : "not held";
}

}  // namespace

GateEvidence AggregateRankEvidence(const std::vector<RankReport>& ranks, const EvidenceExpectation& expect) {
  GateEvidence out;
  PromotionInputs& in = out.inputs;
  const std::string candidate = absl::StrCat("placement-v", expect.candidate_version);
  if (ranks.empty()) {
    out.findings.push_back("no rank reported");
    return out;  // every clause false
  }
  bool prepared = true, hashes = !expect.manifest_digest.empty(), rollback = expect.prior_version > 0;
  if (expect.manifest_digest.empty()) {
    out.findings.push_back(absl::StrCat("HashOK: no recorded manifest digest to check the ranks against",
                                        expect.manifest_problem.empty() ? "" : ": ", expect.manifest_problem));
  }
  if (expect.prior_version <= 0) {
    out.findings.push_back(absl::StrCat("RollbackOK: no prior placement to roll back to",
                                        expect.prior_problem.empty() ? "" : ": ", expect.prior_problem));
  }
  int64_t shadow = -1, canary = -1;
  int64_t faults = 0;  // failed candidate steps and shadow passes (FaultsOK)
  for (const RankReport& r : ranks) {
    const GenerationCounters& c = r.counters;
    // Shadow passes and canary steps are collective: every rank counts each one, so the group
    // ran the smallest count. The rest adds up over the ranks.
    shadow = shadow < 0 ? c.shadow_samples : std::min(shadow, c.shadow_samples);
    canary = canary < 0 ? c.canary_steps : std::min(canary, c.canary_steps);
    in.routes_attempted += c.routes_attempted;
    in.routes_dropped += c.routes_dropped;
    in.steps += c.steps;  // 0x0D: r_fallback = fallback steps / ALL steps, not decode steps
    in.fallback_steps += c.fallback_steps;
    in.route_mismatches += c.shadow_mismatches;
    in.stale_accepts += c.stale_accepts;
    faults += c.shadow_failures + c.failed_steps;
    in.count_failures += c.count_failures;
    if (c.count_failures > 0) {
      out.findings.push_back(absl::StrCat("N_count_failure: ", r.name, ": ", c.count_failures,
                                          " steps whose route counts did not conserve on ", candidate));
    }
    if (c.shadow_failures + c.failed_steps > 0) {
      out.findings.push_back(absl::StrCat("FaultsOK: ", r.name, ": ", c.failed_steps, " failed steps and ",
                                          c.shadow_failures, " failed shadow passes on ", candidate));
    }

    const bool is_prepared = r.candidate_state == GenerationState::kPrepared;
    if (!is_prepared) {
      out.findings.push_back(
          absl::StrCat("ManifestOK: ", r.name, ": ", candidate, " is ", StateOf(r.candidate_state), ", not PREPARED"));
    }
    prepared = prepared && is_prepared;
    if (!expect.manifest_digest.empty()) {
      if (r.candidate_digest.empty()) {
        hashes = false;
        out.findings.push_back(absl::StrCat("HashOK: ", r.name, " reports no manifest digest for ", candidate));
      } else if (r.candidate_digest != expect.manifest_digest) {
        hashes = false;
        out.findings.push_back(absl::StrCat("HashOK: ", r.name, " holds ", candidate, " under manifest digest ",
                                            r.candidate_digest, ", the recorded manifest's is ",
                                            expect.manifest_digest));
      }
      hashes = hashes && is_prepared;
    }
    if (expect.prior_version > 0) {
      const bool loaded = r.prior_state == GenerationState::kActive || r.prior_state == GenerationState::kPrepared ||
                          r.prior_state == GenerationState::kDraining;
      if (!loaded) {
        out.findings.push_back(absl::StrCat("RollbackOK: ", r.name, ": prior placement-v", expect.prior_version, " is ",
                                            StateOf(r.prior_state), ", not re-activatable"));
      }
      rollback = rollback && loaded;
    }
  }
  in.shadow_samples = std::max<int64_t>(shadow, 0);
  in.canary_samples = std::max<int64_t>(canary, 0);
  in.hash_ok = hashes;
  in.manifest_ok = prepared;
  in.faults_ok = faults == 0;
  in.rollback_ok = rollback;
  return out;
}

}  // namespace moe
