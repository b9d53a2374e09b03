// A hostile engine for the hardening test (tests/integration/hardening_test.sh): each mode sends
// what an attacker or a broken engine could, to real moe-rankd processes, and exits 0 only when
// the ranks answered as docs/api.md and docs/security.md promise.
//   overflow UNIX_TARGET                 rows x cols x width and rows x k that wrap in 64 bits
//   bad_values T0 T1                     NaN / Inf BF16 rows and an unknown phase, sent to rank 0
//                                        while rank 1 gets the valid step
//   step_mismatch T0 T1                  step 10 to rank 0, step 11 to rank 1, concurrently
//   shrink T0 T1                         a registered region truncated before the step reads it
//   unauthenticated HOST:PORT            the TCP port without credentials: no step, no region,
//                                        no health, no reflection
//   grpc_ports PORT...                   prints how many of the ports answer gRPC at all
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <future>
#include <string>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>

#include "absl/strings/match.h"
#include "absl/time/clock.h"

#include "proto/moe/v1/expert_layer.grpc.pb.h"
#include "tests/server/step_request_builder.h"

namespace moe {
namespace {

constexpr int kD = 64, kK = 2, kTokens = 4, kExperts = 8;

v1::StepRequest Valid(uint64_t step) {
  return testing::ValidStepRequest(step, v1::PHASE_PREFILL, {kTokens, kD, kK, kExperts},
                                   [](int i) { return 0.01f * (i % 17); });
}

std::unique_ptr<v1::ExpertLayerService::Stub> Stub(const std::string& target) {
  return v1::ExpertLayerService::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
}

grpc::Status Execute(v1::ExpertLayerService::Stub& stub, const v1::StepRequest& req, int seconds = 30) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  v1::StepResponse resp;
  return stub.Execute(&ctx, req, &resp);
}

bool Expect(const char* what, const grpc::Status& s, grpc::StatusCode code, const std::string& text = "") {
  const bool ok = s.error_code() == code && absl::StrContains(s.error_message(), text);
  std::printf("%s %s: code %d, \"%s\"\n", ok ? "ok  " : "FAIL", what, static_cast<int>(s.error_code()),
              s.error_message().c_str());
  return ok;
}

int Overflow(const std::string& target) {
  auto stub = Stub(target);
  v1::StepRequest req = Valid(500);
  req.mutable_hidden()->set_rows(int64_t{1} << 62);
  req.mutable_hidden()->set_cols(2);
  req.mutable_hidden()->clear_data();
  req.clear_topk_ids();
  req.clear_topk_weights();
  req.set_k(4);
  bool ok = Expect("rows 2^62 x cols 2 x k 4 (wraps to 0 bytes, 0 routes)", Execute(*stub, req),
                   grpc::StatusCode::INVALID_ARGUMENT, "hidden.rows");
  req.mutable_hidden()->set_rows(int64_t{1} << 55);
  req.mutable_hidden()->set_cols(256);
  req.set_k(8);
  ok = Expect("rows 2^55 x cols 256 x 2 bytes", Execute(*stub, req), grpc::StatusCode::INVALID_ARGUMENT,
              "hidden.rows") &&
       ok;
  return ok ? 0 : 1;
}

// Rank 0 gets `bad`, rank 1 the valid step of the same id: rank 0 INVALID_ARGUMENT naming
// `field`, rank 1 ABORTED (rank 0 rejected its input).
bool RejectedWithPeer(const std::string& t0, const std::string& t1, const v1::StepRequest& bad, const char* what,
                      const char* field) {
  auto s0 = Stub(t0), s1 = Stub(t1);
  auto f0 = std::async(std::launch::async, [&] { return Execute(*s0, bad); });
  auto f1 = std::async(std::launch::async, [&] { return Execute(*s1, Valid(bad.step_id())); });
  bool ok = Expect(what, f0.get(), grpc::StatusCode::INVALID_ARGUMENT, field);
  return Expect("... its peer", f1.get(), grpc::StatusCode::ABORTED, "rejected its input") && ok;
}

int BadValues(const std::string& t0, const std::string& t1) {
  bool ok = true;
  uint64_t step = 40;
  for (uint16_t v : {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}}) {
    v1::StepRequest bad = Valid(step++);
    std::memcpy(&(*bad.mutable_hidden()->mutable_data())[2 * 5], &v, 2);
    ok = RejectedWithPeer(t0, t1, bad, "non-finite BF16 row value", "hidden.data[5]") && ok;
  }
  for (int phase : {0, 7}) {
    v1::StepRequest bad = Valid(step++);
    bad.set_phase(static_cast<v1::Phase>(phase));
    ok = RejectedWithPeer(t0, t1, bad, phase == 0 ? "phase unspecified" : "phase 7", "phase") && ok;
  }
  return ok ? 0 : 1;
}

int StepMismatch(const std::string& t0, const std::string& t1) {
  auto s0 = Stub(t0), s1 = Stub(t1);
  const absl::Time start = absl::Now();
  auto f0 = std::async(std::launch::async, [&] { return Execute(*s0, Valid(10)); });
  auto f1 = std::async(std::launch::async, [&] { return Execute(*s1, Valid(11)); });
  const grpc::Status a = f0.get(), b = f1.get();
  const double took = absl::ToDoubleSeconds(absl::Now() - start);
  bool ok = Expect("rank 0 (step 10)", a, grpc::StatusCode::ABORTED, "11");
  ok = Expect("rank 1 (step 11)", b, grpc::StatusCode::ABORTED, "10") && ok;
  ok = ok && absl::StrContains(a.error_message(), "10") && absl::StrContains(b.error_message(), "11");
  std::printf("%s both answered in %.2f s (collective timeout 10 s)\n", took < 3 ? "ok  " : "FAIL", took);
  return ok && took < 3 ? 0 : 1;
}

int Shrink(const std::string& t0, const std::string& t1) {
  const std::string name = "/moe-hostile-" + std::to_string(getpid());
  const size_t bytes = 2 * kTokens * kD * 2;
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, bytes) != 0) return 2;
  auto s0 = Stub(t0), s1 = Stub(t1);
  grpc::ClientContext rctx;
  v1::RegisterRegionRequest reg;
  reg.set_name(name);
  reg.set_bytes(bytes);
  v1::RegisterRegionResponse ignored;
  bool ok = Expect("register region", s0->RegisterRegion(&rctx, reg, &ignored), grpc::StatusCode::OK);
  v1::StepRequest in_region = Valid(20);
  const std::string rows = in_region.hidden().data();
  (void)!pwrite(fd, rows.data(), rows.size(), 0);
  in_region.mutable_hidden()->clear_data();
  in_region.mutable_hidden_region()->set_region(name);
  in_region.mutable_hidden_region()->set_bytes(rows.size());
  if (ftruncate(fd, 8) != 0) return 2;  // shrink it under the rank
  auto f0 = std::async(std::launch::async, [&] { return Execute(*s0, in_region); });
  auto f1 = std::async(std::launch::async, [&] { return Execute(*s1, Valid(20)); });
  ok = Expect("rank 0 reads the shrunk region", f0.get(), grpc::StatusCode::FAILED_PRECONDITION, "shrank") && ok;
  ok = Expect("rank 1 aborts with it", f1.get(), grpc::StatusCode::ABORTED) && ok;
  close(fd);
  shm_unlink(name.c_str());
  return ok ? 0 : 1;
}

grpc::Status Generic(const std::string& target, const std::string& method, const std::string& body) {
  grpc::GenericStub stub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::Slice slice(body);
  grpc::ByteBuffer req(&slice, 1), resp;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &req, &resp, [&](grpc::Status s) { done.set_value(s); });
  return done.get_future().get();
}

int Unauthenticated(const std::string& target) {
  auto stub = Stub(target);
  const grpc::Status step = Execute(*stub, Valid(30), 5);
  bool ok =
      step.error_code() == grpc::StatusCode::UNAUTHENTICATED || step.error_code() == grpc::StatusCode::UNIMPLEMENTED;
  std::printf("%s step over TCP without a token: code %d\n", ok ? "ok  " : "FAIL", static_cast<int>(step.error_code()));
  grpc::ClientContext ctx;
  v1::RegisterRegionRequest reg;
  reg.set_name("/moe-anything");
  reg.set_bytes(64);
  v1::RegisterRegionResponse ignored;
  const grpc::Status r = stub->RegisterRegion(&ctx, reg, &ignored);
  const bool rok =
      r.error_code() == grpc::StatusCode::UNAUTHENTICATED || r.error_code() == grpc::StatusCode::UNIMPLEMENTED;
  std::printf("%s RegisterRegion over TCP without a token: code %d\n", rok ? "ok  " : "FAIL",
              static_cast<int>(r.error_code()));
  ok =
      Expect("health over TCP", Generic(target, "/grpc.health.v1.Health/Check", ""), grpc::StatusCode::UNIMPLEMENTED) &&
      ok && rok;
  ok = Expect("reflection over TCP",
              Generic(target, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", ""),
              grpc::StatusCode::UNIMPLEMENTED) &&
       ok;
  return ok ? 0 : 1;
}

int GrpcPorts(int argc, char** argv) {
  int answering = 0;
  for (int i = 2; i < argc; ++i) {
    // Any gRPC status means a gRPC server read the call; a non-gRPC listener fails the
    // connection (UNAVAILABLE) or never answers (DEADLINE_EXCEEDED).
    const grpc::Status s = Generic(std::string("127.0.0.1:") + argv[i], "/moe.v1.Probe/Nothing", "");
    const bool grpc =
        s.error_code() != grpc::StatusCode::UNAVAILABLE && s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
    answering += grpc ? 1 : 0;
  }
  std::printf("%d\n", answering);
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const std::string mode = argv[1];
  if (mode == "overflow") return moe::Overflow(argv[2]);
  if (mode == "bad_values" && argc == 4) return moe::BadValues(argv[2], argv[3]);
  if (mode == "step_mismatch" && argc == 4) return moe::StepMismatch(argv[2], argv[3]);
  if (mode == "shrink" && argc == 4) return moe::Shrink(argv[2], argv[3]);
  if (mode == "unauthenticated") return moe::Unauthenticated(argv[2]);
  if (mode == "grpc_ports") return moe::GrpcPorts(argc, argv);
  return 2;
}
