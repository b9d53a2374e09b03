#include "server/client.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "rpc/grpc_status.h"
#include "runtime/status.h"
#include "server/step_ring_layout.h"

namespace moe {
namespace {

constexpr std::chrono::milliseconds kReconnectGrace(1000);

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertLayerClient>> ExpertLayerClient::Connect(const std::string& address,
                                                                              absl::Duration timeout,
                                                                              const std::string& token,
                                                                              const TlsFiles& tls) {
  if (absl::Status s = CheckTlsFiles(tls); !s.ok()) return s;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  // A rank that restarts (a replacement on the same socket) is reached again within a second.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto channel = grpc::CreateCustomChannel(address, ChannelCredentials(tls), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                 std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)))) {
    return absl::UnavailableError(absl::StrCat(address, ": not reachable within ", absl::FormatDuration(timeout)));
  }
  return std::unique_ptr<ExpertLayerClient>(new ExpertLayerClient(channel, token));
}

absl::Status ExpertLayerClient::UseRing(const StepRingOptions& options) {
  if (options.device_rows.has_value()) {
    return absl::InvalidArgumentError(
        "device_rows: Execute copies host rows, so UseRing takes host rings; drive a device-rows ring from OpenRing");
  }
  ASSIGN_OR_RETURN(ring_, OpenRing(options));
  return absl::OkStatus();
}

absl::StatusOr<StepAnswer> ExpertLayerClient::Execute(const StepCall& call, absl::Duration deadline) {
  if (ring_ != nullptr) {
    const size_t rows = static_cast<size_t>(call.tokens) * call.d;
    const size_t routes = static_cast<size_t>(call.tokens) * call.k;
    const bool fits = call.tokens >= 0 && call.tokens <= ring_->max_tokens() && call.k >= 1 && call.k <= ring_->k() &&
                      call.d == ring_->d() && call.hidden.size() == rows && call.topk_ids.size() == routes &&
                      call.topk_weights.size() == routes && (call.admitted.empty() || call.admitted.size() == routes);
    if (fits) {
      absl::MutexLock lock(&ring_mu_);
      return ring_->Execute(call, deadline);
    }
  }
  v1::StepRequest req;
  req.set_step_id(call.step_id);
  req.set_layer(call.layer);
  req.set_phase(call.decode ? v1::PHASE_DECODE : v1::PHASE_PREFILL);
  v1::Tensor* h = req.mutable_hidden();
  h->set_dtype(v1::DTYPE_BF16);
  h->set_rows(call.tokens);
  h->set_cols(call.d);
  h->set_data(std::string(reinterpret_cast<const char*>(call.hidden.data()), call.hidden.size() * 2));
  *req.mutable_topk_ids() = {call.topk_ids.begin(), call.topk_ids.end()};
  *req.mutable_topk_weights() = {call.topk_weights.begin(), call.topk_weights.end()};
  req.set_k(call.k);
  if (call.expected_generation > 0) req.set_expected_generation(call.expected_generation);
  if (!call.admitted.empty()) req.set_admitted(std::string(call.admitted.begin(), call.admitted.end()));
  const auto until = std::chrono::system_clock::now() + std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline));
  // A rank that restarted (a replacement on the same address) is reconnected before the step goes
  // out: a call that failed here at once would never reach the rank, and its peers, which got the
  // step, would wait out their collective timeout for it. At most kReconnectGrace (the channel's
  // longest reconnect backoff); a rank that stays unreachable fails the call as before.
  if (channel_->GetState(/*try_to_connect=*/true) != GRPC_CHANNEL_READY) {
    channel_->WaitForConnected(std::min(until, std::chrono::system_clock::now() + kReconnectGrace));
  }
  grpc::ClientContext ctx;
  if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
  ctx.set_deadline(until);
  v1::StepResponse resp;
  const absl::Time start = absl::Now();
  const grpc::Status s = stub_->Execute(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  StepAnswer a;
  a.client_latency_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  const std::string& data = resp.output().data();
  if (resp.output().dtype() != v1::DTYPE_BF16 || data.size() != call.hidden.size() * 2) {
    return absl::DataLossError(absl::StrCat("output: ", data.size(), " bytes, expected ", call.hidden.size() * 2));
  }
  a.output.resize(call.hidden.size());
  std::memcpy(a.output.data(), data.data(), data.size());
  a.record = resp.record();
  return a;
}

namespace {

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// Claims ring `id` on the rank's ring socket: sends the id and ticket, receives the memfd.
// Returns the connection (kept open: it holds the ring) and the fd.
absl::Status ClaimRing(const std::string& path, uint64_t id, const std::string& ticket, int* conn, int* memfd) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path) || ticket.size() != 16) {
    return absl::InternalError("OpenStepRing: a bad socket path or ticket in the rank's answer");
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(Errno("ring socket"));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const std::string e = Errno(path.c_str());
    close(fd);
    return absl::UnavailableError(absl::StrCat("ring socket ", e));
  }
  char msg[24];
  std::memcpy(msg, &id, 8);
  std::memcpy(msg + 8, ticket.data(), 16);
  char reply = 0;
  int received = -1;
  if (send(fd, msg, sizeof(msg), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(msg)) ||
      !ring::ReceiveReply(fd, &reply, &received)) {
    close(fd);
    return absl::UnavailableError("ring socket: the rank closed the claim");
  }
  if (reply != 'K' || received < 0) {
    if (received >= 0) close(received);
    close(fd);
    return absl::PermissionDeniedError("ring socket: the rank refused the claim (ticket or uid)");
  }
  *memfd = received;
  *conn = fd;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepRing>> ExpertLayerClient::OpenRing(const StepRingOptions& options) {
  v1::OpenStepRingRequest req;
  req.set_slots(options.slots);
  req.set_max_tokens(options.max_tokens);
  req.set_d(options.d);
  req.set_k(options.k);
  const bool on_device = options.device_rows.has_value();
  ring::DeviceGeometry dg;
  if (on_device) {
    if (!ring::ComputeDeviceGeometry(options.max_tokens, options.d, options.k, options.slots, &dg)) {
      return absl::InvalidArgumentError("max_tokens: the ring's device slots overflow");
    }
    req.mutable_device_rows()->set_ipc_handle(options.device_rows->ipc_handle);
    req.mutable_device_rows()->set_offset(options.device_rows->offset);
    req.mutable_device_rows()->set_ready_event(options.device_rows->ready_event);
    req.mutable_device_rows()->set_done_events(options.device_rows->done_events);
  }
  v1::OpenStepRingResponse resp;
  grpc::ClientContext ctx;
  if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (grpc::Status s = stub_->OpenStepRing(&ctx, req, &resp); !s.ok()) return FromGrpcStatus(s);
  ring::Geometry g;
  if (resp.device_rows() != on_device) {
    return absl::FailedPreconditionError("OpenStepRing: the rank did not take the ring's device rows");
  }
  if (resp.done_events_size() != 0 &&
      (!on_device || !options.device_rows->done_events || resp.done_events_size() != options.slots)) {
    return absl::FailedPreconditionError(absl::StrCat("OpenStepRing: the rank sent ", resp.done_events_size(),
                                                      " done events for ", options.slots, " slots"));
  }
  if (resp.layout_version() != ring::kLayoutVersion ||
      !ring::ComputeGeometry(options.max_tokens, options.d, options.k, options.slots, &g, on_device) ||
      g.total_bytes != resp.bytes()) {
    return absl::FailedPreconditionError(absl::StrCat("OpenStepRing: the rank's ring layout ", resp.layout_version(),
                                                      " of ", resp.bytes(), " bytes is not this client's ",
                                                      ring::kLayoutVersion, " of ", g.total_bytes));
  }
  std::unique_ptr<StepRing> r(new StepRing());
  r->stub_ = stub_.get();
  r->id_ = resp.ring_id();
  int memfd = -1;
  RETURN_IF_ERROR(ClaimRing(resp.socket_path(), resp.ring_id(), resp.ticket(), &r->conn_, &memfd));
  struct stat st {};
  void* base = MAP_FAILED;
  if (fstat(memfd, &st) == 0 && static_cast<uint64_t>(st.st_size) == g.total_bytes) {
    base = mmap(nullptr, g.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  }
  close(memfd);
  if (base == MAP_FAILED) return absl::InternalError(Errno("mapping the step ring"));
  r->base_ = static_cast<char*>(base);
  r->bytes_ = g.total_bytes;
  const auto* h = reinterpret_cast<const ring::Header*>(base);
  if (h->magic != ring::kMagic || h->slot_bytes != g.slot_bytes || h->hidden_offset != g.hidden_offset ||
      ((h->flags & ring::kHeaderDeviceRows) != 0) != on_device) {
    return absl::FailedPreconditionError("step ring: the header does not match the layout this client expects");
  }
  r->slots_ = options.slots;
  r->max_tokens_ = options.max_tokens;
  r->d_ = options.d;
  r->k_ = options.k;
  r->spin_us_ = options.spin_us;
  r->device_rows_ = on_device;
  r->device_slot_bytes_ = dg.slot_bytes;
  r->slot_bytes_ = g.slot_bytes;
  r->hidden_off_ = g.hidden_offset;
  r->output_off_ = g.output_offset;
  r->ids_off_ = g.ids_offset;
  r->weights_off_ = g.weights_offset;
  r->admitted_off_ = g.admitted_offset;
  r->submit_times_.resize(options.slots);
  r->done_events_.assign(resp.done_events().begin(), resp.done_events().end());
  return r;
}

StepRing::~StepRing() {
  if (base_ != nullptr) munmap(base_, bytes_);
  if (conn_ >= 0) close(conn_);
}

char* StepRing::slot(uint32_t seq) const { return base_ + ring::kPage + (seq % slots_) * slot_bytes_; }

absl::StatusOr<StepRing::Slot> StepRing::NextSlot(absl::Duration deadline) {
  if (static_cast<int>(submitted_ - waited_) >= slots_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ring: ", slots_, " steps outstanding; Wait for one before the next"));
  }
  (void)deadline;  // the slot after the last waited-for step is free: nothing to wait for
  char* s = slot(submitted_);
  return Slot{device_rows_ ? nullptr : reinterpret_cast<uint16_t*>(s + hidden_off_),
              reinterpret_cast<int32_t*>(s + ids_off_),
              reinterpret_cast<float*>(s + weights_off_),
              reinterpret_cast<uint8_t*>(s + admitted_off_),
              device_rows_ ? nullptr : reinterpret_cast<const uint16_t*>(s + output_off_),
              device_rows_ ? (submitted_ % slots_) * device_slot_bytes_ : 0};
}

absl::Status StepRing::Submit(const StepMeta& meta) {
  if (static_cast<int>(submitted_ - waited_) >= slots_) {
    return absl::FailedPreconditionError(absl::StrCat("step ring: ", slots_, " steps outstanding"));
  }
  if (meta.tokens < 0 || meta.tokens > max_tokens_ || meta.k < 1 || meta.k > k_) {
    return absl::InvalidArgumentError(absl::StrCat("step ring: ", meta.tokens, " tokens of k = ", meta.k,
                                                   " do not fit slots of ", max_tokens_, " x k ", k_));
  }
  auto* h = reinterpret_cast<ring::Header*>(base_);
  if (h->closed.value.load(std::memory_order_acquire) != 0) {
    return absl::UnavailableError("step ring: the rank closed the ring");
  }
  if (meta.device_routing && !device_rows_) {
    return absl::InvalidArgumentError("device_routing: this ring has no device rows");
  }
  ring::Descriptor d{};
  d.seq = submitted_;
  d.flags = (meta.admitted ? ring::kFlagAdmitted : 0) | (meta.device_routing ? ring::kFlagDeviceRouting : 0);
  d.phase = meta.decode ? v1::PHASE_DECODE : v1::PHASE_PREFILL;
  d.k = meta.k;
  d.step_id = meta.step_id;
  d.layer = meta.layer;
  d.tokens = meta.tokens;
  d.expected_generation = meta.expected_generation;
  std::memcpy(slot(submitted_), &d, sizeof(d));
  submit_times_[submitted_ % slots_] = absl::Now();
  ++submitted_;
  h->submitted.value.store(submitted_, std::memory_order_seq_cst);
  if (h->rank_sleeping.value.load(std::memory_order_seq_cst) != 0) ring::FutexWake(&h->submitted.value);
  return absl::OkStatus();
}

absl::StatusOr<v1::StepRecord> StepRing::Wait(absl::Duration deadline, const uint16_t** output) {
  if (submitted_ == waited_) return absl::FailedPreconditionError("step ring: no step outstanding");
  auto* h = reinterpret_cast<ring::Header*>(base_);
  const uint32_t want = waited_ + 1;
  auto done = [&] { return static_cast<int32_t>(h->completed.value.load(std::memory_order_acquire) - want) >= 0; };
  const absl::Time start = absl::Now();
  const absl::Time spin_until = start + absl::Microseconds(spin_us_);
  const absl::Time until = start + deadline;
  while (!done()) {
    const absl::Time now = absl::Now();
    if (now < spin_until) continue;
    if (h->closed.value.load(std::memory_order_acquire) != 0 && !done()) {
      return absl::UnavailableError("step ring: the rank closed the ring");
    }
    if (now >= until) return absl::DeadlineExceededError("step ring: the step did not complete within the deadline");
    h->engine_sleeping.value.store(1, std::memory_order_seq_cst);
    const uint32_t seen = h->completed.value.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - want) < 0) {
      ring::FutexWait(&h->completed.value, seen, std::min<int64_t>(absl::ToInt64Nanoseconds(until - now), 100'000'000));
    }
    h->engine_sleeping.value.store(0, std::memory_order_relaxed);
  }
  const char* s = slot(waited_);
  ring::Result r;
  std::memcpy(&r, s + ring::kResultOffset, sizeof(r));
  const double client_us = absl::ToDoubleMicroseconds(absl::Now() - submit_times_[waited_ % slots_]);
  const uint32_t expected_seq = waited_;
  ++waited_;
  if (r.seq != expected_seq) {
    // Another step's answer in this step's slot: never hand it out as this step's.
    return absl::DataLossError(
        absl::StrCat("step ring: slot answers step ", r.seq, " where step ", expected_seq, " was awaited"));
  }
  if (r.code != 0) {
    r.message[sizeof(r.message) - 1] = '\0';
    return absl::Status(static_cast<absl::StatusCode>(r.code), r.message);
  }
  if (output != nullptr) *output = reinterpret_cast<const uint16_t*>(s + output_off_);
  v1::StepRecord rec;
  rec.set_placement_generation(r.placement_generation);
  rec.set_layer(r.layer);
  rec.set_path(static_cast<v1::ExecutionPath>(r.path));
  r.fallback_reason[sizeof(r.fallback_reason) - 1] = '\0';
  rec.set_fallback_reason(r.fallback_reason);
  rec.set_canary(r.canary != 0);
  rec.set_routes_attempted(r.routes_attempted);
  rec.set_routes_accepted(r.routes_accepted);
  rec.set_routes_dropped(r.routes_dropped);
  rec.set_routes_remote(r.routes_remote);
  rec.set_routes_inter_node(r.routes_inter_node);
  rec.set_server_latency_us(r.server_latency_us);
  rec.set_compute_latency_us(r.compute_latency_us);
  v1::StepStages* st = rec.mutable_stages();
  st->set_validate_us(r.stages_us[0]);
  st->set_acquire_us(r.stages_us[1]);
  st->set_plan_us(r.stages_us[2]);
  st->set_agree_us(r.stages_us[3]);
  st->set_dispatch_us(r.stages_us[4]);
  st->set_experts_us(r.stages_us[5]);
  st->set_return_us(r.stages_us[6]);
  st->set_combine_us(r.stages_us[7]);
  st->set_release_us(r.stages_us[8]);
  last_client_us_ = client_us;
  return rec;
}

absl::StatusOr<StepAnswer> StepRing::Execute(const StepCall& call, absl::Duration deadline) {
  if (device_rows_) {
    return absl::FailedPreconditionError(
        "step ring: a ring with device rows takes steps written into its device slots (NextSlot, Submit)");
  }
  const size_t rows = static_cast<size_t>(call.tokens) * call.d;
  const size_t routes = static_cast<size_t>(call.tokens) * call.k;
  if (call.d != d_ || call.hidden.size() != rows || call.topk_ids.size() != routes ||
      call.topk_weights.size() != routes || (!call.admitted.empty() && call.admitted.size() != routes)) {
    return absl::InvalidArgumentError(absl::StrCat("step ring: a call of ", call.tokens, " x d ", call.d,
                                                   " whose tables do not match it or the ring's d = ", d_));
  }
  if (call.tokens > max_tokens_ || call.k > k_) {
    return absl::InvalidArgumentError(absl::StrCat("step ring: ", call.tokens, " tokens of k = ", call.k,
                                                   " do not fit slots of ", max_tokens_, " x k ", k_));
  }
  ASSIGN_OR_RETURN(Slot slot, NextSlot(deadline));
  std::memcpy(slot.hidden, call.hidden.data(), rows * 2);
  std::memcpy(slot.topk_ids, call.topk_ids.data(), routes * 4);
  std::memcpy(slot.topk_weights, call.topk_weights.data(), routes * 4);
  if (!call.admitted.empty()) std::memcpy(slot.admitted, call.admitted.data(), routes);
  StepMeta meta;
  meta.step_id = call.step_id;
  meta.layer = call.layer;
  meta.decode = call.decode;
  meta.tokens = call.tokens;
  meta.k = call.k;
  meta.admitted = !call.admitted.empty();
  meta.expected_generation = call.expected_generation;
  RETURN_IF_ERROR(Submit(meta));
  const uint16_t* out = nullptr;
  ASSIGN_OR_RETURN(v1::StepRecord record, Wait(deadline, &out));
  StepAnswer a;
  a.client_latency_us = last_client_us_;
  a.output.assign(out, out + rows);
  a.record = std::move(record);
  return a;
}

absl::Status StepRing::Close() {
  v1::CloseStepRingRequest req;
  req.set_ring_id(id_);
  v1::CloseStepRingResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return FromGrpcStatus(stub_->CloseStepRing(&ctx, req, &resp));
}

}  // namespace moe
