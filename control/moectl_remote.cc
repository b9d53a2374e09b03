#include "control/moectl_remote.h"

#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "rpc/placement_proto.h"
#include "control/rebalance.h"
#include "proto/moe/v1/control_plane.grpc.pb.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/placement/default_placement.h"
#include "runtime/status.h"
#include "rpc/grpc_status.h"

namespace moe {

namespace {

std::string StateName(v1::ReleaseState s) {
  return std::string(absl::StripPrefix(v1::ReleaseState_Name(s), "RELEASE_STATE_"));
}

absl::StatusOr<v1::ReleaseState> ParseState(const std::string& name) {
  v1::ReleaseState s;
  if (!v1::ReleaseState_Parse(absl::StrCat("RELEASE_STATE_", absl::AsciiStrToUpper(name)), &s) ||
      s == v1::RELEASE_STATE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat("STATE: unknown release state '", name, "'"));
  }
  return s;
}

std::string NewRequestId() {
  std::random_device rd;
  return absl::StrFormat("moectl-%08x%08x", rd(), rd());
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

void PrintReleases(const v1::ListReleasesResponse& list) {
  std::cout << absl::StrFormat("%-24s %-10s %8s  %s\n", "RELEASE", "STATE", "REVISION", "BUNDLE DIGEST");
  for (const v1::Release& r : list.releases()) {
    std::cout << absl::StrFormat("%-24s %-10s %8d  %s\n", r.release_id(), StateName(r.state()), r.revision(),
                                 r.bundle_digest());
  }
}

void PrintTransitions(const google::protobuf::RepeatedPtrField<v1::TransitionRecord>& ts) {
  std::cout << absl::StrFormat("%6s  %-24s %-10s    %-10s %-28s %s\n", "SEQ", "RELEASE", "FROM", "TO", "REQUEST",
                               "REASON");
  for (const v1::TransitionRecord& t : ts) {
    std::cout << absl::StrFormat("%6d  %-24s %-10s -> %-10s %-28s %s\n", t.seq(), t.release_id(), StateName(t.from()),
                                 StateName(t.to()), t.request_id(), t.reason());
  }
}

absl::StatusOr<v1::PromotionEvidence> ReadEvidence(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--evidence ", path, ": cannot read"));
  std::stringstream buf;
  buf << in.rdbuf();
  v1::PromotionEvidence e;
  auto s = google::protobuf::util::JsonStringToMessage(buf.str(), &e);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("--evidence ", path, ": ", s.ToString()));
  return e;
}

}  // namespace

bool IsRemoteCommand(const std::vector<std::string>& cmd) {
  if (cmd.empty()) return false;
  return cmd[0] == "releases" || cmd[0] == "release" || cmd[0] == "promote" || cmd[0] == "rollback" ||
         cmd[0] == "status" || cmd[0] == "watch" || cmd[0] == "drain" || cmd[0] == "rollout" || cmd[0] == "rebalance" || (cmd[0] == "placement" && cmd.size() >= 2 && cmd[1] == "load");
}

absl::Status RunRemote(const std::vector<std::string>& cmd, const RemoteOptions& o) {
  if (o.controller.empty()) return absl::InvalidArgumentError("--controller: required (host:port of moe-controller)");
  if (o.token_file.empty()) return absl::InvalidArgumentError("--token_file: required");
  std::ifstream tf(o.token_file);
  std::string token;
  if (!tf || !std::getline(tf, token)) {
    return absl::InvalidArgumentError(absl::StrCat("--token_file ", o.token_file, ": cannot read"));
  }
  token = std::string(absl::StripAsciiWhitespace(token));
  auto stub = v1::ControlPlaneService::NewStub(grpc::CreateChannel(o.controller, grpc::InsecureChannelCredentials()));
  auto context = [&] {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", "Bearer " + token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return ctx;
  };
  const std::string request_id = o.request_id.empty() ? NewRequestId() : o.request_id;
  auto usage = [](const char* what) { return absl::InvalidArgumentError(what); };

  if (cmd[0] == "watch" && cmd.size() <= 2) {
    if (o.after_seq < 0) return usage("--after: must be >= 0");
    v1::WatchRequest req;
    if (cmd.size() == 2) req.set_release_id(cmd[1]);
    req.set_after_seq(o.after_seq);
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token);
    if (o.timeout_s > 0) ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(o.timeout_s));
    auto reader = stub->Watch(&ctx, req);
    v1::TransitionRecord t;
    int seen = 0;
    if (!o.json) {
      std::cout << absl::StrFormat("%6s  %-24s %-10s    %-10s %-28s %s\n", "SEQ", "RELEASE", "FROM", "TO", "REQUEST",
                                   "REASON");
    }
    while ((o.count == 0 || seen < o.count) && reader->Read(&t)) {
      if (o.json) {
        std::string line;
        (void)google::protobuf::util::MessageToJsonString(t, &line);
        std::cout << line << "\n";
      } else {
        std::cout << absl::StrFormat("%6d  %-24s %-10s -> %-10s %-28s %s\n", t.seq(), t.release_id(),
                                     StateName(t.from()), StateName(t.to()), t.request_id(), t.reason());
      }
      std::cout.flush();
      ++seen;
    }
    if (o.count > 0 && seen == o.count) {
      ctx.TryCancel();
      reader->Finish().IgnoreError();
      return absl::OkStatus();
    }
    const absl::Status s = FromGrpcStatus(reader->Finish());
    // A --timeout_s that ends the watch is how scripts bound it, not an error.
    if (s.code() == absl::StatusCode::kDeadlineExceeded && o.timeout_s > 0 && o.count == 0) return absl::OkStatus();
    return s;
  }
  if (cmd[0] == "drain" && cmd.size() == 2) {
    // Stop new dispatch of a release that is not serving (DRAINING), wait until every rank has
    // no handle on its generation, then retire it. The ranks refuse the retirement while a
    // handle lives; the retirement is retried under one request id until they accept.
    const std::string& release = cmd[1];
    const std::string reason = o.reason.empty() ? "operator drain" : o.reason;
    v1::GetReleaseRequest get;
    get.set_release_id(release);
    v1::Release rel;
    {
      auto ctx = context();
      if (auto s = FromGrpcStatus(stub->GetRelease(ctx.get(), get, &rel)); !s.ok()) return s;
    }
    if (rel.state() == v1::RELEASE_STATE_RETIRED) {
      std::cout << release << " is already RETIRED\n";
      return absl::OkStatus();
    }
    if (rel.state() == v1::RELEASE_STATE_ACTIVE) {
      return absl::FailedPreconditionError(absl::StrCat("drain ", release, ": it is ACTIVE (serving); leave ACTIVE through ",
                                                        "promote of another release or rollback"));
    }
    if (rel.state() != v1::RELEASE_STATE_DRAINING) {
      v1::TransitionReleaseRequest req;
      req.set_request_id(request_id);
      req.set_release_id(release);
      req.set_to(v1::RELEASE_STATE_DRAINING);
      req.set_reason(reason);
      v1::TransitionRecord rec;
      auto ctx = context();
      if (auto s = FromGrpcStatus(stub->TransitionRelease(ctx.get(), req, &rec)); !s.ok()) return s;
      std::cout << absl::StrFormat("%6d  %s %s -> %s\n", rec.seq(), release, StateName(rec.from()), StateName(rec.to()));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(o.timeout_s > 0 ? o.timeout_s : 60);
    absl::Status last;
    while (true) {
      v1::TransitionReleaseRequest req;
      req.set_request_id(request_id + "/retire");
      req.set_release_id(release);
      req.set_to(v1::RELEASE_STATE_RETIRED);
      req.set_reason(absl::StrCat(reason, ": handles drained"));
      v1::TransitionRecord rec;
      auto ctx = context();
      last = FromGrpcStatus(stub->TransitionRelease(ctx.get(), req, &rec));
      if (last.ok()) {
        std::cout << absl::StrFormat("%6d  %s %s -> %s\n", rec.seq(), release, StateName(rec.from()),
                                     StateName(rec.to()));
        return absl::OkStatus();
      }
      if (last.code() != absl::StatusCode::kFailedPrecondition || absl::Now() > deadline) break;
      absl::SleepFor(absl::Milliseconds(200));
    }
    return absl::Status(last.code(), absl::StrCat("drain ", release, ": not retired: ", last.message()));
  }
  if (cmd[0] == "rollout" && cmd.size() == 2) {
    // The whole walk of one release, resumable: each step has a request id derived from one base
    // (the release id unless --request_id), so running it again after any failure continues where
    // the registry says the release is. Trials wait for the ranks' counters.
    const std::string& id = cmd[1];
    if (o.manifest.empty()) return usage("--manifest: required (the release's PlacementManifest JSON)");
    const std::string base = o.request_id.empty() ? absl::StrCat("rollout-", id) : o.request_id;
    RemoteOptions step = o;
    step.json = false;
    auto run = [&](std::vector<std::string> c, const char* suffix) {
      step.request_id = absl::StrCat(base, ":", suffix);
      return RunRemote(c, step);
    };
    auto state_of = [&]() -> absl::StatusOr<v1::Release> {
      v1::GetReleaseRequest get;
      get.set_release_id(id);
      v1::Release rel;
      auto ctx = context();
      if (auto s = FromGrpcStatus(stub->GetRelease(ctx.get(), get, &rel)); !s.ok()) return s;
      return rel;
    };
    // The smallest count over the ranks of shadow samples / canary steps of `version`.
    auto trial_count = [&](int64_t version, bool canary) -> absl::StatusOr<int64_t> {
      v1::ClusterStatusResponse resp;
      auto ctx = context();
      if (auto s = FromGrpcStatus(stub->ClusterStatus(ctx.get(), {}, &resp)); !s.ok()) return s;
      int64_t least = -1;
      for (const v1::RankAgentReport& rep : resp.ranks()) {
        if (!rep.error().empty()) return absl::UnavailableError(absl::StrCat("rank ", rep.address(), ": ", rep.error()));
        int64_t n = 0;
        for (const v1::GenerationCounters& c : rep.status().counters()) {
          if (c.version() == version) n = canary ? c.canary_steps() : c.shadow_samples();
        }
        least = least < 0 ? n : std::min(least, n);
      }
      return std::max<int64_t>(least, 0);
    };
    const absl::Time deadline = absl::Now() + absl::Seconds(o.timeout_s > 0 ? o.timeout_s : 600);
    auto await = [&](int64_t version, bool canary, int64_t want) -> absl::Status {
      int64_t last = -1;
      while (true) {
        ASSIGN_OR_RETURN(int64_t n, trial_count(version, canary));
        if (n != last) {
          std::cout << absl::StrFormat("  %s of placement-v%d: %d / %d\n", canary ? "canary steps" : "shadow samples",
                                       version, n, want);
          std::cout.flush();
          last = n;
        }
        if (n >= want) return absl::OkStatus();
        if (absl::Now() > deadline) {
          return absl::DeadlineExceededError(absl::StrCat("rollout ", id, ": ", n, " of ", want,
                                                          canary ? " canary steps" : " shadow samples",
                                                          " before --timeout_s (is the engine sending steps?)"));
        }
        absl::SleepFor(absl::Milliseconds(250));
      }
    };
    auto rel = state_of();
    if (rel.status().code() == absl::StatusCode::kNotFound) {
      if (o.digest.empty()) return usage("--digest: required to register a new release");
      RETURN_IF_ERROR(run({"release", "register", id}, "register"));
      rel = state_of();
    }
    for (int guard = 0; rel.ok() && rel->state() != v1::RELEASE_STATE_ACTIVE && guard < 8; ++guard) {
      switch (rel->state()) {
        case v1::RELEASE_STATE_BUILT:
          step.reason = "rollout: bundle digests checked";
          RETURN_IF_ERROR(run({"release", "transition", id, "VERIFIED"}, "verify"));
          break;
        case v1::RELEASE_STATE_VERIFIED:
          RETURN_IF_ERROR(run({"placement", "load", id}, "load"));
          break;
        case v1::RELEASE_STATE_LOADED:
          step.reason = "rollout: shadow beside the active placement";
          RETURN_IF_ERROR(run({"release", "transition", id, "SHADOW"}, "shadow"));
          break;
        case v1::RELEASE_STATE_SHADOW: {
          RETURN_IF_ERROR(await(rel->placement_version(), false, o.min_shadow));
          step.reason = "rollout: canary";
          const absl::Status canary = run({"release", "transition", id, "CANARY"}, "canary");
          if (canary.code() == absl::StatusCode::kFailedPrecondition) {
            // The controller blocks a candidate whose shadow outputs differ (runner parity) and
            // drains it: say so plainly, the rollout is over for this release.
            auto now = state_of();
            if (now.ok() && now->state() == v1::RELEASE_STATE_DRAINING) {
              std::cout << "  BLOCKED at SHADOW -> CANARY: " << id << " is DRAINING; it served no canary step\n";
              return absl::FailedPreconditionError(
                  absl::StrCat("rollout ", id, ": blocked at SHADOW -> CANARY and drained: ", canary.message()));
            }
          }
          RETURN_IF_ERROR(canary);
          break;
        }
        case v1::RELEASE_STATE_CANARY:
          RETURN_IF_ERROR(await(rel->placement_version(), true, o.min_canary));
          RETURN_IF_ERROR(run({"promote", id}, "promote"));
          break;
        default:
          return absl::FailedPreconditionError(absl::StrCat("rollout ", id, ": the release is ", StateName(rel->state()),
                                                            "; only BUILT .. CANARY releases roll out"));
      }
      rel = state_of();
    }
    return rel.status();
  }
  if (cmd[0] == "releases" && cmd.size() == 2 && cmd[1] == "list") {
    v1::ListReleasesResponse resp;
    auto ctx = context();
    if (auto s = FromGrpcStatus(stub->ListReleases(ctx.get(), {}, &resp)); !s.ok()) return s;
    if (o.json) {
      std::cout << Json(resp) << "\n";
    } else {
      PrintReleases(resp);
    }
    return absl::OkStatus();
  }
  if (cmd[0] == "releases" && cmd.size() == 3 && cmd[1] == "show") {
    v1::GetReleaseRequest get;
    get.set_release_id(cmd[2]);
    v1::Release rel;
    auto ctx = context();
    if (auto s = FromGrpcStatus(stub->GetRelease(ctx.get(), get, &rel)); !s.ok()) return s;
    v1::HistoryRequest hreq;
    hreq.set_release_id(cmd[2]);
    v1::HistoryResponse hist;
    auto ctx2 = context();
    if (auto s = FromGrpcStatus(stub->History(ctx2.get(), hreq, &hist)); !s.ok()) return s;
    if (o.json) {
      std::cout << "{\"release\": " << Json(rel) << ", \"history\": " << Json(hist) << "}\n";
    } else {
      v1::ListReleasesResponse one;
      *one.add_releases() = rel;
      PrintReleases(one);
      std::cout << "\n";
      PrintTransitions(hist.transitions());
    }
    return absl::OkStatus();
  }
  if (cmd[0] == "release" && cmd.size() == 3 && cmd[1] == "register") {
    v1::RegisterReleaseRequest req;
    req.set_request_id(request_id);
    req.set_release_id(cmd[2]);
    req.set_bundle_digest(o.digest);
    v1::Release rel;
    auto ctx = context();
    if (auto s = FromGrpcStatus(stub->RegisterRelease(ctx.get(), req, &rel)); !s.ok()) return s;
    std::cout << (o.json ? Json(rel) : absl::StrCat(rel.release_id(), " ", StateName(rel.state()))) << "\n";
    return absl::OkStatus();
  }
  if (cmd[0] == "release" && cmd.size() == 4 && cmd[1] == "transition") {
    auto to = ParseState(cmd[3]);
    if (!to.ok()) return to.status();
    v1::TransitionReleaseRequest req;
    req.set_request_id(request_id);
    req.set_release_id(cmd[2]);
    req.set_to(*to);
    req.set_reason(o.reason);
    v1::TransitionRecord rec;
    auto ctx = context();
    if (auto s = FromGrpcStatus(stub->TransitionRelease(ctx.get(), req, &rec)); !s.ok()) return s;
    if (o.json) {
      std::cout << Json(rec) << "\n";
    } else {
      std::cout << rec.release_id() << " " << StateName(rec.from()) << " -> " << StateName(rec.to()) << " (seq "
                << rec.seq() << ", request " << rec.request_id() << ")\n";
    }
    return absl::OkStatus();
  }
  if (cmd[0] == "promote" && cmd.size() == 2) {
    v1::PromoteRequest req;
    req.set_request_id(request_id);
    req.set_release_id(cmd[1]);
    if (!o.evidence.empty()) {  // otherwise the controller reads the ranks' counters
      auto evidence = ReadEvidence(o.evidence);
      if (!evidence.ok()) return evidence.status();
      *req.mutable_evidence() = *evidence;
    }
    v1::PromoteResponse resp;
    auto ctx = context();
    if (auto s = FromGrpcStatus(stub->Promote(ctx.get(), req, &resp)); !s.ok()) return s;
    if (o.json) {
      std::cout << Json(resp) << "\n";
    } else {
      std::cout << resp.release().release_id() << " " << StateName(resp.release().state());
      if (!resp.drained_release_id().empty()) std::cout << "; " << resp.drained_release_id() << " DRAINING";
      if (o.evidence.empty()) {
        const v1::PromotionEvidence& e = resp.evidence();
        std::cout << absl::StrFormat(" (ranks: %d shadow samples, %d mismatches, %d canary steps, drop %.4f, "
                                     "fallback %.3f, %d failures)",
                                     e.shadow_samples(), e.route_mismatches(), e.canary_samples(),
                                     e.routes_attempted() ? static_cast<double>(e.routes_dropped()) / e.routes_attempted() : 0.0,
                                     e.steps() ? static_cast<double>(e.fallback_steps()) / e.steps() : 0.0,
                                     e.count_failures());
      }
      std::cout << "\n";
    }
    return absl::OkStatus();
  }
  if (cmd[0] == "rollback" && cmd.size() == 2) {
    v1::RollbackRequest req;
    req.set_request_id(request_id);
    req.set_release_id(cmd[1]);
    req.set_prior_release_id(o.prior);
    req.set_reason(o.reason);
    v1::RollbackResponse resp;
    auto ctx = context();
    if (auto s = FromGrpcStatus(stub->Rollback(ctx.get(), req, &resp)); !s.ok()) return s;
    if (o.json) {
      std::cout << Json(resp) << "\n";
    } else {
      PrintTransitions(resp.transitions());
    }
    return absl::OkStatus();
  }
  if (cmd[0] == "placement" && cmd.size() == 3 && cmd[1] == "load") {
    if (o.manifest.empty()) return absl::InvalidArgumentError("--manifest: required (PlacementManifest JSON)");
    std::ifstream in(o.manifest);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("--manifest ", o.manifest, ": cannot read"));
    std::stringstream buf;
    buf << in.rdbuf();
    v1::LoadPlacementRequest req;
    req.set_request_id(request_id);
    req.set_release_id(cmd[2]);
    if (auto s = google::protobuf::util::JsonStringToMessage(buf.str(), req.mutable_manifest()); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--manifest ", o.manifest, ": ", s.ToString()));
    }
    v1::Release rel;
    auto ctx = context();
    if (auto s = FromGrpcStatus(stub->LoadPlacement(ctx.get(), req, &rel)); !s.ok()) return s;
    std::cout << (o.json ? Json(rel)
                         : absl::StrCat(rel.release_id(), " ", StateName(rel.state()), " placement-v",
                                        rel.placement_version()))
              << "\n";
    return absl::OkStatus();
  }
  if (cmd[0] == "rebalance" && cmd.size() == 1) {
    if (!o.dry_run) return absl::InvalidArgumentError("--dry_run: required (rebalance only plans; load the plan with placement load)");
    v1::ClusterStatusResponse resp;
    auto ctx = context();
    if (auto s = FromGrpcStatus(stub->ClusterStatus(ctx.get(), {}, &resp)); !s.ok()) return s;
    RebalanceInput in;
    in.num_replicas = o.num_replicas;
    in.num_groups = o.num_groups;
    in.num_nodes = o.num_nodes;
    for (const v1::RankAgentReport& rep : resp.ranks()) {
      if (!rep.error().empty()) return absl::UnavailableError(absl::StrCat("rank ", rep.address(), ": ", rep.error()));
      const auto& routes = rep.status().expert_routes();
      if (in.expert_load.size() < static_cast<size_t>(routes.size())) in.expert_load.resize(routes.size(), 0);
      for (int e = 0; e < routes.size(); ++e) in.expert_load[e] += routes[e];
      in.current_slot_experts.emplace_back(rep.status().active_slot_experts().begin(),
                                           rep.status().active_slot_experts().end());
    }
    auto plan = PlanRebalance(in);
    if (!plan.ok()) return plan.status();
    std::cout << absl::StrFormat("EPLB over the load of %d ranks: %d physical slots\n", resp.ranks_size(),
                                 plan->num_replicas);
    std::cout << absl::StrFormat("%-8s %12s %8s %8s\n", "EXPERT", "ROUTES", "COPIES", "AFTER");
    for (size_t e = 0; e < in.expert_load.size(); ++e) {
      std::cout << absl::StrFormat("%-8d %12d %8d %8d\n", e, in.expert_load[e], plan->copies_before[e],
                                   plan->copies_after[e]);
    }
    std::cout << absl::StrFormat("%-8s %14s %14s\n", "RANK", "LOAD BEFORE", "LOAD AFTER");
    for (size_t r = 0; r < plan->rank_load_before.size(); ++r) {
      std::cout << absl::StrFormat("%-8d %14.1f %14.1f\n", r, plan->rank_load_before[r], plan->rank_load_after[r]);
    }
    std::cout << absl::StrFormat("balancedness (mean/max rank load): before %.3f, after %.3f\n",
                                 plan->balancedness_before, plan->balancedness_after);
    if (!o.out.empty()) {
      auto ckpt = ReadSafetensors(o.checkpoint);
      if (!ckpt.ok()) return absl::InvalidArgumentError(absl::StrCat("--checkpoint: ", ckpt.status().message()));
      const int world = resp.ranks_size();
      const Topology topology = TwoNodeTopology(world);
      const ProcessGroup group = LocalClusterGroup(world, o.epoch);
      auto m = PlacementFromAssignment(PlacementVersion(o.placement_version), static_cast<int>(in.expert_load.size()),
                                       plan->expert_rank, topology, group, ckpt->metadata);
      if (!m.ok()) return m.status();
      std::ofstream(o.out) << Json(ManifestToProto(**m, topology));
      std::cout << "wrote placement-v" << o.placement_version << " to " << o.out << "\n";
    }
    return absl::OkStatus();
  }
  if (cmd[0] == "status" && cmd.size() == 1) {
    v1::ClusterStatusResponse resp;
    auto ctx = context();
    if (auto s = FromGrpcStatus(stub->ClusterStatus(ctx.get(), {}, &resp)); !s.ok()) return s;
    if (o.json) {
      std::cout << Json(resp) << "\n";
      return absl::OkStatus();
    }
    std::cout << absl::StrFormat("%-4s %-22s %-7s %s\n", "RANK", "ADDRESS", "ACTIVE", "GENERATIONS (state/handles)");
    for (int r = 0; r < resp.ranks_size(); ++r) {
      const v1::RankAgentReport& rep = resp.ranks(r);
      std::string gens;
      for (const v1::GenerationStatus& g : rep.status().generations()) {
        absl::StrAppend(&gens, gens.empty() ? "" : "  ", "v", g.version(), " ",
                        absl::StripPrefix(v1::GenerationState_Name(g.state()), "GENERATION_STATE_"), "/", g.refcount());
        if (g.state() != v1::GENERATION_STATE_RETIRED && g.retained() + g.duplicated() + g.copied() + g.loaded() > 0) {
          // How the rank materialized the slots: retained / duplicated / copied from peers / loaded.
          absl::StrAppend(&gens, " (r", g.retained(), " d", g.duplicated(), " c", g.copied(), " l", g.loaded(), ")");
        }
      }
      const v1::TrialRequest& trial = rep.status().trial();
      if (trial.version() > 0) {
        v1::GenerationCounters c;
        for (const v1::GenerationCounters& x : rep.status().counters()) {
          if (x.version() == trial.version()) c = x;
        }
        absl::StrAppend(&gens, "  | trial v", trial.version(), ": shadow every ", trial.shadow_every(), " (",
                        c.shadow_samples(), " run, ", c.shadow_mismatches(), " mismatched), canary every ",
                        trial.canary_every(), " (", c.canary_steps(), " served)");
      }
      std::cout << absl::StrFormat("%-4d %-22s %-7s %s\n", r, rep.address(),
                                   rep.error().empty() ? absl::StrCat("v", rep.status().active_version()) : "-",
                                   rep.error().empty() ? gens : "unreachable: " + rep.error());
    }
    return absl::OkStatus();
  }
  return usage("command: expected releases list | releases show ID | release register ID | "
               "release transition ID STATE | placement load ID | promote ID | rollback ID | status | rebalance");
}

}  // namespace moe
