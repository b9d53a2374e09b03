#include "control/moectl_remote.h"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

#include "control/json_util.h"
#include "control/rebalance.h"
#include "proto/moe/v1/control_plane.grpc.pb.h"
#include "proto/moe/v1/process_group.grpc.pb.h"
#include "rpc/grpc_status.h"
#include "rpc/placement_proto.h"
#include "runtime/checkpoint/checkpoint_reader.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/placement/default_placement.h"
#include "runtime/status.h"

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

// What every subcommand shares: the parsed command, the options, a stub on the controller, the
// bearer token and this invocation's request id.
struct RemoteCall {
  const std::vector<std::string>& cmd;
  const RemoteOptions& o;
  std::unique_ptr<v1::ControlPlaneService::Stub> stub;
  std::string token;
  std::string request_id;

  // A context for one unary RPC: the bearer token and the deadline: --timeout, else 10 s for a
  // quick call and 600 s for a long one (a placement load, a promotion, a rollback).
  std::unique_ptr<grpc::ClientContext> Context(bool long_op = false) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", "Bearer " + token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(Timeout(long_op)));
    return ctx;
  }
  int Timeout(bool long_op) const { return o.rpc_timeout_s > 0 ? o.rpc_timeout_s : (long_op ? 600 : 10); }
};

// Runs `rpc` (a long unary call) while a thread prints a progress line on stderr every 5 s: what
// is being waited for, for how long, and the deadline.
template <typename Rpc>
grpc::Status WithProgress(const RemoteCall& call, const std::string& what, Rpc&& rpc) {
  absl::Notification done;
  const absl::Time start = absl::Now();
  const int timeout = call.Timeout(true);
  std::thread ticker([&] {
    while (!done.WaitForNotificationWithTimeout(absl::Seconds(5))) {
      std::fprintf(stderr, "moectl: %s: waiting, %.0f s of at most %d s (--timeout)\n", what.c_str(),
                   absl::ToDoubleSeconds(absl::Now() - start), timeout);
    }
  });
  grpc::Status s = rpc();
  done.Notify();
  ticker.join();
  return s;
}

absl::StatusOr<v1::Release> GetRelease(const RemoteCall& call, const std::string& release) {
  v1::GetReleaseRequest get;
  get.set_release_id(release);
  v1::Release rel;
  auto ctx = call.Context();
  if (auto s = FromGrpcStatus(call.stub->GetRelease(ctx.get(), get, &rel)); !s.ok()) return s;
  return rel;
}

absl::StatusOr<v1::ClusterStatusResponse> GetClusterStatus(const RemoteCall& call) {
  v1::ClusterStatusResponse resp;
  auto ctx = call.Context();
  if (auto s = FromGrpcStatus(call.stub->ClusterStatus(ctx.get(), {}, &resp)); !s.ok()) return s;
  return resp;
}

// `watch [ID]`: transitions as they commit, until --count of them or --timeout_s.
absl::Status RunWatch(const RemoteCall& call) {
  const RemoteOptions& o = call.o;
  if (o.after_seq < 0) return absl::InvalidArgumentError("--after: must be >= 0");
  if (o.count < 0) return absl::InvalidArgumentError("--count: must be >= 0 (0: until --timeout_s or Ctrl-C)");
  if (o.timeout_s < 0) return absl::InvalidArgumentError("--timeout_s: must be >= 0");
  v1::WatchRequest req;
  if (call.cmd.size() == 2) req.set_release_id(call.cmd[1]);
  req.set_after_seq(o.after_seq);
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer " + call.token);
  if (o.timeout_s > 0) ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(o.timeout_s));
  auto reader = call.stub->Watch(&ctx, req);
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
      std::cout << absl::StrFormat("%6d  %-24s %-10s -> %-10s %-28s %s\n", t.seq(), t.release_id(), StateName(t.from()),
                                   StateName(t.to()), t.request_id(), t.reason());
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

// One TransitionRelease of `release` to `to`, printed as a drain line.
absl::Status DrainTransition(const RemoteCall& call, const std::string& request_id, const std::string& release,
                             v1::ReleaseState to, const std::string& reason) {
  v1::TransitionReleaseRequest req;
  req.set_request_id(request_id);
  req.set_release_id(release);
  req.set_to(to);
  req.set_reason(reason);
  v1::TransitionRecord rec;
  auto ctx = call.Context();
  if (auto s = FromGrpcStatus(call.stub->TransitionRelease(ctx.get(), req, &rec)); !s.ok()) return s;
  std::cout << absl::StrFormat("%6d  %s %s -> %s\n", rec.seq(), release, StateName(rec.from()), StateName(rec.to()));
  return absl::OkStatus();
}

// `drain ID`: stop new dispatch of a release that is not serving (DRAINING), wait until every
// rank has no handle on its generation, then retire it. The ranks refuse the retirement while a
// handle lives; the retirement is retried under one request id until they accept.
absl::Status RunDrain(const RemoteCall& call) {
  const RemoteOptions& o = call.o;
  const std::string& release = call.cmd[1];
  const std::string reason = o.reason.empty() ? "operator drain" : o.reason;
  ASSIGN_OR_RETURN(const v1::Release rel, GetRelease(call, release));
  if (rel.state() == v1::RELEASE_STATE_RETIRED) {
    std::cout << release << " is already RETIRED\n";
    return absl::OkStatus();
  }
  if (rel.state() == v1::RELEASE_STATE_ACTIVE) {
    return absl::FailedPreconditionError(absl::StrCat("drain ", release,
                                                      ": it is ACTIVE (serving); leave ACTIVE through ",
                                                      "promote of another release or rollback"));
  }
  if (rel.state() == v1::RELEASE_STATE_SHADOW || rel.state() == v1::RELEASE_STATE_CANARY) {
    RETURN_IF_ERROR(DrainTransition(call, call.request_id, release, v1::RELEASE_STATE_DRAINING, reason));
  }  // BUILT, VERIFIED and LOADED never served: they go to RETIRED at once
  const absl::Time deadline = absl::Now() + absl::Seconds(o.timeout_s > 0 ? o.timeout_s : 60);
  absl::Status last;
  while (true) {
    last = DrainTransition(call, call.request_id + "/retire", release, v1::RELEASE_STATE_RETIRED,
                           absl::StrCat(reason, ": handles drained"));
    if (last.ok()) return absl::OkStatus();
    if (last.code() != absl::StatusCode::kFailedPrecondition || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  return absl::Status(last.code(), absl::StrCat("drain ", release, ": not retired: ", last.message()));
}

// What `rollout` carries from step to step.
struct Rollout {
  const RemoteCall& call;
  const std::string& id;
  std::string base;    // every step's request id is <base>:<step>
  RemoteOptions step;  // the options each step runs with (tables, never --json)
  absl::Time deadline;

  // One step as its own subcommand, under the request id derived from `suffix`.
  absl::Status Run(const std::vector<std::string>& c, const char* suffix) {
    step.request_id = absl::StrCat(base, ":", suffix);
    return RunRemote(c, step);
  }
};

// UNAVAILABLE naming the first rank whose agent did not answer the status read.
absl::Status EveryRankAnswered(const v1::ClusterStatusResponse& resp) {
  for (const v1::RankAgentReport& rep : resp.ranks()) {
    if (!rep.error().empty()) return absl::UnavailableError(absl::StrCat("rank ", rep.address(), ": ", rep.error()));
  }
  return absl::OkStatus();
}

// What a rank's route counters were counted on (rebalance's one-signal checks).
RankLoadSource SourceOf(const v1::RankAgentReport& rep) {
  return {rep.address(), rep.status().checkpoint_version(), rep.status().node(), rep.status().active_version(),
          rep.status().process_group_epoch()};
}

// The smallest count over the ranks of shadow samples / canary steps of `version`.
absl::StatusOr<int64_t> LeastTrialCount(const RemoteCall& call, int64_t version, bool canary) {
  ASSIGN_OR_RETURN(const v1::ClusterStatusResponse resp, GetClusterStatus(call));
  RETURN_IF_ERROR(EveryRankAnswered(resp));
  int64_t least = -1;
  for (const v1::RankAgentReport& rep : resp.ranks()) {
    int64_t n = 0;
    for (const v1::GenerationCounters& c : rep.status().counters()) {
      if (c.version() == version) n = canary ? c.canary_steps() : c.shadow_samples();
    }
    least = least < 0 ? n : std::min(least, n);
  }
  return std::max<int64_t>(least, 0);
}

// Waits until every rank counted `want` shadow samples / canary steps of `version`, printing the
// count as it moves; DEADLINE_EXCEEDED past the rollout's deadline.
absl::Status AwaitTrials(const Rollout& r, int64_t version, bool canary, int64_t want) {
  int64_t last = -1;
  while (true) {
    ASSIGN_OR_RETURN(int64_t n, LeastTrialCount(r.call, version, canary));
    if (n != last) {
      std::cout << absl::StrFormat("  %s of placement-v%d: %d / %d\n", canary ? "canary steps" : "shadow samples",
                                   version, n, want);
      std::cout.flush();
      last = n;
    }
    if (n >= want) return absl::OkStatus();
    if (absl::Now() > r.deadline) {
      return absl::DeadlineExceededError(absl::StrCat("rollout ", r.id, ": ", n, " of ", want,
                                                      canary ? " canary steps" : " shadow samples",
                                                      " before --timeout_s (is the engine sending steps?)"));
    }
    absl::SleepFor(absl::Milliseconds(250));
  }
}

// SHADOW -> CANARY once the ranks ran enough shadow samples. The controller blocks a candidate
// whose shadow outputs differ (runner parity) and drains it: say so plainly, the rollout is over
// for this release.
absl::Status RolloutCanary(Rollout& r, const v1::Release& rel) {
  RETURN_IF_ERROR(AwaitTrials(r, rel.placement_version(), false, r.call.o.min_shadow));
  r.step.reason = "rollout: canary";
  const absl::Status canary = r.Run({"release", "transition", r.id, "CANARY"}, "canary");
  if (canary.code() == absl::StatusCode::kFailedPrecondition) {
    auto now = GetRelease(r.call, r.id);
    if (now.ok() && now->state() == v1::RELEASE_STATE_DRAINING) {
      std::cout << "  BLOCKED at SHADOW -> CANARY: " << r.id << " is DRAINING; it served no canary step\n";
      return absl::FailedPreconditionError(
          absl::StrCat("rollout ", r.id, ": blocked at SHADOW -> CANARY and drained: ", canary.message()));
    }
  }
  return canary;
}

// One move of the rollout from the release's current state.
absl::Status RolloutStep(Rollout& r, const v1::Release& rel) {
  const std::string& id = r.id;
  switch (rel.state()) {
    case v1::RELEASE_STATE_BUILT:
      r.step.reason =
          r.call.o.bundle.empty() ? "rollout: bundle digests checked" : "rollout: bundle verified by the controller";
      return r.Run({"release", "transition", id, "VERIFIED"}, "verify");
    case v1::RELEASE_STATE_VERIFIED:
      return r.Run({"placement", "load", id}, "load");
    case v1::RELEASE_STATE_LOADED:
      r.step.reason = "rollout: shadow beside the active placement";
      return r.Run({"release", "transition", id, "SHADOW"}, "shadow");
    case v1::RELEASE_STATE_SHADOW:
      return RolloutCanary(r, rel);
    case v1::RELEASE_STATE_CANARY:
      RETURN_IF_ERROR(AwaitTrials(r, rel.placement_version(), true, r.call.o.min_canary));
      return r.Run({"promote", id}, "promote");
    default:
      return absl::FailedPreconditionError(absl::StrCat("rollout ", id, ": the release is ", StateName(rel.state()),
                                                        "; only BUILT .. CANARY releases roll out"));
  }
}

// `rollout ID`: the whole walk of one release, resumable: each step has a request id derived from
// one base (the release id unless --request_id), so running it again after any failure continues
// where the registry says the release is. Trials wait for the ranks' counters.
absl::Status RunRollout(const RemoteCall& call) {
  const RemoteOptions& o = call.o;
  const std::string& id = call.cmd[1];
  if (o.manifest.empty() && o.bundle.empty()) {
    return absl::InvalidArgumentError("--manifest or --bundle: required (the release's placement)");
  }
  Rollout r{call, id, o.request_id.empty() ? absl::StrCat("rollout-", id) : o.request_id, o, absl::InfiniteFuture()};
  r.step.json = false;
  r.deadline = absl::Now() + absl::Seconds(o.timeout_s > 0 ? o.timeout_s : 600);
  auto rel = GetRelease(call, id);
  if (rel.status().code() == absl::StatusCode::kNotFound) {
    if (o.digest.empty() && o.bundle.empty()) {
      return absl::InvalidArgumentError("--digest or --bundle: required to register a new release");
    }
    RETURN_IF_ERROR(r.Run({"release", "register", id}, "register"));
    rel = GetRelease(call, id);
  }
  for (int guard = 0; rel.ok() && rel->state() != v1::RELEASE_STATE_ACTIVE && guard < 8; ++guard) {
    RETURN_IF_ERROR(RolloutStep(r, *rel));
    rel = GetRelease(call, id);
  }
  return rel.status();
}

// `releases list`.
absl::Status RunReleasesList(const RemoteCall& call) {
  v1::ListReleasesResponse resp;
  auto ctx = call.Context();
  if (auto s = FromGrpcStatus(call.stub->ListReleases(ctx.get(), {}, &resp)); !s.ok()) return s;
  if (call.o.json) {
    std::cout << Json(resp) << "\n";
  } else {
    PrintReleases(resp);
  }
  return absl::OkStatus();
}

// `releases show ID`: the release and its transition history.
absl::Status RunReleasesShow(const RemoteCall& call) {
  ASSIGN_OR_RETURN(const v1::Release rel, GetRelease(call, call.cmd[2]));
  v1::HistoryRequest hreq;
  hreq.set_release_id(call.cmd[2]);
  v1::HistoryResponse hist;
  auto ctx = call.Context();
  if (auto s = FromGrpcStatus(call.stub->History(ctx.get(), hreq, &hist)); !s.ok()) return s;
  if (call.o.json) {
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

// `release register ID --digest D`.
absl::Status RunReleaseRegister(const RemoteCall& call) {
  v1::RegisterReleaseRequest req;
  req.set_request_id(call.request_id);
  req.set_release_id(call.cmd[2]);
  req.set_bundle_digest(call.o.digest);
  if (!call.o.bundle.empty()) {
    std::ifstream in(call.o.bundle);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("--bundle ", call.o.bundle, ": cannot read"));
    std::stringstream buf;
    buf << in.rdbuf();
    req.set_bundle_json(buf.str());
  }
  v1::Release rel;
  auto ctx = call.Context();
  if (auto s = FromGrpcStatus(call.stub->RegisterRelease(ctx.get(), req, &rel)); !s.ok()) return s;
  std::cout << (call.o.json ? Json(rel)
                            : absl::StrCat(rel.release_id(), " ", StateName(rel.state()),
                                           call.o.bundle.empty() ? "" : absl::StrCat(" ", rel.bundle_digest())))
            << "\n";
  return absl::OkStatus();
}

// `release transition ID STATE --reason R`.
absl::Status RunReleaseTransition(const RemoteCall& call) {
  auto to = ParseState(call.cmd[3]);
  if (!to.ok()) return to.status();
  v1::TransitionReleaseRequest req;
  req.set_request_id(call.request_id);
  req.set_release_id(call.cmd[2]);
  req.set_to(*to);
  req.set_reason(call.o.reason);
  v1::TransitionRecord rec;
  auto ctx = call.Context();
  if (auto s = FromGrpcStatus(call.stub->TransitionRelease(ctx.get(), req, &rec)); !s.ok()) return s;
  if (call.o.json) {
    std::cout << Json(rec) << "\n";
  } else {
    std::cout << rec.release_id() << " " << StateName(rec.from()) << " -> " << StateName(rec.to()) << " (seq "
              << rec.seq() << ", request " << rec.request_id() << ")\n";
  }
  return absl::OkStatus();
}

// The promotion's table line: the new state, the drained release, and the gate's inputs when
// the controller read them from the ranks.
void PrintPromotion(const v1::PromoteResponse& resp, bool evidence_from_ranks) {
  std::cout << resp.release().release_id() << " " << StateName(resp.release().state());
  if (!resp.drained_release_id().empty()) std::cout << "; " << resp.drained_release_id() << " DRAINING";
  if (evidence_from_ranks) {
    const v1::PromotionEvidence& e = resp.evidence();
    std::cout << absl::StrFormat(
        " (ranks: %d shadow samples, %d mismatches, %d canary steps, drop %.4f, "
        "fallback %.3f, %d failures)",
        e.shadow_samples(), e.route_mismatches(), e.canary_samples(),
        e.routes_attempted() ? static_cast<double>(e.routes_dropped()) / e.routes_attempted() : 0.0,
        e.steps() ? static_cast<double>(e.fallback_steps()) / e.steps() : 0.0, e.count_failures());
  }
  std::cout << "\n";
}

// `promote ID [--evidence FILE]`.
absl::Status RunPromote(const RemoteCall& call) {
  const RemoteOptions& o = call.o;
  v1::PromoteRequest req;
  req.set_request_id(call.request_id);
  req.set_release_id(call.cmd[1]);
  if (!o.evidence.empty()) {  // otherwise the controller reads the ranks' counters
    auto evidence = ReadEvidence(o.evidence);
    if (!evidence.ok()) return evidence.status();
    *req.mutable_evidence() = *evidence;
  }
  v1::PromoteResponse resp;
  auto ctx = call.Context(true);
  if (auto s = FromGrpcStatus(WithProgress(call, absl::StrCat("promote ", call.cmd[1]),
                                           [&] { return call.stub->Promote(ctx.get(), req, &resp); }));
      !s.ok()) {
    return s;
  }
  if (o.json) {
    std::cout << Json(resp) << "\n";
  } else {
    PrintPromotion(resp, o.evidence.empty());
  }
  return absl::OkStatus();
}

// `rollback ID --prior PRIOR [--reason R]`.
absl::Status RunRollback(const RemoteCall& call) {
  v1::RollbackRequest req;
  req.set_request_id(call.request_id);
  req.set_release_id(call.cmd[1]);
  req.set_prior_release_id(call.o.prior);
  req.set_reason(call.o.reason);
  v1::RollbackResponse resp;
  auto ctx = call.Context(true);
  if (auto s = FromGrpcStatus(WithProgress(call, absl::StrCat("rollback ", call.cmd[1]),
                                           [&] { return call.stub->Rollback(ctx.get(), req, &resp); }));
      !s.ok()) {
    return s;
  }
  if (call.o.json) {
    std::cout << Json(resp) << "\n";
  } else {
    PrintTransitions(resp.transitions());
  }
  return absl::OkStatus();
}

// `placement load ID --manifest FILE`.
absl::Status RunPlacementLoad(const RemoteCall& call) {
  const RemoteOptions& o = call.o;
  v1::LoadPlacementRequest req;
  req.set_request_id(call.request_id);
  req.set_release_id(call.cmd[2]);
  // Without --manifest the controller loads the placement of the release's bundle.
  if (!o.manifest.empty()) {
    std::ifstream in(o.manifest);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("--manifest ", o.manifest, ": cannot read"));
    std::stringstream buf;
    buf << in.rdbuf();
    if (auto s = google::protobuf::util::JsonStringToMessage(buf.str(), req.mutable_manifest()); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--manifest ", o.manifest, ": ", s.ToString()));
    }
  }
  v1::Release rel;
  auto ctx = call.Context(true);
  if (auto s = FromGrpcStatus(WithProgress(call, absl::StrCat("placement load ", call.cmd[2]),
                                           [&] { return call.stub->LoadPlacement(ctx.get(), req, &rel); }));
      !s.ok()) {
    return s;
  }
  std::cout << (o.json ? Json(rel)
                       : absl::StrCat(rel.release_id(), " ", StateName(rel.state()), " placement-v",
                                      rel.placement_version()))
            << "\n";
  return absl::OkStatus();
}

// The EPLB problems of `rebalance`: the routes every rank counted per expert and the slots each
// serves now, summed over the layers, and per MoE layer when the active generation has layers.
struct RebalanceInputs {
  std::string checkpoint_version;  // the checkpoint every rank serves (the load was counted on)
  RebalanceInput total;
  std::vector<int64_t> layers;
  std::vector<RebalanceInput> per_layer;  // one per entry of `layers`
};

absl::StatusOr<RebalanceInputs> RebalanceInputFromRanks(const v1::ClusterStatusResponse& resp, const RemoteOptions& o) {
  RebalanceInputs in;
  for (RebalanceInput* x : {&in.total}) {
    x->num_replicas = o.num_replicas;
    x->num_groups = o.num_groups;
    x->num_nodes = o.num_nodes;
  }
  // One load signal: one checkpoint, one placement, one group, and nodes the solver can pack to.
  RETURN_IF_ERROR(EveryRankAnswered(resp));
  std::vector<RankLoadSource> sources;
  for (const v1::RankAgentReport& rep : resp.ranks()) sources.push_back(SourceOf(rep));
  RETURN_IF_ERROR(CheckOneLoadSignal(sources, o.num_nodes));
  if (resp.ranks_size() > 0) in.checkpoint_version = resp.ranks(0).status().checkpoint_version();
  for (const v1::RankAgentReport& rep : resp.ranks()) {
    const auto& routes = rep.status().expert_routes();
    if (in.total.expert_load.size() < static_cast<size_t>(routes.size())) in.total.expert_load.resize(routes.size(), 0);
    for (int e = 0; e < routes.size(); ++e) in.total.expert_load[e] += routes[e];
    in.total.current_slot_experts.emplace_back(rep.status().active_slot_experts().begin(),
                                               rep.status().active_slot_experts().end());
  }
  // Per layer: every rank must report the same layers (they serve one generation).
  for (int r = 0; r < resp.ranks_size(); ++r) {
    const auto& layers = resp.ranks(r).status().layers();
    if (r == 0) {
      for (const v1::LayerLoad& l : layers) {
        in.layers.push_back(l.layer());
        in.per_layer.push_back(in.total);
        in.per_layer.back().expert_load.assign(l.expert_routes_size(), 0);
        in.per_layer.back().current_slot_experts.clear();
      }
    }
    if (layers.size() != static_cast<int>(in.layers.size())) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", resp.ranks(r).address(), " reports ", layers.size(),
                                                        " layers, rank 0 ", in.layers.size(), ": a switch under way?"));
    }
    for (int i = 0; i < layers.size(); ++i) {
      RebalanceInput& x = in.per_layer[i];
      if (layers[i].layer() != in.layers[i] ||
          layers[i].expert_routes_size() != static_cast<int>(x.expert_load.size())) {
        return absl::FailedPreconditionError(
            absl::StrCat("rank ", resp.ranks(r).address(), ": layer ", layers[i].layer(), " differs from rank 0's"));
      }
      for (int e = 0; e < layers[i].expert_routes_size(); ++e) x.expert_load[e] += layers[i].expert_routes(e);
      x.current_slot_experts.emplace_back(layers[i].active_slot_experts().begin(),
                                          layers[i].active_slot_experts().end());
    }
  }
  return in;
}

// Which EPLB policy solved it, and what the rank loads printed are.
void PrintPolicy(const RebalanceInput& in, const RebalancePlan& plan) {
  std::cout << "policy: "
            << (plan.hierarchical
                    ? absl::StrCat("hierarchical (", in.num_groups, " groups over ", in.num_nodes, " nodes)")
                    : std::string("global"))
            << "; rank loads split each expert's routes evenly over its copies (the ideal a replica selector "
               "reaches)\n";
}

void PrintRebalance(int num_ranks, const RebalanceInput& in, const RebalancePlan& plan) {
  std::cout << absl::StrFormat("EPLB over the load of %d ranks: %d physical slots\n", num_ranks, plan.num_replicas);
  std::cout << absl::StrFormat("%-8s %12s %8s %8s\n", "EXPERT", "ROUTES", "COPIES", "AFTER");
  for (size_t e = 0; e < in.expert_load.size(); ++e) {
    std::cout << absl::StrFormat("%-8d %12d %8d %8d\n", e, in.expert_load[e], plan.copies_before[e],
                                 plan.copies_after[e]);
  }
  std::cout << absl::StrFormat("%-8s %14s %14s\n", "RANK", "LOAD BEFORE", "LOAD AFTER");
  for (size_t r = 0; r < plan.rank_load_before.size(); ++r) {
    std::cout << absl::StrFormat("%-8d %14.1f %14.1f\n", r, plan.rank_load_before[r], plan.rank_load_after[r]);
  }
  PrintPolicy(in, plan);
  std::cout << absl::StrFormat("balancedness (mean/max rank load): before %.3f, after %.3f\n", plan.balancedness_before,
                               plan.balancedness_after);
  std::cout << absl::StrFormat("gamma_rank (max/mean rank load): before %.3f, after %.3f\n", plan.gamma_before,
                               plan.gamma_after);
}

// Per-layer EPLB: one line per layer, then the balancedness of the layers' summed rank loads.
void PrintLayerRebalance(int num_ranks, const RebalanceInputs& in, const std::vector<RebalancePlan>& plans) {
  std::cout << absl::StrFormat("EPLB per MoE layer over the load of %d ranks: %d layers, %d physical slots each\n",
                               num_ranks, in.layers.size(), plans.front().num_replicas);
  std::cout << absl::StrFormat("%-8s %12s %12s %12s %10s\n", "LAYER", "ROUTES", "BAL BEFORE", "BAL AFTER",
                               "MAX COPIES");
  std::vector<double> before(num_ranks, 0), after(num_ranks, 0);
  for (size_t i = 0; i < plans.size(); ++i) {
    int64_t routes = 0;
    for (int64_t w : in.per_layer[i].expert_load) routes += w;
    std::cout << absl::StrFormat("%-8d %12d %12.3f %12.3f %10d\n", in.layers[i], routes, plans[i].balancedness_before,
                                 plans[i].balancedness_after,
                                 *std::max_element(plans[i].copies_after.begin(), plans[i].copies_after.end()));
    for (int r = 0; r < num_ranks; ++r) {
      before[r] += plans[i].rank_load_before[r];
      after[r] += plans[i].rank_load_after[r];
    }
  }
  PrintPolicy(in.per_layer.front(), plans.front());
  std::cout << absl::StrFormat("balancedness (mean/max rank load, every layer): before %.3f, after %.3f\n",
                               Balancedness(before), Balancedness(after));
  std::cout << absl::StrFormat("gamma_rank (max/mean rank load, every layer): before %.3f, after %.3f\n",
                               GammaRank(before), GammaRank(after));
}

// `rebalance --out F`: the plan as a PlacementManifest JSON over the ranks' topology: one slot
// table per layer when the plans are per layer.
absl::Status WriteRebalanceManifest(const RemoteOptions& o, int world, int num_experts, bool per_layer,
                                    const std::string& served_checkpoint, const std::vector<RebalancePlan>& plans) {
  std::unique_ptr<SafetensorsFile> storage;
  auto ckpt = OpenCheckpoint(o.checkpoint, &storage);
  if (!ckpt.ok()) return absl::InvalidArgumentError(absl::StrCat("--checkpoint: ", ckpt.status().message()));
  // The load was counted on the ranks' checkpoint: a placement of another one plans for routes
  // that checkpoint's router never made (0x08A: demand has provenance).
  if ((*ckpt)->version() != served_checkpoint) {
    return absl::FailedPreconditionError(absl::StrCat("--checkpoint: ", o.checkpoint, " is version '",
                                                      (*ckpt)->version(), "', the ranks serve '", served_checkpoint,
                                                      "' (their load was counted on it)"));
  }
  MOE_CHECK(o.topology != nullptr, "RemoteOptions.topology: the caller provides the ranks' topology");
  const Topology topology = o.topology(world);
  const ProcessGroup group = LocalClusterGroup(world, o.epoch);
  const CheckpointIdentity id = (*ckpt)->Identity();
  absl::StatusOr<std::shared_ptr<const PlacementManifest>> m;
  if (!per_layer) {
    m = PlacementFromAssignment(PlacementVersion(o.placement_version), num_experts, plans.front().expert_rank, topology,
                                group, id, plans.front().replica_rank);
  } else {
    std::vector<std::vector<std::pair<int, int>>> per_layer;
    std::vector<std::vector<int>> replica_ranks;
    for (const RebalancePlan& p : plans) {
      per_layer.push_back(p.expert_rank);
      replica_ranks.push_back(p.replica_rank);
    }
    m = LayeredPlacementFromAssignment(PlacementVersion(o.placement_version), num_experts, per_layer, topology, group,
                                       id, replica_ranks);
  }
  if (!m.ok()) return m.status();
  RETURN_IF_ERROR(json::WriteFile(o.out, Json(ManifestToProto(**m, topology)), "--out"));
  std::cout << "wrote placement-v" << o.placement_version << " to " << o.out
            << ((*m)->per_layer() ? absl::StrCat(" (", (*m)->layers().size(), " per-layer slot tables)") : "") << "\n";
  return absl::OkStatus();
}

// A rank report's route counters (expert_routes and per layer).
RankLoadCounts CountsOf(const v1::RankAgentReport& rep) {
  RankLoadCounts c;
  c.source = SourceOf(rep);
  c.routes.assign(rep.status().expert_routes().begin(), rep.status().expert_routes().end());
  for (const v1::LayerLoad& l : rep.status().layers()) {
    c.layers.emplace_back(l.layer(), std::vector<int64_t>(l.expert_routes().begin(), l.expert_routes().end()));
  }
  return c;
}

// `rebalance --window_s N`: the ranks' status read twice N seconds apart, the second read's
// route counters replaced by what was counted in between (LoadOverWindow's checks).
absl::StatusOr<v1::ClusterStatusResponse> StatusOverWindow(const RemoteCall& call) {
  ASSIGN_OR_RETURN(const v1::ClusterStatusResponse first, GetClusterStatus(call));
  RETURN_IF_ERROR(EveryRankAnswered(first));
  std::cerr << "counting routes for " << call.o.window_s << " s\n";
  absl::SleepFor(absl::Seconds(call.o.window_s));
  ASSIGN_OR_RETURN(v1::ClusterStatusResponse second, GetClusterStatus(call));
  RETURN_IF_ERROR(EveryRankAnswered(second));
  std::vector<RankLoadCounts> before, after;
  for (const v1::RankAgentReport& rep : first.ranks()) before.push_back(CountsOf(rep));
  for (const v1::RankAgentReport& rep : second.ranks()) after.push_back(CountsOf(rep));
  ASSIGN_OR_RETURN(const std::vector<RankLoadCounts> window, LoadOverWindow(before, after));
  for (int r = 0; r < second.ranks_size(); ++r) {
    v1::AgentStatusResponse* st = second.mutable_ranks(r)->mutable_status();
    for (int e = 0; e < st->expert_routes_size(); ++e) st->set_expert_routes(e, window[r].routes[e]);
    for (int i = 0; i < st->layers_size(); ++i) {
      for (int e = 0; e < st->layers(i).expert_routes_size(); ++e) {
        st->mutable_layers(i)->set_expert_routes(e, window[r].layers[i].second[e]);
      }
    }
  }
  return second;
}

// `rebalance --dry_run [--window_s N] [--out F ...]`: EPLB over the ranks' observed load (since
// each daemon started, or over a window), per MoE layer when the ranks serve layers.
absl::Status RunRebalance(const RemoteCall& call) {
  const RemoteOptions& o = call.o;
  if (!o.dry_run)
    return absl::InvalidArgumentError("--dry_run: required (rebalance only plans; load the plan with placement load)");
  if (o.window_s < 0 || o.window_s > 3600) {
    return absl::InvalidArgumentError(absl::StrCat("--window_s: ", o.window_s, " (0 to 3600)"));
  }
  ASSIGN_OR_RETURN(const v1::ClusterStatusResponse resp,
                   o.window_s > 0 ? StatusOverWindow(call) : GetClusterStatus(call));
  std::cout << "load: "
            << (o.window_s > 0 ? absl::StrCat("the routes counted over ", o.window_s, " s")
                               : std::string("the routes counted since each daemon started"))
            << "\n";
  ASSIGN_OR_RETURN(const RebalanceInputs in, RebalanceInputFromRanks(resp, o));
  std::vector<RebalancePlan> plans;
  if (in.layers.empty()) {
    ASSIGN_OR_RETURN(RebalancePlan plan, PlanRebalance(in.total));
    PrintRebalance(resp.ranks_size(), in.total, plan);
    plans.push_back(std::move(plan));
  } else {
    for (size_t i = 0; i < in.layers.size(); ++i) {
      auto plan = PlanRebalance(in.per_layer[i]);
      if (!plan.ok()) {
        return absl::Status(plan.status().code(), absl::StrCat("layer ", in.layers[i], ": ", plan.status().message()));
      }
      plans.push_back(*std::move(plan));
    }
    PrintLayerRebalance(resp.ranks_size(), in, plans);
  }
  if (!o.out.empty()) {
    return WriteRebalanceManifest(o, resp.ranks_size(), static_cast<int>(in.total.expert_load.size()),
                                  !in.layers.empty(), in.checkpoint_version, plans);
  }
  return absl::OkStatus();
}

// One rank's generations for `status`: state/handles, how the slots were materialized, and the
// trial it runs.
std::string GenerationsLine(const v1::RankAgentReport& rep) {
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
  return gens;
}

// `status`: every rank's generations and handles.
absl::Status RunStatus(const RemoteCall& call) {
  ASSIGN_OR_RETURN(const v1::ClusterStatusResponse resp, GetClusterStatus(call));
  if (call.o.json) {
    std::cout << Json(resp) << "\n";
    return absl::OkStatus();
  }
  std::cout << absl::StrFormat("%-4s %-22s %-7s %s\n", "RANK", "ADDRESS", "ACTIVE", "GENERATIONS (state/handles)");
  for (int r = 0; r < resp.ranks_size(); ++r) {
    const v1::RankAgentReport& rep = resp.ranks(r);
    std::cout << absl::StrFormat("%-4d %-22s %-7s %s\n", r, rep.address(),
                                 rep.error().empty() ? absl::StrCat("v", rep.status().active_version()) : "-",
                                 rep.error().empty() ? GenerationsLine(rep) : "unreachable: " + rep.error());
  }

  return absl::OkStatus();
}

// `group status`: the process group the controller forms (--world): its state, the epoch
// serving, each member's node and devices, and the epochs formed since the controller started.
absl::Status RunGroupStatus(const RemoteCall& call) {
  auto stub = v1::ProcessGroupService::NewStub(grpc::CreateChannel(call.o.controller, ChannelCredentials(call.o.tls)));
  v1::GroupStatus st;
  auto ctx = call.Context();
  if (auto s = FromGrpcStatus(stub->Status(ctx.get(), {}, &st)); !s.ok()) return s;
  if (call.o.json) {
    std::cout << Json(st) << "\n";
    return absl::OkStatus();
  }
  std::cout << "state " << st.state() << ", epoch " << st.view().epoch() << " (" << st.reason() << ")";
  if (st.forming_epoch() > 0) std::cout << ", forming epoch " << st.forming_epoch();
  std::cout << "\n";
  std::cout << absl::StrFormat("%-4s %-5s %-24s %-22s %s\n", "RANK", "SLOT", "NODE", "AGENT", "DEVICES");
  for (int i = 0; i < st.view().members_size(); ++i) {
    const v1::GroupMember& m = st.view().members(i);
    std::cout << absl::StrFormat("%-4d %-5d %-24s %-22s %s\n", m.rank(), i, m.node(), m.agent_address(),
                                 absl::StrJoin(m.devices(), ","));
  }
  for (const v1::EpochRecord& e : st.epochs()) {
    std::cout << absl::StrFormat(
        "  epoch %d: %s; ranks [%s]%s\n", e.epoch(), e.reason(), absl::StrJoin(e.peers(), ","),
        e.ready_unix_ms() > 0
            ? absl::StrCat(", serving ", e.ready_unix_ms() - e.prepared_unix_ms(), " ms after it was prepared")
            : std::string(", not served"));
  }
  return absl::OkStatus();
}

// A controller subcommand: `name` is cmd[0], `verb` cmd[1] when it names a verb (nullptr when
// cmd[1] is an argument), and cmd has min_size..max_size words.
struct Subcommand {
  const char* name;
  const char* verb;
  size_t min_size, max_size;
  absl::Status (*run)(const RemoteCall& call);
};

constexpr Subcommand kSubcommands[] = {
    {"watch", nullptr, 1, 2, RunWatch},
    {"drain", nullptr, 2, 2, RunDrain},
    {"rollout", nullptr, 2, 2, RunRollout},
    {"releases", "list", 2, 2, RunReleasesList},
    {"releases", "show", 3, 3, RunReleasesShow},
    {"release", "register", 3, 3, RunReleaseRegister},
    {"release", "transition", 4, 4, RunReleaseTransition},
    {"promote", nullptr, 2, 2, RunPromote},
    {"rollback", nullptr, 2, 2, RunRollback},
    {"placement", "load", 3, 3, RunPlacementLoad},
    {"rebalance", nullptr, 1, 1, RunRebalance},
    {"status", nullptr, 1, 1, RunStatus},
    {"group", "status", 2, 2, RunGroupStatus},
};

const Subcommand* FindSubcommand(const std::vector<std::string>& cmd) {
  for (const Subcommand& sub : kSubcommands) {
    if (cmd.size() < sub.min_size || cmd.size() > sub.max_size || cmd[0] != sub.name) continue;
    if (sub.verb == nullptr || cmd[1] == sub.verb) return &sub;
  }
  return nullptr;
}

}  // namespace

bool IsRemoteCommand(const std::vector<std::string>& cmd) {
  if (cmd.empty()) return false;
  return cmd[0] == "releases" || cmd[0] == "release" || cmd[0] == "promote" || cmd[0] == "rollback" ||
         cmd[0] == "status" || cmd[0] == "watch" || cmd[0] == "drain" || cmd[0] == "rollout" || cmd[0] == "rebalance" ||
         (cmd[0] == "group" && cmd.size() >= 2 && cmd[1] == "status") ||
         (cmd[0] == "placement" && cmd.size() >= 2 && cmd[1] == "load");
}

absl::Status RunRemote(const std::vector<std::string>& cmd, const RemoteOptions& o) {
  if (o.controller.empty()) return absl::InvalidArgumentError("--controller: required (host:port of moe-controller)");
  if (o.token_file.empty()) return absl::InvalidArgumentError("--token_file: required");
  if (absl::Status s = CheckTlsFiles(o.tls); !s.ok()) return s;
  std::ifstream tf(o.token_file);
  std::string token;
  if (!tf || !std::getline(tf, token)) {
    return absl::InvalidArgumentError(absl::StrCat("--token_file ", o.token_file, ": cannot read"));
  }
  RemoteCall call{cmd, o,
                  v1::ControlPlaneService::NewStub(grpc::CreateChannel(o.controller, ChannelCredentials(o.tls))),
                  std::string(absl::StripAsciiWhitespace(token)), o.request_id.empty() ? NewRequestId() : o.request_id};
  const Subcommand* sub = FindSubcommand(cmd);
  if (sub == nullptr) {
    return absl::InvalidArgumentError(
        "command: expected releases list | releases show ID | release register ID | "
        "release transition ID STATE | placement load ID | promote ID | rollback ID | status | group status | "
        "rebalance");
  }
  return sub->run(call);
}

}  // namespace moe
