#include "server/rank_agent_service.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "rpc/bearer_auth.h"
#include "rpc/counters_proto.h"
#include "rpc/grpc_status.h"
#include "rpc/placement_proto.h"
#include "runtime/checkpoint/expert_checkpoint.h"
#include "runtime/checkpoint/expert_loader.h"
#include "runtime/checkpoint/hf_checkpoint.h"
#include "runtime/checkpoint/synthetic.h"
#include "runtime/logging.h"
#include "runtime/placement/migration.h"
#include "runtime/status.h"

namespace moe {

namespace {

v1::GenerationState ToProto(GenerationState s) {
  switch (s) {
    case GenerationState::kPrepared:
      return v1::GENERATION_STATE_PREPARED;
    case GenerationState::kActive:
      return v1::GENERATION_STATE_ACTIVE;
    case GenerationState::kDraining:
      return v1::GENERATION_STATE_DRAINING;
    case GenerationState::kRetired:
      return v1::GENERATION_STATE_RETIRED;
  }
  return v1::GENERATION_STATE_UNSPECIFIED;
}

bool SameTable(const PlacementManifest& a, const PlacementManifest& b) {
  if (a.slots().size() != b.slots().size()) return false;
  for (size_t i = 0; i < a.slots().size(); ++i) {
    const SlotRecord &x = a.slots()[i], &y = b.slots()[i];
    if (x.slot != y.slot || x.expert != y.expert || x.rank != y.rank || x.parameter_digest != y.parameter_digest ||
        x.checkpoint != y.checkpoint || x.layer_digests != y.layer_digests) {
      return false;
    }
  }
  return true;
}

// Same version, same slots (in every layer): a repeated PrepareGeneration.
bool SameSlots(const PlacementManifest& a, const PlacementManifest& b) {
  if (a.layers() != b.layers() || a.per_layer() != b.per_layer() || !SameTable(a, b)) return false;
  for (int i = 0; a.per_layer() && i < static_cast<int>(a.layers().size()); ++i) {
    if (!SameTable(a.LayerAt(i), b.LayerAt(i))) return false;
  }
  return true;
}

// Index of slot `q` among `rank`'s local slots of `m` (the order of its weights), -1 if `q` is
// not a slot of `m` on that rank.
int64_t LocalIndex(const PlacementManifest& m, Rank rank, PhysicalSlotId q) {
  if (q.value() < 0 || q.value() >= m.num_slots() || m.slot(q).rank != rank) return -1;
  return m.LocalIndex(q);
}

// The sizes of one slot's expert in every layer of the checkpoint: d, d_ff, the layers, and the
// BF16 elements of one layer's w_gate_up [2 d_ff, d] and w_down [d, d_ff].
struct SlotSizes {
  int d = 0, d_ff = 0;
  std::vector<int64_t> layers;  // empty: one expert set
  int num_layers = 1;
  size_t gu1 = 0, dn1 = 0;    // one layer
  size_t gu_n = 0, dn_n = 0;  // every layer (a slot's weights, layer after layer)
};

SlotSizes CheckpointSlotSizes(const CheckpointReader& checkpoint) {
  SlotSizes s;
  const ExpertShape shape = checkpoint.shape();
  s.d = shape.d;
  s.d_ff = shape.d_ff;
  s.layers = checkpoint.layers();
  s.num_layers = checkpoint.num_layers();
  s.gu1 = static_cast<size_t>(2) * s.d_ff * s.d;
  s.dn1 = static_cast<size_t>(s.d) * s.d_ff;
  s.gu_n = s.gu1 * s.num_layers;
  s.dn_n = s.dn1 * s.num_layers;
  return s;
}

// The source of the 0x08F plan: the placement this rank serves now, with its weights in memory,
// and this rank's steps of every layer's plan from it (none without an active placement in
// memory over the same layers).
struct MigrationSource {
  std::shared_ptr<const PlacementManifest> from;
  std::shared_ptr<const LocalExperts> weights;
  std::vector<std::map<int64_t, MigrationStep>> mine;  // [layer index]: target slot -> step
};

absl::StatusOr<MigrationSource> PlanFromActive(const RankAgentContext& c, const Topology& topology,
                                               const ProcessGroup& group, const PlacementManifest& to,
                                               const SlotSizes& sizes) {
  MigrationSource src;
  src.mine.resize(sizes.num_layers);
  const int64_t active = c.registry->ActiveVersion();
  if (active >= 0) {
    auto live = c.registry->RequireLive(PlacementVersion(active));
    if (live.ok()) src.from = *live;
    src.weights = c.executor->HostWeights(PlacementVersion(active));
  }
  if (src.from != nullptr && src.weights != nullptr && src.from->layers() == to.layers() &&
      src.weights->layers == sizes.layers) {
    ASSIGN_OR_RETURN(
        LayeredMigrationPlan plan,
        PlanLayeredMigration(*src.from, to, topology, static_cast<int64_t>(sizes.gu1 + sizes.dn1) * 2, &group));
    for (int li = 0; li < sizes.num_layers; ++li) {
      for (const MigrationStep& st : plan.per_layer[li].steps) {
        if (st.target_rank == c.rank) src.mine[li][st.target_slot.value()] = st;
      }
    }
  }
  return src;
}

// One expert in one layer of a rank's weights (layer after layer, L local slots each).
struct ExpertAt {
  uint16_t* gate_up;
  uint16_t* down;
};
ExpertAt At(LocalExperts& w, size_t l_count, int li, int64_t j, const SlotSizes& s) {
  const size_t at = li * l_count + j;
  return {w.w_gate_up.data() + at * s.gu1, w.w_down.data() + at * s.dn1};
}

// Retain / local duplicate: layer li's copy of local slot j (of `l_count`) in `src`.
absl::Status CopyInMemory(const LocalExperts& src, size_t l_count, int li, int64_t j, const SlotSizes& sizes,
                          const SlotRecord& slot, MigrationAction action, ExpertAt out) {
  const size_t at = li * l_count + j;
  if (j < 0 || src.layers != sizes.layers || (at + 1) * sizes.gu1 > src.w_gate_up.size() ||
      (at + 1) * sizes.dn1 > src.w_down.size()) {
    return absl::InternalError(absl::StrCat("slot ", slot.name, ": ", MigrationActionName(action), " source missing"));
  }
  std::copy_n(src.w_gate_up.begin() + at * sizes.gu1, sizes.gu1, out.gate_up);
  std::copy_n(src.w_down.begin() + at * sizes.dn1, sizes.dn1, out.down);
  return absl::OkStatus();
}

// Same-node / cross-node copies: the peers' agents (rank -> address), one channel per peer for
// all the slots copied from it.
class PeerAgents {
 public:
  PeerAgents(const std::vector<std::string>& peers, const std::string& token,
             std::shared_ptr<grpc::ChannelCredentials> credentials)
      : peers_(peers),
        token_(token),
        credentials_(credentials != nullptr ? std::move(credentials) : grpc::InsecureChannelCredentials()) {}

  // Layer `layer`'s copy of `step`'s source slot in placement `from` (the whole single expert
  // set when the checkpoint has no layers), fetched from the rank holding it.
  absl::Status Fetch(PlacementVersion from, const MigrationStep& step, const SlotRecord& slot, int64_t layer,
                     const SlotSizes& sizes, ExpertAt out) {
    const int e = slot.expert.value();
    const int src_rank = step.source_rank.value();
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + token_);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::FetchSlotRequest freq;
    freq.set_version(from.value());
    freq.set_slot(static_cast<int32_t>(step.source_slot.value()));
    if (!sizes.layers.empty()) freq.set_layer(layer);
    v1::SlotWeights w;
    const grpc::Status fetched = Stub(src_rank).FetchSlotWeights(&ctx, freq, &w);
    if (!fetched.ok()) {
      return absl::UnavailableError(absl::StrCat("slot ", slot.name, ": copy of expert ", e, " (layer ", layer,
                                                 ") from rank ", src_rank, " (", peers_.at(src_rank),
                                                 "): ", fetched.error_message()));
    }
    if (w.expert() != e || w.w_gate_up().size() != sizes.gu1 * 2 || w.w_down().size() != sizes.dn1 * 2) {
      return absl::DataLossError(absl::StrCat("slot ", slot.name, ": rank ", src_rank, " sent expert ", w.expert(),
                                              " with ", w.w_gate_up().size() + w.w_down().size(), " bytes"));
    }
    std::memcpy(out.gate_up, w.w_gate_up().data(), sizes.gu1 * 2);
    std::memcpy(out.down, w.w_down().data(), sizes.dn1 * 2);
    return absl::OkStatus();
  }

 private:
  v1::RankAgentService::Stub& Stub(int r) {
    std::unique_ptr<v1::RankAgentService::Stub>& stub = stubs_[r];
    if (stub == nullptr) {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(1 << 30);
      stub = v1::RankAgentService::NewStub(grpc::CreateCustomChannel(peers_.at(r), credentials_, args));
    }
    return *stub;
  }

  const std::vector<std::string>& peers_;
  const std::string& token_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::map<int, std::unique_ptr<v1::RankAgentService::Stub>> stubs_;
};

// A generation registry's refusal of the request's version, named by the request's field.
grpc::Status VersionRefused(const absl::Status& s) {
  return ToGrpcStatus(absl::Status(s.code(), absl::StrCat("version: ", s.message())));
}

}  // namespace

absl::StatusOr<std::pair<Topology, ProcessGroup>> RankAgentServiceImpl::Membership() const {
  auto m = c_.executor->Membership();
  if (!m.has_value()) {
    return absl::UnavailableError(
        absl::StrCat("rank ", c_.rank.value(), " is between process-group epochs (the group is re-forming)"));
  }
  return *std::move(m);
}

void RankAgentServiceImpl::Fill(const GenerationInfo& g, v1::GenerationStatus* out) const {
  out->set_version(g.version.value());
  out->set_state(ToProto(g.state));
  out->set_refcount(g.refcount);
  out->set_local_slots(static_cast<int32_t>(g.manifest->LocalSlots(c_.rank).size()));
  // The digest of the manifest held here, which the controller checks against the one it
  // recorded (its slots' parameter digests are what PrepareGeneration verified the weights by).
  if (g.state != GenerationState::kRetired) out->set_manifest_digest(PlacementDigest(*g.manifest));
  absl::MutexLock summary_lock(&summary_mu_);
  auto it = materialized_.find(g.version.value());
  if (it != materialized_.end()) {
    out->set_retained(it->second[0]);
    out->set_duplicated(it->second[1]);
    out->set_copied(it->second[2]);
    out->set_loaded(it->second[3]);
  }
}

grpc::Status RankAgentServiceImpl::Describe(PlacementVersion v, v1::GenerationStatus* out) const {
  for (const GenerationInfo& g : c_.registry->List()) {
    if (g.version != v) continue;
    Fill(g, out);
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("version: placement-v", v.value(), " is unknown here"));
}

grpc::Status RankAgentServiceImpl::PrepareGeneration(grpc::ServerContext* ctx, const v1::PrepareGenerationRequest* req,
                                                     v1::GenerationStatus* resp) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  if (!req->has_manifest()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "manifest: required");
  auto membership = Membership();
  if (!membership.ok()) return ToGrpcStatus(membership.status());
  const auto& [topology, group] = *membership;
  auto manifest = ManifestFromProto(req->manifest(), topology);
  if (!manifest.ok()) return ToGrpcStatus(manifest.status());
  const PlacementVersion v = (*manifest)->version();
  if (v.value() <= 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "manifest.version: must be positive");
  if (req->has_runtime()) {
    // 0x0CB: a release's coordinates are bound together; a rank running others refuses it.
    const v1::RuntimeCoordinates& want = req->runtime();
    const v1::RuntimeCoordinates& mine = c_.runtime;
    const auto refuse = [&](const char* field, const std::string& theirs, const std::string& ours, const char* flag) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("runtime.", field, ": the release bundle says ", theirs, ", rank ",
                                       c_.rank.value(), " runs ", ours, " (", flag, ")"));
    };
    if (want.decode_runner() != mine.decode_runner()) {
      return refuse("decode_runner", want.decode_runner(), mine.decode_runner(), "--decode_runner");
    }
    if (want.decode_bucket_tokens() != mine.decode_bucket_tokens()) {
      return refuse("decode_bucket_tokens", absl::StrCat(want.decode_bucket_tokens()),
                    absl::StrCat(mine.decode_bucket_tokens()), "--decode_bucket_tokens");
    }
    if (want.decode_bucket_slot_routes() != mine.decode_bucket_slot_routes()) {
      return refuse("decode_bucket_slot_routes", absl::StrCat(want.decode_bucket_slot_routes()),
                    absl::StrCat(mine.decode_bucket_slot_routes()), "--decode_bucket_slot_routes");
    }
    if (!want.dtype().empty() && want.dtype() != mine.dtype()) {
      return refuse("dtype", want.dtype(), mine.dtype(), "--expert_dtype");
    }
    if (!want.kernel_build().empty() && want.kernel_build() != mine.kernel_build()) {
      return refuse("kernel_build", want.kernel_build(), mine.kernel_build(), "the build of its kernels");
    }
    if (want.nodes_size() > 0) {
      if (want.nodes_size() != topology.num_ranks()) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("runtime.nodes: the release bundle names ", want.nodes_size(),
                                         " ranks' nodes, ", "the process group has ", topology.num_ranks(), " ranks"));
      }
      const std::string& node = topology.NodeName(topology.NodeOf(c_.rank));
      if (want.nodes(c_.rank.value()) != node) {
        return grpc::Status(
            grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("runtime.nodes[", c_.rank.value(), "]: the release bundle expects node ",
                         want.nodes(c_.rank.value()), ", rank ", c_.rank.value(), " is on ", node, " (--node)"));
      }
    }
  }
  absl::MutexLock lock(&mu_);
  if (auto state = c_.registry->State(v); state.ok()) {
    if (*state == GenerationState::kRetired) {
      // Its weights are gone: answering the repeat as prepared would let the controller record it
      // LOADED, and activating it would then fail on every reconcile.
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("manifest.version: placement-v", v.value(),
                                       " was retired on this rank; prepare the placement under a new version"));
    }
    for (const GenerationInfo& g : c_.registry->List()) {
      if (g.version == v && SameSlots(*g.manifest, **manifest)) return Describe(v, resp);  // repeat
    }
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        absl::StrCat("manifest.version: placement-v", v.value(), " exists with other slots"));
  }
  // Verify and materialize everything before the registry sees the generation: a failure leaves
  // nothing.
  if (absl::Status s = VerifyForPublish(**manifest, group, topology); !s.ok()) return ToGrpcStatus(s);
  const std::vector<std::string> peers(req->peer_agents().begin(), req->peer_agents().end());
  if (!peers.empty() && static_cast<int>(peers.size()) != topology.num_ranks()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("peer_agents: ", peers.size(), " addresses for ", topology.num_ranks(), " ranks"));
  }
  auto local = Materialize(**manifest, peers, topology, group);
  if (!local.ok()) return ToGrpcStatus(local.status());
  const std::array<int, 4> summary = {local->retained, local->duplicated, local->copied, local->loaded};
  if (absl::Status s = c_.executor->AddGeneration(v, std::make_shared<LocalExperts>(std::move(local->experts)));
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (absl::Status s = c_.registry->Prepare(*manifest); !s.ok()) {
    c_.executor->DropGeneration(v);
    return ToGrpcStatus(s);
  }
  {
    absl::MutexLock summary_lock(&summary_mu_);
    materialized_[v.value()] = summary;
  }
  spdlog::info(
      "placement-v{}: {} local slots: {} retained, {} duplicated here, {} copied from peers, {} loaded from "
      "the checkpoint",
      v.value(), summary[0] + summary[1] + summary[2] + summary[3], summary[0], summary[1], summary[2], summary[3]);
  return Describe(v, resp);
}

absl::StatusOr<RankAgentServiceImpl::Materialized> RankAgentServiceImpl::Materialize(
    const PlacementManifest& to, const std::vector<std::string>& peers, const Topology& topology,
    const ProcessGroup& group) {
  const SlotSizes sizes = CheckpointSlotSizes(*c_.checkpoint);
  if (to.layers() != sizes.layers) {
    return absl::FailedPreconditionError(absl::StrCat("manifest.layers: placement-v", to.version().value(),
                                                      " serves other layers than checkpoint ", c_.checkpoint->version(),
                                                      " holds"));
  }
  // The ranks materialize the checkpoint the generation names, and verify every copy before it
  // serves: a manifest of another checkpoint, or one that gives a copy nothing to be verified by,
  // is refused before anything is read or copied.
  if (to.checkpoint().value() != c_.checkpoint->version()) {
    return absl::FailedPreconditionError(absl::StrCat("manifest.checkpoint_version: placement-v", to.version().value(),
                                                      " is of checkpoint ", to.checkpoint().value(), ", rank ",
                                                      c_.rank.value(), " serves ", c_.checkpoint->version()));
  }
  for (PhysicalSlotId q : to.LocalSlots(c_.rank)) RETURN_IF_ERROR(RequireSlotDigests(to, q, sizes.num_layers));
  ASSIGN_OR_RETURN(const MigrationSource source, PlanFromActive(c_, topology, group, to, sizes));
  PeerAgents peer_agents(peers, c_.token, c_.peer_credentials);
  Materialized out;
  out.experts.d = sizes.d;
  out.experts.d_ff = sizes.d_ff;
  out.experts.layers = sizes.layers;
  const auto local = to.LocalSlots(c_.rank);
  // The weights the manifest puts here, checked (and sized with checked arithmetic) before any
  // is reserved: a manifest of many slots is refused, not allocated.
  ASSIGN_OR_RETURN(const int64_t need, LocalExpertBytes(*c_.checkpoint, to, c_.rank));
  const int64_t limit = c_.max_weight_bytes > 0 ? c_.max_weight_bytes : AvailableHostBytes();
  if (limit > 0 && need > limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("manifest.slots: placement-v", to.version().value(), " puts ", local.size(), " slots on rank ",
                     c_.rank.value(), ", ", need, " bytes of expert weights, more than the ", limit, " bytes ",
                     c_.max_weight_bytes > 0 ? "this rank may hold" : "of host memory available"));
  }
  const size_t l_count = local.size();
  const size_t from_count = source.from != nullptr ? source.from->LocalSlots(c_.rank).size() : 0;
  out.experts.w_gate_up.resize(sizes.gu_n * l_count);
  out.experts.w_down.resize(sizes.dn_n * l_count);
  // Every copy's digest and how it came, [local slot][layer], verified before publish (0x08F).
  std::vector<std::vector<std::string>> digests(l_count, std::vector<std::string>(sizes.num_layers));
  std::vector<std::vector<std::string>> how(l_count, std::vector<std::string>(sizes.num_layers));
  // Every layer's copy of every local slot, each as its layer's plan says.
  for (int li = 0; li < sizes.num_layers; ++li) {
    const int64_t layer = sizes.layers.empty() ? 0 : sizes.layers[li];
    const PlacementManifest& table = to.LayerAt(li);
    for (size_t j = 0; j < l_count; ++j) {
      const SlotRecord& slot = table.slot(local[j]);
      const ExpertAt dst = At(out.experts, l_count, li, static_cast<int64_t>(j), sizes);
      auto it = source.mine[li].find(local[j].value());
      MigrationAction action = it == source.mine[li].end() ? MigrationAction::kCheckpointLoad : it->second.action;
      const bool network = action == MigrationAction::kSameNodeCopy || action == MigrationAction::kCrossNodeCopy;
      if (network && peers.empty()) action = MigrationAction::kCheckpointLoad;
      if (action == MigrationAction::kRetain) {
        RETURN_IF_ERROR(CopyInMemory(*source.weights, from_count, li,
                                     LocalIndex(*source.from, c_.rank, it->second.source_slot), sizes, slot, action,
                                     dst));
        ++out.retained;
      } else if (action == MigrationAction::kLocalDuplicate) {
        RETURN_IF_ERROR(CopyInMemory(out.experts, l_count, li, LocalIndex(to, c_.rank, it->second.source_slot), sizes,
                                     slot, action, dst));
        ++out.duplicated;
      } else if (action != MigrationAction::kCheckpointLoad) {
        RETURN_IF_ERROR(peer_agents.Fetch(source.from->version(), it->second, slot, layer, sizes, dst));
        ++out.copied;
      } else {
        absl::Status s = c_.checkpoint->ReadExpert(layer, slot.expert.value(), dst.gate_up, dst.down);
        if (!s.ok()) return absl::Status(s.code(), absl::StrCat("slot ", slot.name, ": ", s.message()));
        ++out.loaded;
      }
      digests[j][li] = ExpertDigest(dst.gate_up, sizes.gu1, dst.down, sizes.dn1);
      how[j][li] = MigrationActionName(action);
    }
  }
  for (size_t j = 0; j < l_count; ++j) RETURN_IF_ERROR(CheckSlotDigests(to, local[j], digests[j], how[j]));
  return out;
}

grpc::Status RankAgentServiceImpl::FetchSlotWeights(grpc::ServerContext* ctx, const v1::FetchSlotRequest* req,
                                                    v1::SlotWeights* resp) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  const PlacementVersion v(req->version());
  std::shared_ptr<const PlacementManifest> m;
  for (const GenerationInfo& g : c_.registry->List()) {
    if (g.version == v && g.state != GenerationState::kRetired) m = g.manifest;
  }
  if (m == nullptr) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("version: placement-v", v.value(), " is not held on rank ", c_.rank.value()));
  }
  const int64_t j = LocalIndex(*m, c_.rank, PhysicalSlotId(req->slot()));
  if (j < 0) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("slot: q", req->slot(), " of placement-v", v.value(),
                                                                  " is not on rank ", c_.rank.value()));
  }
  std::shared_ptr<const LocalExperts> w = c_.executor->HostWeights(v);
  if (w == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("placement-v", v.value(), ": no weights in memory on rank ", c_.rank.value()));
  }
  // The slot's weights in the requested layer. A generation of several layers is fetched a
  // layer a call: all of them in one reply would be the layers' count times an expert's bytes
  // (DeepSeek-V3: ~5 GB) allocated for each caller.
  if (!req->has_layer() && w->num_layers() > 1) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("layer: required: placement-v", v.value(), " has ", w->num_layers(),
                                     " layers, fetched one a call"));
  }
  const size_t gu1 = static_cast<size_t>(2) * w->d_ff * w->d, dn1 = static_cast<size_t>(w->d) * w->d_ff;
  const size_t l_count = m->LocalSlots(c_.rank).size();
  int first = 0, last = w->num_layers();
  if (req->has_layer()) {
    first = w->LayerIndex(req->layer());
    if (first < 0 || w->layers.empty()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("layer: ", req->layer(), " is not a layer of placement-v", v.value(),
                                       " on rank ", c_.rank.value()));
    }
    last = first + 1;
  }
  resp->set_expert(m->LayerAt(first).slot(PhysicalSlotId(req->slot())).expert.value());
  std::string* gu = resp->mutable_w_gate_up();
  std::string* dn = resp->mutable_w_down();
  for (int li = first; li < last; ++li) {
    const size_t at = li * l_count + j;
    gu->append(reinterpret_cast<const char*>(w->w_gate_up.data() + at * gu1), gu1 * 2);
    dn->append(reinterpret_cast<const char*>(w->w_down.data() + at * dn1), dn1 * 2);
  }
  return grpc::Status::OK;
}

grpc::Status RankAgentServiceImpl::Change(
    const grpc::ServerContext* ctx, const v1::GenerationRequest& req, v1::GenerationStatus* resp,
    const std::function<absl::Status(PlacementVersion, GenerationState)>& change) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  if (req.version() <= 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "version: must be positive");
  absl::MutexLock lock(&mu_);
  const PlacementVersion v(req.version());
  auto state = c_.registry->State(v);
  if (!state.ok()) return VersionRefused(state.status());
  if (absl::Status s = change(v, *state); !s.ok()) return VersionRefused(s);
  return Describe(v, resp);
}

// Each change is a no-op when the generation is already where it leads (retries are safe).
grpc::Status RankAgentServiceImpl::ActivateGeneration(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                                      v1::GenerationStatus* resp) {
  return Change(ctx, *req, resp, [&](PlacementVersion v, GenerationState s) {
    if (c_.executor->Trial().version == v.value()) c_.executor->SetTrial(-1, 0, 0);  // no longer a candidate
    return s == GenerationState::kActive ? absl::OkStatus() : c_.registry->Activate(v);
  });
}

grpc::Status RankAgentServiceImpl::StopDispatch(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                                v1::GenerationStatus* resp) {
  return Change(ctx, *req, resp, [&](PlacementVersion v, GenerationState s) {
    return s == GenerationState::kActive ? c_.registry->StopDispatch(v) : absl::OkStatus();
  });
}

grpc::Status RankAgentServiceImpl::RetireGeneration(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                                    v1::GenerationStatus* resp) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  {
    // A generation this rank never held (it restarted or replaced a lost rank after the placement
    // was prepared elsewhere) holds nothing here: retired already, so a rollback or a drain that
    // retires it everywhere can finish.
    absl::MutexLock lock(&mu_);
    if (req->version() > 0 &&
        c_.registry->State(PlacementVersion(req->version())).status().code() == absl::StatusCode::kNotFound) {
      resp->set_version(req->version());
      resp->set_state(v1::GENERATION_STATE_RETIRED);
      return grpc::Status::OK;
    }
  }
  // Steps answered before their GPU work finished hold their leases until it has: v's are waited
  // for first (bounded by the collective timeout), outside the agent's lock, and only where the
  // registry could retire v (not ACTIVE, and no trial adding steps of v); then it decides.
  if (req->version() > 0) {
    AwaitAnsweredSteps(PlacementVersion(req->version()), [](GenerationState s) {
      return s != GenerationState::kActive && s != GenerationState::kRetired;
    });
  }
  return Change(ctx, *req, resp, [&](PlacementVersion v, GenerationState s) {
    if (s == GenerationState::kRetired) return absl::OkStatus();
    absl::Status retired = c_.registry->Retire(v);
    if (!retired.ok()) return retired;  // still held: its trial (if any) goes on as it was
    if (c_.executor->Trial().version == v.value()) c_.executor->SetTrial(-1, 0, 0);
    c_.executor->DropGeneration(v);
    return retired;
  });
}

void RankAgentServiceImpl::AwaitAnsweredSteps(PlacementVersion v, absl::FunctionRef<bool(GenerationState)> takes) {
  absl::StatusOr<GenerationState> state = c_.registry->State(v);
  if (!state.ok() || !takes(*state) || c_.executor->Trial().version == v.value()) return;
  c_.executor->AwaitAnsweredGeneration(v).IgnoreError();
}

grpc::Status RankAgentServiceImpl::DiscardGeneration(grpc::ServerContext* ctx, const v1::GenerationRequest* req,
                                                     v1::GenerationStatus* resp) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  if (req->version() <= 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "version: must be positive");
  const PlacementVersion v(req->version());
  // As RetireGeneration: v's answered trial steps first, outside the lock.
  AwaitAnsweredSteps(v, [](GenerationState s) { return s == GenerationState::kPrepared; });
  absl::MutexLock lock(&mu_);
  // A discard that waited here behind a load, and whose caller gave up meanwhile, must not remove
  // what a retried load may have prepared since.
  if (ctx->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "version: the discard's caller left before it ran");
  }
  resp->set_version(v.value());
  auto state = c_.registry->State(v);
  if (state.status().code() == absl::StatusCode::kNotFound) return grpc::Status::OK;  // nothing held here
  if (!state.ok()) return VersionRefused(state.status());
  if (c_.executor->Trial().version == v.value()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, absl::StrCat("version: placement-v", v.value(),
                                                                            " is this rank's trial candidate; stop the "
                                                                            "trial first"));
  }
  if (absl::Status s = c_.registry->Discard(v); !s.ok()) return VersionRefused(s);
  c_.executor->DiscardGeneration(v);
  {
    absl::MutexLock summary_lock(&summary_mu_);
    materialized_.erase(v.value());
  }
  spdlog::info("placement-v{} discarded: prepared, never served", v.value());
  return grpc::Status::OK;
}

grpc::Status RankAgentServiceImpl::SetTrial(grpc::ServerContext* ctx, const v1::TrialRequest* req,
                                            v1::TrialRequest* resp) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  if (req->version() < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "version: must be >= 0");
  if (req->stop_version() < 0 || (req->stop_version() > 0 && req->version() != 0)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "stop_version: must be >= 0, and only with version 0 (a stop)");
  }
  if (req->shadow_every() < 0 || req->canary_every() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "shadow_every / canary_every: must be >= 0");
  }
  absl::MutexLock lock(&mu_);
  if (req->version() > 0 && c_.registry->ActiveVersion() == req->version()) {
    c_.executor->SetTrial(-1, 0, 0);  // it already serves here: nothing to try
  } else if (req->version() > 0) {
    auto state = c_.registry->State(PlacementVersion(req->version()));
    if (!state.ok() || *state != GenerationState::kPrepared) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("version: placement-v", req->version(), " is ",
                                       state.ok() ? GenerationStateName(*state) : "unknown", " on rank ",
                                       c_.rank.value(), "; trials run on a PREPARED candidate"));
    }
    c_.executor->SetTrial(req->version(), req->shadow_every(), req->canary_every());
  } else if (req->stop_version() == 0 || c_.executor->Trial().version == req->stop_version()) {
    c_.executor->SetTrial(-1, 0, 0);
  }  // (else a stop of another generation's trial: the one running stays)
  const LayerExecutor::TrialConfig t = c_.executor->Trial();
  resp->set_version(std::max<int64_t>(t.version, 0));
  resp->set_shadow_every(t.shadow_every);
  resp->set_canary_every(t.canary_every);
  return grpc::Status::OK;
}

grpc::Status RankAgentServiceImpl::Status(grpc::ServerContext* ctx, const v1::AgentStatusRequest*,
                                          v1::AgentStatusResponse* resp) {
  if (grpc::Status s = CheckBearer(ctx, c_.token); !s.ok()) return s;
  // Leases of answered steps whose work has finished go back first, so that an idle rank's
  // refcounts (what a drain waits on) count only work still running.
  c_.executor->ReleaseFinishedWork();
  resp->set_rank(c_.rank.value());
  resp->set_active_version(c_.registry->ActiveVersion());
  resp->set_kernel_build(c_.runtime.kernel_build());
  if (c_.checkpoint != nullptr) resp->set_checkpoint_version(c_.checkpoint->version());
  if (auto m = c_.executor->Membership(); m.has_value()) {
    resp->set_process_group_epoch(m->second.epoch().value());
    resp->set_node(m->first.NodeName(m->first.NodeOf(c_.rank)));
  }
  for (int64_t n : c_.executor->ExpertLoad()) resp->add_expert_routes(n);
  const LayerExecutor::TrialConfig t = c_.executor->Trial();
  resp->mutable_trial()->set_version(std::max<int64_t>(t.version, 0));
  resp->mutable_trial()->set_shadow_every(t.shadow_every);
  resp->mutable_trial()->set_canary_every(t.canary_every);
  for (const auto& [version, c] : c_.executor->Counters()) {
    *resp->add_counters() = GenerationCountersToProto(version, c);
  }
  const std::map<int64_t, std::vector<int64_t>> layer_load = c_.executor->LayerExpertLoad();
  for (const GenerationInfo& g : c_.registry->List()) {
    Fill(g, resp->add_generations());
    if (g.state != GenerationState::kActive) continue;
    for (PhysicalSlotId q : g.manifest->LocalSlots(c_.rank)) {
      resp->add_active_slot_experts(g.manifest->slot(q).expert.value());
    }
    for (size_t i = 0; i < g.manifest->layers().size(); ++i) {
      const int64_t layer = g.manifest->layers()[i];
      v1::LayerLoad* out = resp->add_layers();
      out->set_layer(layer);
      auto load = layer_load.find(layer);
      for (int e = 0; e < g.manifest->num_experts(); ++e) {
        out->add_expert_routes(
            load == layer_load.end() || e >= static_cast<int>(load->second.size()) ? 0 : load->second[e]);
      }
      const PlacementManifest& table = g.manifest->LayerAt(static_cast<int>(i));
      for (PhysicalSlotId q : table.LocalSlots(c_.rank)) out->add_active_slot_experts(table.slot(q).expert.value());
    }
  }
  return grpc::Status::OK;
}

}  // namespace moe
