// One rank's side of a layer step (spec 0x03, 0x06H, DESIGN "data flow of one layer step"), in
// the named phases of runtime/exec/step.h, each timed in the step's record:
//
//   validate   the input, sealed as a semantic handoff
//   acquire    the ACTIVE generation (or the trial candidate) pinned by a dispatch handle
//   plan       replica selection, the source plan
//   agree      header + count agreement with every peer (abort before payload on any
//              disagreement); decode-graph admission over the agreed counts
//   dispatch   inverse coordinates, slot metadata, the receive plan, all-to-all-v of rows
//   experts    receive repack by physical slot, SwiGLU experts, inverse repack
//   return     all-to-all-v back (splits reversed)
//   combine    gate-weighted combine in FP32
//   release    the handle released
//
// Every member of the process group must call Execute for every step, in the same order, with
// the same step id and layer (a rank with no tokens calls it with T = 0). The engine's rows are
// BF16 host memory; the kernels object decides where experts run: the CPU reference in CPU
// builds, the GPU with CUDA kernels, which keep every row payload (packed, exchanged,
// repacked, expert outputs, returned) and the weights in device memory and need a transport
// that moves device memory (NCCL). Only the input rows, the index tables and the combined
// output cross PCIe.
//
// Thread-safety: Execute calls are serialized by the caller (one step at a time per rank).
#ifndef MOE_RUNTIME_EXEC_LAYER_EXECUTOR_H_
#define MOE_RUNTIME_EXEC_LAYER_EXECUTOR_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

#include "kernels/api.h"
#include "runtime/exec/decode_admission.h"
#include "runtime/exec/decode_graph.h"
#include "runtime/exec/recorded_work.h"
#include "runtime/exec/step.h"
#include "runtime/exec/step_exchange.h"
#include "runtime/exec/step_phases.h"
#include "runtime/placement/registry.h"
#include "runtime/placement/replica_selector.h"
#include "runtime/placement/topology.h"
#include "runtime/plan/route_plan.h"
#include "runtime/release/generation_counters.h"
#include "runtime/transport/transport.h"

namespace moe {

using WeightBuffer = std::vector<uint16_t, UninitializedAllocator<uint16_t>>;

// Weights of this rank's physical slots under one generation, in the manifest's local order,
// for every MoE layer it serves (the generation's layers), layer after layer.
struct LocalExperts {
  int d = 0;
  int d_ff = 0;
  // The MoE layers served, ascending; empty: one expert set serves every layer index.
  std::vector<int64_t> layers;
  WeightBuffer w_gate_up;  // [layers][L, 2 d_ff, d] BF16
  WeightBuffer w_down;     // [layers][L, d, d_ff] BF16

  int num_layers() const { return layers.empty() ? 1 : static_cast<int>(layers.size()); }
  // Position of `layer` in `layers` (0 when it is empty), -1 when it is not served.
  int LayerIndex(int64_t layer) const {
    if (layers.empty()) return 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      if (layers[i] == layer) return static_cast<int>(i);
    }
    return -1;
  }
  // Elements of one layer's gate_up block (all L slots); down's is half of it.
  size_t layer_gate_up_elems() const { return w_gate_up.size() / num_layers(); }
  size_t layer_down_elems() const { return w_down.size() / num_layers(); }
};

enum class ExpertDtype { kBf16, kFp8 };
// "bf16" / "fp8" (flags); INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<ExpertDtype> ParseExpertDtype(const std::string& text, const char* field);
const char* ExpertDtypeName(ExpertDtype dtype);

struct LayerExecutorOptions {
  Rank rank;
  // The process group's membership and transport. All three, or none: an executor made without
  // them is unbound (steps answer UNAVAILABLE) until Bind gives it the group's first epoch.
  std::optional<Topology> topology;
  std::optional<ProcessGroup> group;
  GenerationRegistry* registry = nullptr;     // not owned
  Transport* transport = nullptr;             // not owned; slot() must equal the rank's peer slot
  kernels::ExpertKernels* kernels = nullptr;  // not owned
  absl::Duration timeout = absl::Seconds(30);
  SelectorPolicy selector = SelectorPolicy::kLocalityFirst;
  // The decode bucket (graph manifest): tokens per rank and routes per physical slot a captured
  // graph admits. Admission runs on every decode step of a group of two or more (and of a lone
  // member with lone_member_graphs); graphs are captured and replayed only where the kernels are
  // device-resident and `decode_graphs` is set (CUDA + NCCL), elsewhere the step runs eagerly
  // and reports why (stable_buffer_unavailable).
  int64_t decode_rank_tokens = 8;
  int64_t decode_slot_routes = 16;
  // The decode steps' expert runner (decode kernels or padded GEMMs): of the bucket's graph
  // (ChoosePaddedRunner), and of a lone member's eager decode steps (with every slot's routes
  // known: padded at the largest count when forced, or where kernels::PaddedDecodeCapacity says
  // it pays). Members with different settings serve eagerly (graph_key_mismatch). Kernels by
  // default: with the padded runner the two-H200 local cluster's eager prefill steps took
  // 764-955 us of executor time against 606-616 (unexplained, bench/RESULTS.md).
  DecodeRunner decode_runner = DecodeRunner::kKernels;
  DecodeGraphFactory decode_graphs;
  // A lone member (a group of one rank) serves its decode steps with the one-call local layer
  // (ExpertKernels::LocalLayer), whose fused one-token kernels run only eagerly and beat its
  // graph: no admission runs, and such a step is neither a replay nor a fallback. True: lone
  // members admit decode steps to the bucket's graph as a group does (tests of the graph on one
  // GPU).
  bool lone_member_graphs = false;
  // Fault injection (tests of the 0x0E "runner parity differs -> block canary" row): outputs of
  // trial passes (shadow and canary steps of a candidate) are scaled by this factor on this rank,
  // as a candidate runner that computes something else would. 1 = off.
  float fault_trial_output_scale = 1.0f;
  // Fault injection (tests of the 0x0E "inverse permutation is corrupt -> reject output before
  // publish" row): the combine tables of this rank's host-planned steps have two routes of
  // different tokens swapped, as a corrupted inverse would. Such a step runs its exchanges with
  // its peers (who serve theirs), combines nothing into its output (an eager step; a replayed
  // graph combines inside the graph) and answers DATA_LOSS. False = off.
  bool fault_swap_combine_routes = false;
  // Device planning of prefill steps: the routes are keyed, checked and ranked into the send
  // order by the kernels (SealRoutes, RankByKey) where the rows are, and the receive side ranks
  // the arrived slot metadata there too, so the host handles no per-route data: it reads back
  // the counts per slot, agrees on them and sizes the exchanges. Steps where replica selection
  // depends on the step (StaticSlotChoice: load-aware ties, hashing, round-robin), trial and
  // shadow passes, and decode steps keep the host plan (but see lone_decode_on_kernels). Results
  // and records are the host plan's; members may differ in this setting.
  bool device_plan = false;
  // With device_plan: a lone member's BF16 decode steps whose routing is in kernel memory are
  // planned there too, their fused layer enqueued before the host reads the checks back
  // (LoneDecodePhase). False: such steps copy their routing to the host and plan there.
  bool lone_decode_on_kernels = true;
  // Such steps' GPU work (the checks, their read-back, the layer in stages) recorded once per
  // step shape and buffers and launched again in one call where the kernels record work (CUDA
  // graphs; RecordedWork): a key's first step runs eagerly, its second is recorded. False: every
  // step enqueues its calls one by one.
  bool lone_decode_graphs = true;
  // How many such recordings are kept (RecordedWork's policy): one per layer, token count
  // and engine slot (every pointer the step's calls are given is in its key), so a model of L MoE
  // layers whose engine cycles S ring slots over B token counts needs L * S * B to keep them all.
  // In [1, 65536].
  int lone_decode_recordings = 1024;
  // The precision the experts run in. kFp8: each generation's weights are quantized when it is
  // added (E4M3, one FP32 scale per 128 x 128 block: DeepSeek-V3's checkpoint format; an FP8
  // checkpoint's weights come back to the same bytes, see docs/kernels.md) and only the FP8
  // copy is kept where the kernels run (half the BF16 bytes); the experts are
  // ExpertKernels::SwigluFp8 (rows quantized per 128 values on the fly). The host copy stays
  // BF16 (migration, digests). Needs d and d_ff multiples of 128 (and what the kernels take:
  // CUDA's Hopper kernels, d a multiple of 256), checked when a generation is added. Decode
  // graphs gather the rows, then run SwigluFp8 (no padded runner); a lone member's decode
  // steps take the eager path of prefill (LocalLayer is BF16).
  ExpertDtype expert_dtype = ExpertDtype::kBf16;
};

class LayerExecutor {
 public:
  static absl::StatusOr<std::unique_ptr<LayerExecutor>> Create(LayerExecutorOptions options);

  // Registers the weights this rank holds under a generation (before it is activated).
  // Safe while steps run; a step keeps the weights it started with until it ends.
  absl::Status AddGeneration(PlacementVersion version, std::shared_ptr<const LocalExperts> experts);
  // The host copy of a generation's weights (null when the executor holds none for it).
  std::shared_ptr<const LocalExperts> HostWeights(PlacementVersion version) const;
  // Frees a retired generation's weights and plan layout (steps still using them hold a reference).
  void DropGeneration(PlacementVersion version);
  // DropGeneration for a generation discarded before it served (it may be prepared again, with
  // other slots): its step counters go too, so that no earlier trial's counts reach the next
  // preparation's promotion evidence.
  void DiscardGeneration(PlacementVersion version);

  // Admitted routes this rank's tokens sent to each logical expert since start (EPLB's input),
  // summed over the layers, and per layer (the layer index the steps named).
  std::vector<int64_t> ExpertLoad() const;
  std::map<int64_t, std::vector<int64_t>> LayerExpertLoad() const;
  // The lone decode steps' recorded work (LayerExecutorOptions::lone_decode_graphs). Read between
  // steps (Execute's callers serialize them).
  const RecordedWork::Stats& LoneDecodeRecordings() const { return lone_recorded_.stats(); }

  // Host memory that steps' rows will be read from and written to (a step ring): made reachable
  // by the kernels' copies without staging where they are device-resident (a no-op elsewhere).
  // The caller keeps it mapped until UnregisterHostMemory.
  absl::Status RegisterHostMemory(void* p, int64_t bytes);
  void UnregisterHostMemory(void* p);
  // An engine's GPU allocation exported with CUDA IPC, for steps whose rows stay there
  // (LayerStepInput::rows_on_device): mapped until CloseDeviceRows(base). FAILED_PRECONDITION
  // when the rank's kernels are not device-resident.
  absl::StatusOr<kernels::ExpertKernels::IpcMapping> OpenDeviceRows(const std::string& ipc_handle);
  void CloseDeviceRows(void* base);
  // The engine's interprocess event (CUDA IPC) that a step waits for before it touches the
  // engine's memory. WaitReadyEvent polls it from the host for at most the collective timeout
  // (DEADLINE_EXCEEDED after that: an engine whose GPU work never finishes cannot hold the rank).
  // FAILED_PRECONDITION without device kernels.
  absl::StatusOr<void*> OpenReadyEvent(const std::string& ipc_handle);
  void CloseReadyEvent(void* event);
  absl::Status WaitReadyEvent(void* event);
  // An interprocess event of the rank's for an engine to wait on (LayerStepInput::done_event),
  // its 64-byte CUDA IPC handle in `handle`; destroyed with CloseReadyEvent, which waits for
  // the work of the steps answered with it first (AwaitDoneEvent).
  // FAILED_PRECONDITION without device kernels.
  absl::StatusOr<void*> CreateDoneEvent(std::string* handle);

  // A step with a done event answers once its GPU work is enqueued, and that work reads the
  // generation's weights and writes the engine's memory after the answer. Such a step keeps its
  // generation lease (spec 0x06B: released at 7, dispatch_state_releasable) until the event
  // shows the work finished, so a retirement cannot free the weights under it.
  // ReleaseFinishedWork returns the leases of the steps whose work has finished and answers how
  // many are still held (a query: it never blocks); each step does it before it acquires its
  // generation (AwaitAnsweredStep).
  int ReleaseFinishedWork();
  // Waits, for at most the collective timeout, until no answered step's GPU work is running
  // (before a generation retires, and when the executor goes); DEADLINE_EXCEEDED naming how many
  // still run, their leases still held.
  absl::Status AwaitAnsweredWork();
  // The same for the steps answered with `event` (CloseReadyEvent does it before the event is
  // destroyed). At the timeout their leases are returned anyway, since the event is about to go
  // (DEADLINE_EXCEEDED says so).
  absl::Status AwaitDoneEvent(void* event);
  // Several events' steps in one wait, bounded by one timeout (a ring's done events, before the
  // ring closes them: their waits one after the other could last the timeout each). Unlike
  // AwaitDoneEvent, at the timeout the leases stay held: the caller then keeps the events (and
  // the memory the work writes) instead of closing them under running work.
  absl::Status AwaitDoneEvents(absl::Span<void* const> events);
  // The same for an earlier step of this id (the registry holds one lease an id): each step
  // waits so before it acquires its generation; at the timeout its lease stays held.
  absl::Status AwaitAnsweredStep(HandleId id);
  // The same for the steps of one generation (before it retires or is discarded: steps of the
  // active one go on answering meanwhile, so waiting for all of them could last the timeout).
  absl::Status AwaitAnsweredGeneration(PlacementVersion version);
  // The answered steps' leases as the last step left them, and the steps that found
  // kMaxAnswered of them held: each such step waits (before it returns) for the oldest work to
  // finish, up to the collective timeout; `cap_timeouts` of them waited that long, their leases
  // still held (an engine that never lets its GPU work finish, or never waits on its events).
  struct AnsweredStats {
    int64_t held = 0;
    int64_t cap_waits = 0;
    int64_t cap_timeouts = 0;
  };
  AnsweredStats AnsweredWorkStats() const {
    return AnsweredStats{answered_count_.load(std::memory_order_relaxed), cap_waits_.load(std::memory_order_relaxed),
                         cap_timeouts_.load(std::memory_order_relaxed)};
  }
  static constexpr int kMaxAnswered = 256;
  ~LayerExecutor();
  // The NaN/Inf scan of `n` BF16 values in device memory (ExpertKernels::StartFindNonFiniteBf16
  // on the step stream): Start enqueues it, Finish waits and returns the first bad index or -1.
  // Callers serialize steps (one scan in flight).
  absl::Status StartDeviceRowCheck(const uint16_t* x, int64_t n, kernels::Stream stream = nullptr);
  absl::StatusOr<int64_t> FinishDeviceRowCheck();

  // Hands a step's output buffer back once the caller is done with it: the next step writes its
  // rows there instead of allocating (and faulting in) a new one.
  void RecycleOutput(RowBuffer buffer);

  // Runs the step on the ACTIVE generation, or on the trial candidate for canary steps; on
  // sampled shadow steps also runs it on the candidate and compares (the engine gets the active
  // result). Trial passes are collective like the step itself: every member decides from the
  // step id and the agreed header, never alone.
  absl::StatusOr<LayerStepResult> Execute(const LayerStepInput& input);

  // The candidate for trial steps (a PREPARED generation; -1 stops trials): every
  // shadow_every-th step also runs on it, every canary_every-th step is served by it (0: never).
  void SetTrial(int64_t version, int64_t shadow_every, int64_t canary_every);
  struct TrialConfig {
    int64_t version = -1;
    int64_t shadow_every = 0;
    int64_t canary_every = 0;
  };
  TrialConfig Trial() const;
  // Steps aborted for count conservation (GenerationCounters::count_failures) per process-group
  // epoch they ran in: spec 0x0DB's count-conservation counter.
  std::map<int64_t, int64_t> CountConservationFailures() const;
  std::map<int64_t, GenerationCounters> Counters() const;
  // Shadow passes run as step id + this offset (their own handle ids and transport sequence).
  static constexpr uint64_t kShadowStepOffset = uint64_t{1} << 56;
  // Relative L2 difference above which a shadow output counts as a mismatch.
  static constexpr double kShadowTolerance = 1e-2;

  // Process-group epochs (spec 0x07G). Unbind stops the data plane: new steps (and Reject)
  // answer UNAVAILABLE with `why` (which names the epoch being left), the transport is
  // interrupted so a step in flight ends at once, and Unbind returns once no step runs; the
  // transport may then be destroyed. Bind serves a new epoch: `transport` (not owned) for
  // `group`, whose member this rank is; every generation in the registry is rebound to the group
  // (PlacementManifest::Rebound) and the plan layouts and decode graphs of the old one are
  // dropped. On error the executor stays unbound. With `open` false the epoch is bound but steps
  // answer UNAVAILABLE until Open(epoch): a group opens an epoch once every member has bound it.
  // Meanwhile each refused step is abandoned on the transport (Transport::AbandonStep), so that
  // members that already opened the epoch abort it at once instead of waiting out the
  // collective timeout for this one.
  void Unbind(const std::string& why);
  absl::Status Bind(Transport* transport, const Topology& topology, const ProcessGroup& group,
                    DecodeGraphFactory decode_graphs, bool open = true);
  // Opens the bound epoch `epoch` for steps; false when another epoch (or none) is bound.
  bool Open(int64_t epoch);
  // The bound epoch's membership (none while unbound).
  std::optional<std::pair<Topology, ProcessGroup>> Membership() const;
  // Called (on the failing step's thread, once per bound epoch) when a step failed and left the
  // transport failed (Transport::failed: a peer it can no longer reach in this epoch, so every
  // later step would fail too): the data plane's report that the epoch is broken, for the group
  // to re-form. `why` is the step's error. Not called for steps a Unbind interrupted.
  using EpochFaultListener = std::function<void(int64_t epoch, const std::string& why)>;
  void SetEpochFaultListener(EpochFaultListener listener);

  // For a step this member cannot run (its request was rejected before Execute, e.g. at the RPC
  // edge): joins the step's agreement with the abort flag so every peer aborts at once, and
  // returns `why` unchanged.
  absl::Status Reject(uint64_t step_id, int64_t layer, absl::Status why);

 private:
  explicit LayerExecutor(LayerExecutorOptions options) : options_(std::move(options)) {}
  struct PassOptions {
    int64_t trial_version = -1;                     // >= 0: run on this PREPARED candidate instead of the ACTIVE one
    bool shadow_pass = false;                       // a shadow pass (not counted in the expert load)
    int64_t shadow_version = -1, shadow_every = 0;  // the shadow proposal in the step header
  };
  // What a pass tells its caller beside its result.
  struct PassOutcome {
    int64_t agreed_shadow = -1;  // the shadow proposal the members agreed on (-1: none)
    // Refused before the agreement by the checks of the engine's input (its shape, ids, gates,
    // rows): the engine's fault, whichever generation would have served it (rejected_steps).
    bool input_refused = false;
  };
  // One pass of a step (the served pass, or a shadow pass): what its phases hand each other.
  struct Pass;
  struct ResidentExperts;
  absl::Status QuantizeGeneration(PlacementVersion version, ResidentExperts* r);
  absl::Status PackFp8Rows(Pass& pass, const int32_t* dest, int64_t n, kernels::KernelBuffer& out);
  int64_t DispatchRowBytes(const Pass& pass) const;
  absl::StatusOr<LayerStepResult> ExecuteBound(const LayerStepInput& input);
  absl::Status CheckBinding(const LayerExecutorOptions& o) const;
  absl::StatusOr<LayerStepResult> RunPass(const LayerStepInput& in, const PassOptions& po, PassOutcome* outcome);
  // The served pass's routes per logical expert are counted into buf_.step_load and added to the
  // layer's load (layer_load_) only once the step is served: a step aborted or failed, which the
  // engine retries, is not counted twice.
  std::vector<int64_t>& StepLoad(Pass& pass);
  void CommitLoad(const Pass& pass);
  // The phases in the order RunPass runs them (runtime/exec/step.h). Until the agreement, an
  // error is answered by Reject (every peer aborts too); after it, the step fails as it is.
  absl::Status ValidatePhase(Pass& pass);
  absl::Status StageRows(Pass& pass);
  absl::Status RoutingToHost(Pass& pass);
  // A group of one rank: every row goes to itself, so its steps run no exchange of rows.
  bool LoneMember() const { return options_.group->size() == 1; }
  absl::Status AcquirePhase(Pass& pass);
  absl::Status PlanPhase(Pass& pass);
  absl::Status AgreePhase(Pass& pass, int64_t* agreed_shadow);
  void AdmitDecode(Pass& pass) const;
  absl::Status DispatchPlanPhase(Pass& pass);
  // The device plan's halves of PlanPhase and DispatchPlanPhase (LayerExecutorOptions::device_plan).
  absl::Status DevicePlanPhase(Pass& pass);
  absl::Status RefreshDeviceTables(Pass& pass);
  absl::Status SealedRoutesStatus(Pass& pass, const int64_t* status, const PlacementManifest& m);
  // Polls `event` from the host for at most the collective timeout; DEADLINE_EXCEEDED names `work`.
  absl::Status WaitEvent(void* event, absl::string_view work);
  absl::Status RowsForKernels(Pass& pass);
  // The step's output buffer on the host when the caller gave none (recycled, not zeroed).
  void ReserveOutput(Pass& pass);
  absl::Status DeviceDispatchPlan(Pass& pass);
  // A layout's static slot choice in kernel memory (null when the host plan must run), for the
  // layer `table_layer` (TableLayer: -1 where the generation's layers share one slot table).
  struct DevicePlanTables;
  std::shared_ptr<const DevicePlanTables> DeviceTablesFor(PlacementVersion version, int64_t table_layer,
                                                          const std::shared_ptr<const PlacementManifest>& table);
  // The payload, eagerly: rows staged, then a lone member's decode step in one kernels call, or
  // dispatch, experts, return and combine as separate calls sized by this step.
  absl::Status EagerPayload(Pass& pass);
  absl::Status LocalLayerPhase(Pass& pass);
  absl::Status HandleThroughOneCall(Pass& pass);
  // A lone member's decode step with its routing in kernel memory, planned by the kernels (the
  // static replica choice) and enqueued before its checks come back (validate chose it).
  absl::Status LoneDecodePhase(Pass& pass);
  // Such a step's FP8 layer in stages (LocalLayer is BF16): the calls' parameters, over
  // buf_.lone_fp8, for the routes' local slots and gates LocalLayerParams names.
  struct FP8LoneLayer {
    kernels::RouteRowsParams route;
    kernels::PackFp8Params pack;
    kernels::SwigluFp8Params experts;
    kernels::CombineParams combine;
  };
  absl::Status PrepareFp8LoneLayer(Pass& pass, const kernels::LocalLayerParams& layer, int local_slots,
                                   FP8LoneLayer* f8);
  // Whether `in` may become such a step with its GPU work recorded (ValidatePhase decides).
  bool LoneDecodeEligible(const LayerStepInput& in, const PassOptions& po) const;
  absl::Status LoneDecodeSteps(Pass& pass);
  absl::Status DispatchRows(Pass& pass);
  absl::Status ExpertsPhase(Pass& pass);
  absl::Status ReturnAndCombine(Pass& pass);
  absl::StatusOr<uint16_t*> OutputRows(Pass& pass);
  absl::Status CopyOut(Pass& pass, const uint16_t* out);
  absl::Status ReleasePhase(Pass& pass);
  void Count(const absl::StatusOr<LayerStepResult>& r, const LayerStepInput& in, bool canary, bool input_refused);
  // Runs the sampled shadow pass of step `in` on `shadow` and counts whether it matches `served`.
  void RunShadow(const LayerStepInput& in, int64_t shadow, const absl::StatusOr<LayerStepResult>& served);
  absl::StatusOr<std::shared_ptr<DecodeStepGraph>> BucketGraph(const LayerStepInput& in, PlacementVersion version,
                                                               int64_t total_slots, int local_slots,
                                                               const std::shared_ptr<const ResidentExperts>& weights,
                                                               int layer_index);
  // The admitted decode step's payload through the bucket's graph (captured on first use).
  absl::Status ReplayDecode(const LayerStepInput& in, PlacementVersion version, int64_t total_slots,
                            const std::shared_ptr<const ResidentExperts>& weights, int layer_index,
                            const SourcePlan& source, const DestinationPlan& dest,
                            const std::vector<int32_t>& send_token, const std::vector<int32_t>& row_of_route,
                            const std::vector<float>& gates, uint16_t* out);

  LayerExecutorOptions options_;
  // The epoch gate: steps run only while bound; Unbind waits for in_flight_ to reach zero.
  mutable absl::Mutex gate_mu_;
  bool bound_ ABSL_GUARDED_BY(gate_mu_) = false;
  bool open_ ABSL_GUARDED_BY(gate_mu_) = false;  // bound and open for steps
  std::string unbound_why_ ABSL_GUARDED_BY(gate_mu_);
  int in_flight_ ABSL_GUARDED_BY(gate_mu_) = 0;
  EpochFaultListener fault_listener_ ABSL_GUARDED_BY(gate_mu_);
  bool fault_reported_ ABSL_GUARDED_BY(gate_mu_) = false;  // for the bound epoch
  bool device_ = false;                                    // the kernels keep rows in device memory
  bool graphs_ = false;                                    // decode steps admitted to a bucket replay its graph
  // Captured decode graphs by (placement version, d, k), with the weights they read.
  struct Graph {
    std::shared_ptr<const ResidentExperts> weights;
    std::shared_ptr<DecodeStepGraph> graph;
  };
  std::map<std::tuple<int64_t, int, int, int>, Graph> graphs_by_key_ ABSL_GUARDED_BY(generations_mu_);
  std::unique_ptr<ReplicaSelector> selector_;
  // Answered steps whose GPU work may still run, with their generation leases (ReleaseFinishedWork).
  struct AnsweredWork {
    void* done_event = nullptr;
    GenerationLease lease;
  };
  void HoldUntilDone(void* done_event, GenerationLease lease);
  // Waits for the answered steps that `which` picks (AwaitAnsweredWork); at the timeout, with
  // `return_at_timeout`, their leases are returned anyway.
  absl::Status AwaitAnswered(absl::FunctionRef<bool(const AnsweredWork&)> which, bool return_at_timeout);
  // Whether a step answers before its GPU work has finished (device rows with a done event).
  bool AnswersBeforeWork(const LayerStepInput& in) const {
    return device_ && in.rows_on_device && in.done_event != nullptr;
  }
  // A step the shadow may sample, served from private host copies of its rows and routing
  // (ExecuteBound): CopyForShadow fills them and answers the input to serve (`in` itself when a
  // copy fails or the sizes are past any the pass takes), WriteServedRows writes the served rows to the caller's memory
  // (and records its done event) once the shadow has compared them.
  struct ShadowCopies {
    LayerStepInput in;
    RowBuffer rows, output;
    std::vector<int32_t> ids;
    std::vector<float> weights;
  };
  const LayerStepInput& CopyForShadow(const LayerStepInput& in, ShadowCopies* copies);
  absl::Status WriteServedRows(const LayerStepInput& in, const RowBuffer& rows);
  // options_.kernels and options_.timeout, which Bind leaves as they are, for the answered-work
  // functions and WaitEvent, which other threads call while Bind may assign options_.
  kernels::ExpertKernels* event_kernels_ = nullptr;
  absl::Duration answered_timeout_;
  absl::Mutex answered_mu_;
  std::vector<AnsweredWork> answered_ ABSL_GUARDED_BY(answered_mu_);
  std::atomic<int> answered_count_{0};                   // answered_.size(), read without the lock by each step
  std::atomic<int64_t> cap_waits_{0}, cap_timeouts_{0};  // AnsweredWorkStats
  mutable absl::Mutex generations_mu_;
  // By layer (-1: the steps of generations that name no layers, LoadLayer).
  std::map<int64_t, int64_t> conservation_by_epoch_ ABSL_GUARDED_BY(generations_mu_);
  std::map<int64_t, std::vector<int64_t>> layer_load_ ABSL_GUARDED_BY(generations_mu_);
  SemanticHandoff spare_handoff_ ABSL_GUARDED_BY(generations_mu_);  // a finished step's columns, refilled by the next
  // A finished pass's agreement, its records and its byte splits, for the next pass to refill
  // (a step of the same shape then allocates none of them).
  struct PassSpares {
    StepAgreement agreement;
    AgreementScratch scratch;
    ByteSplits bytes;
    InverseCoordinates inverse;              // the host plan's, back from the step's handle
    std::unique_ptr<DispatchHandle> handle;  // the step's handle, Reset (its lease released)
  };
  PassSpares spare_pass_ ABSL_GUARDED_BY(generations_mu_);
  RowBuffer spare_output_ ABSL_GUARDED_BY(generations_mu_);  // RecycleOutput's buffer
  TrialConfig trial_ ABSL_GUARDED_BY(generations_mu_);
  std::map<int64_t, GenerationCounters> counters_ ABSL_GUARDED_BY(generations_mu_);
  std::map<int64_t, std::shared_ptr<const ResidentExperts>> experts_ ABSL_GUARDED_BY(generations_mu_);
  // By (version, layer index): per-layer generations plan each layer on its own slot table
  // (index -1 for generations whose layers share one).
  std::map<std::pair<int64_t, int>, std::shared_ptr<const PlanLayout>> layouts_ ABSL_GUARDED_BY(generations_mu_);
  // By (version, TableLayer): the device plan's tables, or null where the choice is not static.
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<const DevicePlanTables>> device_tables_
      ABSL_GUARDED_BY(generations_mu_);

  // Step buffers, reused across steps: steady-state steps allocate (and page-fault) nothing.
  struct Buffers {
    // Rows and the index tables the kernels read, in kernel memory (staged copies of host
    // tables exist only when that memory is the device's).
    kernels::KernelBuffer hidden, tables, send_rows, recv_rows, expert_in, expert_out, back_rows, returned, output;
    std::vector<uint8_t> tables_host;  // the step's tables in one block before their upload
    std::vector<int32_t> send_meta, recv_meta, row_of_route, local_ids;
    std::vector<uint8_t> combined_positions;  // CheckCombineTables' scratch
    std::vector<int64_t> local_slot_routes;   // a lone member's decode step: routes per local slot
    std::vector<float> gates;
    std::vector<PhysicalSlotId> slots, accepted_slots, received;
    std::vector<int32_t> accepted_ids;
    // Decode graph tables (bucket-shaped) and the padded position of each compact row.
    std::vector<int32_t> g_send_index, g_expert_rows, g_layout_row, g_row_of_route, pad_of_send, pad_of_recv;
    std::vector<float> g_gates;
    std::vector<int64_t> slot_counts;
    std::vector<int64_t> step_load;  // the served pass's routes per logical expert (StepLoad)
    SourcePlan source;
    DestinationPlan dest;
    // The device plan's step tables (kernel memory): keyed routes, gates, each route's send
    // position (the rows are scattered through it), the slot of each send position, the received
    // slots, their expert positions and order, and the counts, offsets and status read back.
    kernels::KernelBuffer d_keys, d_gates, d_row_of_route, d_send_meta, d_recv_meta, d_expert_position, d_expert_order,
        d_small;
    // A lone member's composed index (kernel memory): route -> expert position, where its row is
    // scattered and combined from.
    kernels::KernelBuffer d_lone_combine;
    // FP8 experts on a lone member: the step's tokens as packed rows in expert order
    // (PackFp8Rows).
    kernels::KernelBuffer fp8_rows;
    // A lone member's FP8 decode step planned on the kernels (LoneDecodeSteps): the local slots'
    // counts and offsets, each route's expert row, each row's token, the packed rows and the
    // experts' output rows, in one allocation.
    kernels::KernelBuffer lone_fp8;
    std::vector<int64_t> plan_small;             // d_small on the host
    kernels::RegisteredHostBuffer routing_host;  // LayerStepInput::routing_on_device copied for the host plan
    // LoneDecodePhase's read-back: status [2] (int64), then the keys [routes], as in d_small.
    kernels::RegisteredHostBuffer lone_host;
  };
  Buffers buf_;
  // Recorded after LoneDecodePhase's read-back, before its layer (device kernels; made once).
  struct OwnedEvent {
    kernels::ExpertKernels* kernels = nullptr;
    void* event = nullptr;
    OwnedEvent() = default;
    OwnedEvent(const OwnedEvent&) = delete;
    OwnedEvent& operator=(const OwnedEvent&) = delete;
    ~OwnedEvent() {
      if (event != nullptr) kernels->CloseIpcEvent(event);
    }
  };
  OwnedEvent checks_event_;
  // LoneDecodePhase's recorded work by step shape and buffers; before checks_event_ in
  // destruction (its recordings name that event).
  RecordedWork lone_recorded_{options_.kernels, options_.lone_decode_recordings};
};

}  // namespace moe

#endif  // MOE_RUNTIME_EXEC_LAYER_EXECUTOR_H_
