#include "server/group_member.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

#include "rpc/group_protocol.h"

namespace moe {

GroupMember::GroupMember(GroupMemberOptions options) : options_(std::move(options)) {
  std::random_device rd;
  const uint64_t incarnation =
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(absl::GetCurrentTimeNanos());
  options_.join.set_incarnation(incarnation == 0 ? 1 : incarnation);
  if (options_.credentials == nullptr) options_.credentials = grpc::InsecureChannelCredentials();
}

GroupMember::~GroupMember() { Stop(); }

void GroupMember::Start() {
  thread_ = std::thread([this] { Run(); });
}

void GroupMember::Stop() {
  stopping_ = true;
  {
    absl::MutexLock lock(&mu_);
    if (ctx_ != nullptr) ctx_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

void GroupMember::Run() {
  grpc::ChannelArguments args;
  // A controller host that went away is noticed within seconds, not at the next TCP timeout.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A restarted controller is reached within about a second (gRPC's default backoff grows to two
  // minutes), well inside the controller's window for adopting the epoch the ranks serve.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  auto channel = grpc::CreateCustomChannel(options_.controller, options_.credentials, args);
  auto stub = v1::ProcessGroupService::NewStub(channel);
  std::string last;
  while (!stopping_) {
    bool fenced = false;
    const grpc::Status s = Session(*stub, &fenced);
    if (stopping_) break;
    if (fenced) {
      spdlog::error("process group: controller {} refused this process for good ({}); it no longer serves or rejoins",
                    options_.controller, s.error_message());
      serving_epoch_ = 0;
      fenced_ = true;
      if (options_.fenced) options_.fenced(s.error_message());
      return;
    }
    const std::string why = absl::StrCat(s.error_code(), ": ", s.error_message());
    if (why != last) {
      spdlog::warn("process group: controller {}: stream ended ({}); serving epoch {} meanwhile, reconnecting",
                   options_.controller, why, serving_epoch_.load());
    }
    last = why;
    absl::SleepFor(options_.reconnect_backoff);
  }
}

grpc::Status GroupMember::Session(v1::ProcessGroupService::Stub& stub, bool* fenced) {
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", absl::StrCat("Bearer ", options_.token));
  ctx.set_wait_for_ready(true);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return grpc::Status(grpc::StatusCode::CANCELLED, "stopping");
    ctx_ = &ctx;
  }
  struct Clear {
    GroupMember* m;
    ~Clear() {
      absl::MutexLock lock(&m->mu_);
      m->ctx_ = nullptr;
    }
  } clear{this};
  std::unique_ptr<Stream> stream = stub.Join(&ctx);
  {
    absl::MutexLock lock(&write_mu_);
    stream_ = stream.get();
  }
  // No writer may use the stream once it is finished.
  auto finish = [&] {
    {
      absl::MutexLock lock(&write_mu_);
      stream_ = nullptr;
    }
    grpc::Status s = stream->Finish();
    const auto& trailers = ctx.GetServerTrailingMetadata();
    *fenced =
        !s.ok() && trailers.find(grpc::string_ref(kFencedTrailer.data(), kFencedTrailer.size())) != trailers.end();
    return s;
  };
  v1::MemberMessage hello;
  *hello.mutable_join() = options_.join;
  hello.mutable_join()->set_serving_epoch(serving_epoch_.load());
  if (!Write(hello)) return finish();
  v1::GroupMessage m;
  while (stream->Read(&m)) {
    if (m.has_prepare()) {
      const int64_t epoch = m.prepare().epoch();
      serving_epoch_ = 0;
      absl::StatusOr<std::string> endpoint = options_.prepare(m.prepare());
      v1::MemberMessage out;
      if (endpoint.ok()) {
        out.mutable_endpoint()->set_epoch(epoch);
        out.mutable_endpoint()->set_endpoint(*endpoint);
      } else {
        spdlog::error("process group: preparing epoch {}: {}", epoch, std::string(endpoint.status().message()));
        out.mutable_ready()->set_epoch(epoch);
        out.mutable_ready()->set_ok(false);
        out.mutable_ready()->set_error(std::string(endpoint.status().message()));
      }
      if (!Write(out)) break;
    } else if (m.has_formed()) {
      const int64_t epoch = m.formed().epoch();
      const absl::Status s = options_.connect(m.formed());
      v1::MemberMessage out;
      out.mutable_ready()->set_epoch(epoch);
      out.mutable_ready()->set_ok(s.ok());
      if (s.ok()) {
        serving_epoch_ = epoch;
      } else {
        spdlog::error("process group: joining epoch {}: {}", epoch, std::string(s.message()));
        out.mutable_ready()->set_error(std::string(s.message()));
      }
      if (!Write(out)) break;
    } else if (m.has_serving()) {
      if (m.serving().epoch() == serving_epoch_.load() && options_.serve) options_.serve(m.serving().epoch());
    }
  }
  return finish();
}

bool GroupMember::Write(const v1::MemberMessage& m) {
  absl::MutexLock lock(&write_mu_);
  return stream_ != nullptr && stream_->Write(m);
}

void GroupMember::ReportFault(int64_t epoch, const std::string& why) {
  // The epoch no longer serves here: a rejoin (after a controller restart, or if this report is
  // lost with the stream) declares none, so the controller forms a new epoch instead of adopting
  // this broken one.
  int64_t expected = epoch;
  if (epoch == 0 || !serving_epoch_.compare_exchange_strong(expected, 0)) return;
  spdlog::warn("process group: epoch {}'s data plane failed ({}); asking the controller for a new epoch", epoch, why);
  v1::MemberMessage out;
  out.mutable_ready()->set_epoch(epoch);
  out.mutable_ready()->set_ok(false);
  out.mutable_ready()->set_error(absl::StrCat("data plane failed: ", why.substr(0, 400)));
  if (!Write(out)) spdlog::warn("process group: the report of epoch {}'s failure did not reach the controller", epoch);
}

}  // namespace moe
