// ExpertLayerService over real gRPC sockets (one rank, loopback transport, CPU kernels): the
// engine Unix socket (callers admitted by uid) and a TCP port (bearer token). Inline and
// shared-memory payloads give the same rows, dtypes round-trip, and bad or hostile requests are
// answered with the documented codes naming the field while the service keeps serving.
#include "server/expert_layer_service.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>

#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#include "kernels/api.h"
#include "kernels/numeric.h"
#include "rpc/unix_socket.h"
#include "runtime/checkpoint/synthetic.h"
#include "server/client.h"
#include "server/step_ring_layout.h"
#include "tests/server/one_rank_fixture.h"
#include "tests/server/step_request_builder.h"

namespace moe {
namespace {

using ::testing::HasSubstr;

constexpr int kD = 64, kK = 2, kExperts = 4, kTokens = 5;

constexpr char kToken[] = "engine-token-0123456789";

class ServiceTest : public testing::OneRankTest {
 protected:
  void SetUp() override { Start({}); }
  void Start(std::vector<uid_t> allowed) {
    SetUpRank(kExperts, kD, 32, 2);
    // Tests in bazel's sandbox share /tmp and may share a pid (one pid namespace each): the path
    // carries a random part too.
    socket_path_ =
        "/tmp/moe-svc-test-" + std::to_string(getpid()) + "-" + std::to_string(std::random_device()()) + ".sock";
    auto listener = UnixSocketListener::Create(socket_path_, allowed);
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = *std::move(listener);
    EngineApiOptions o;
    o.token = kToken;
    o.max_step_tokens = 1024;
    UnixSocketListener* l = listener_.get();
    o.peer_uid = [l](const std::string& peer) { return l->PeerUid(peer); };
    service_ = std::make_unique<ExpertLayerServiceImpl>(executor_.get(), &metrics_, o);
    StepRingsOptions ro;
    ro.socket_path = socket_path_ + ".ring";
    ro.max_rings = 3;
    ASSERT_TRUE(service_->EnableStepRings(ro).ok());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    listener_->Start(server_.get());
    stub_ = v1::ExpertLayerService::NewStub(
        grpc::CreateChannel("unix:" + socket_path_, grpc::InsecureChannelCredentials()));
    tcp_stub_ = v1::ExpertLayerService::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    listener_.reset();
    server_->Shutdown();
    service_.reset();  // its rings' threads end first
  }

  v1::StepRequest Request(uint64_t step) {
    std::mt19937 rng(step);
    return testing::ValidStepRequest(step, v1::PHASE_PREFILL, {kTokens, kD, kK, kExperts},
                                     [&rng](int) { return std::normal_distribution<float>(0, 1)(rng); },
                                     {0.75f, 0.25f});
  }

  grpc::Status Call(const v1::StepRequest& req, v1::StepResponse* resp) {
    grpc::ClientContext ctx;
    return stub_->Execute(&ctx, req, resp);
  }

  grpc::Status Register(const std::string& name, uint64_t bytes) {
    grpc::ClientContext ctx;
    v1::RegisterRegionRequest reg;
    reg.set_name(name);
    reg.set_bytes(bytes);
    v1::RegisterRegionResponse ignored;
    return stub_->RegisterRegion(&ctx, reg, &ignored);
  }

  RankMetrics metrics_{"test"};
  std::string socket_path_;
  std::unique_ptr<UnixSocketListener> listener_;
  std::unique_ptr<ExpertLayerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::ExpertLayerService::Stub> stub_;      // the engine Unix socket
  std::unique_ptr<v1::ExpertLayerService::Stub> tcp_stub_;  // TCP: needs the token
};

// A shared-memory object the test owns, mapped here.
struct ShmObject {
  ShmObject(const std::string& n, size_t b, mode_t mode = 0600) : name(n), bytes(b) {
    shm_unlink(name.c_str());
    const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, mode);
    fchmod(fd, mode);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    base = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
  }
  ~ShmObject() {
    munmap(base, bytes);
    shm_unlink(name.c_str());
  }
  std::string name;
  size_t bytes;
  char* base;
};

// The fixture's placement names no layers (one expert set serves every layer): steps of any layer
// value are served, and their routes are counted under one series, layer="all", so that an
// engine's layer values cannot grow the metrics' label set.
TEST_F(ServiceTest, LayerValuesOfAPlacementWithoutLayersShareOneSeries) {
  uint64_t step = 1;
  for (const int64_t layer : {int64_t{0}, int64_t{5}, int64_t{1} << 40}) {
    v1::StepRequest req = Request(step++);
    req.set_layer(layer);
    v1::StepResponse resp;
    const grpc::Status s = Call(req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.record().layer(), layer);
  }
  std::vector<std::string> layers;
  double routes = 0;
  for (const auto& family : metrics_.registry()->Collect()) {
    if (family.name != "moe_layer_routes_total") continue;
    for (const auto& m : family.metric) {
      for (const auto& label : m.label) {
        if (label.name == "layer") layers.push_back(label.value);
      }
      routes += m.counter.value;
    }
  }
  EXPECT_EQ(layers, std::vector<std::string>{"all"});
  EXPECT_EQ(routes, 3.0 * kTokens * kK);
}

TEST_F(ServiceTest, SharedMemoryPayloadEqualsInline) {
  v1::StepResponse inline_resp;
  ASSERT_TRUE(Call(Request(1), &inline_resp).ok());
  EXPECT_EQ(inline_resp.record().placement_generation(), 1);
  EXPECT_EQ(inline_resp.record().routes_accepted(), kTokens * kK);
  // The stages of the step: reported, none negative, adding up to no more than the executor's time;
  // and the rank's moe_step_stage_seconds histograms each saw the step.
  const v1::StepStages& st = inline_resp.record().stages();
  const double stages[] = {st.validate_us(), st.acquire_us(), st.plan_us(),    st.agree_us(),  st.dispatch_us(),
                           st.experts_us(),  st.return_us(),  st.combine_us(), st.release_us()};
  double sum = 0;
  for (double us : stages) {
    EXPECT_GE(us, 0);
    sum += us;
  }
  EXPECT_GT(st.experts_us(), 0);
  EXPECT_LE(sum, inline_resp.record().compute_latency_us() + 1e-3);
  int stage_series = 0;
  for (const auto& family : metrics_.registry()->Collect()) {
    if (family.name != "moe_step_stage_seconds") continue;
    for (const auto& m : family.metric) {
      ++stage_series;
      EXPECT_EQ(m.histogram.sample_count, 1u);
    }
  }
  EXPECT_EQ(stage_series, kNumStepPhases);

  const std::string name = "/moe-test-" + std::to_string(getpid());
  const size_t bytes = 2 * kTokens * kD * 2;
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, bytes), 0);
  char* region = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  v1::StepRequest req = Request(1);
  std::memcpy(region, req.hidden().data().data(), req.hidden().data().size());
  req.mutable_hidden()->clear_data();
  req.mutable_hidden_region()->set_region(name);
  req.mutable_hidden_region()->set_bytes(kTokens * kD * 2);
  req.mutable_output_region()->set_region(name);
  req.mutable_output_region()->set_offset(kTokens * kD * 2);
  req.mutable_output_region()->set_bytes(kTokens * kD * 2);
  req.set_step_id(2);

  v1::StepResponse resp;
  grpc::Status unknown = Call(req, &resp);  // not registered yet
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(unknown.error_message(), HasSubstr("hidden_region.region"));

  grpc::ClientContext rctx;
  v1::RegisterRegionRequest reg;
  reg.set_name(name);
  reg.set_bytes(bytes);
  v1::RegisterRegionResponse reg_resp;
  ASSERT_TRUE(stub_->RegisterRegion(&rctx, reg, &reg_resp).ok());
  req.set_step_id(3);
  ASSERT_TRUE(Call(req, &resp).ok());
  EXPECT_TRUE(resp.output().data().empty());
  EXPECT_EQ(std::string(region + kTokens * kD * 2, kTokens * kD * 2), inline_resp.output().data());

  // A non-finite value among the region's rows: refused, named by its place (the reference has
  // no data field), and the output region untouched.
  {
    const std::string before(region + kTokens * kD * 2, kTokens * kD * 2);
    uint16_t saved, nan = 0x7fc0;
    std::memcpy(&saved, region + 2 * 5, 2);
    std::memcpy(region + 2 * 5, &nan, 2);
    req.set_step_id(31);
    grpc::Status bad = Call(req, &resp);
    EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(bad.error_message(), HasSubstr("hidden_region: value 5 is not finite"));
    EXPECT_EQ(std::string(region + kTokens * kD * 2, kTokens * kD * 2), before);
    std::memcpy(region + 2 * 5, &saved, 2);
  }
  req.set_step_id(4);
  req.mutable_hidden_region()->set_offset(bytes - 10);  // runs past the region
  grpc::Status oob = Call(req, &resp);
  EXPECT_EQ(oob.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(oob.error_message(), HasSubstr("outside region"));
  munmap(region, bytes);
  shm_unlink(name.c_str());
}

// FP16 in and out: the rows the experts see are the BF16 rounding of the FP16 input, and the
// output is the FP16 rounding of the BF16 result (checked against the compiler's _Float16).
TEST_F(ServiceTest, Fp16InAndOutMatchesTheBf16Step) {
  v1::StepRequest req = Request(1);
  // Inputs exactly representable in both formats: BF16 values with at most 8 significant bits
  // and exponents inside FP16's normal range survive BF16 -> FP16 -> BF16 unchanged.
  std::string fp16(kTokens * kD * 2, '\0');
  std::string bf16 = req.hidden().data();
  for (int i = 0; i < kTokens * kD; ++i) {
    uint16_t b;
    std::memcpy(&b, &bf16[2 * i], 2);
    float v = kernels::Bf16ToFloat(b);
    if (std::fabs(v) < 1e-4f) v = 0;  // below FP16's normal range
    const _Float16 h = static_cast<_Float16>(v);
    b = kernels::FloatToBf16(static_cast<float>(h));
    std::memcpy(&bf16[2 * i], &b, 2);
    std::memcpy(&fp16[2 * i], &h, 2);
  }
  req.mutable_hidden()->set_data(bf16);
  v1::StepResponse want;
  ASSERT_TRUE(Call(req, &want).ok());
  req.mutable_hidden()->set_dtype(v1::DTYPE_FP16);
  req.mutable_hidden()->set_data(fp16);
  req.set_step_id(2);
  v1::StepResponse got;
  const grpc::Status s = Call(req, &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(got.output().dtype(), v1::DTYPE_FP16);
  ASSERT_EQ(got.output().data().size(), static_cast<size_t>(kTokens * kD * 2));
  for (int i = 0; i < kTokens * kD; ++i) {
    uint16_t b;
    _Float16 h;
    std::memcpy(&b, &want.output().data()[2 * i], 2);
    std::memcpy(&h, &got.output().data()[2 * i], 2);
    const _Float16 expected = static_cast<_Float16>(kernels::Bf16ToFloat(b));
    ASSERT_EQ(static_cast<float>(h), static_cast<float>(expected)) << i;
  }
}

TEST_F(ServiceTest, Fp32RoundTripsAndBadInputNamesTheField) {
  v1::StepResponse bf16;
  ASSERT_TRUE(Call(Request(1), &bf16).ok());
  v1::StepRequest req = Request(1);
  std::string fp32(kTokens * kD * 4, '\0');
  for (int i = 0; i < kTokens * kD; ++i) {
    uint16_t b;
    std::memcpy(&b, &req.hidden().data()[2 * i], 2);
    const float v = kernels::Bf16ToFloat(b);
    std::memcpy(&fp32[4 * i], &v, 4);
  }
  req.mutable_hidden()->set_dtype(v1::DTYPE_FP32);
  req.mutable_hidden()->set_data(fp32);
  req.set_step_id(2);
  v1::StepResponse resp;
  ASSERT_TRUE(Call(req, &resp).ok());
  ASSERT_EQ(resp.output().dtype(), v1::DTYPE_FP32);
  for (int i = 0; i < kTokens * kD; ++i) {
    uint16_t b;
    float v;
    std::memcpy(&b, &bf16.output().data()[2 * i], 2);
    std::memcpy(&v, &resp.output().data()[4 * i], 4);
    ASSERT_EQ(v, kernels::Bf16ToFloat(b)) << i;
  }

  auto expect = [&](v1::StepRequest bad, grpc::StatusCode code, const char* field) {
    static uint64_t step = 100;
    bad.set_step_id(step++);
    v1::StepResponse r;
    const grpc::Status s = Call(bad, &r);
    EXPECT_EQ(s.error_code(), code) << field << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(field));
  };
  v1::StepRequest bad = Request(5);
  bad.mutable_hidden()->mutable_data()->pop_back();
  expect(bad, grpc::StatusCode::INVALID_ARGUMENT, "hidden.data");
  bad = Request(5);
  bad.set_k(3);
  expect(bad, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids");
  bad = Request(5);
  bad.set_topk_ids(3, kExperts + 1);
  expect(bad, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids[1][1]");
  bad = Request(5);
  bad.set_topk_weights(0, std::nanf(""));
  expect(bad, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights[0][0]");
  bad = Request(5);
  bad.set_topk_weights(2, -1.0f);
  expect(bad, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights[1][0]");
  bad = Request(5);
  bad.set_expected_generation(7);
  expect(bad, grpc::StatusCode::FAILED_PRECONDITION, "expected_generation");
  // Still serving.
  v1::StepResponse ok;
  v1::StepRequest good = Request(6);
  good.set_step_id(200);
  EXPECT_TRUE(Call(good, &ok).ok());
}

TEST_F(ServiceTest, TcpCallersNeedTheEngineToken) {
  v1::StepResponse resp;
  {
    grpc::ClientContext ctx;
    const grpc::Status s = tcp_stub_->Execute(&ctx, Request(1), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer not-the-token-at-all");
    EXPECT_EQ(tcp_stub_->Execute(&ctx, Request(1), &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    // RegisterRegion is a write path: never without credentials.
    grpc::ClientContext ctx;
    v1::RegisterRegionRequest reg;
    reg.set_name("/moe-anything");
    reg.set_bytes(64);
    v1::RegisterRegionResponse ignored;
    EXPECT_EQ(tcp_stub_->RegisterRegion(&ctx, reg, &ignored).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
  const grpc::Status s = tcp_stub_->Execute(&ctx, Request(1), &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// Shared regions are host memory of a known engine: a TCP caller, token or not, can neither
// register one nor name one in a step (it would read or write another engine's rows).
TEST_F(ServiceTest, TcpCallersWithTheTokenUseNoSharedRegions) {
  ShmObject region("/moe-tcp-" + std::to_string(getpid()), 2 * kTokens * kD * 2);
  ASSERT_TRUE(Register(region.name, region.bytes).ok());  // this engine's, on the Unix socket
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
    v1::RegisterRegionRequest reg;
    reg.set_name(region.name);
    reg.set_bytes(region.bytes);
    v1::RegisterRegionResponse ignored;
    const grpc::Status s = tcp_stub_->RegisterRegion(&ctx, reg, &ignored);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("--engine_socket"));
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
    v1::UnregisterRegionRequest unreg;
    unreg.set_name(region.name);
    v1::UnregisterRegionResponse ignored;
    EXPECT_EQ(tcp_stub_->UnregisterRegion(&ctx, unreg, &ignored).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  v1::StepRequest out = Request(1);
  out.mutable_output_region()->set_region(region.name);
  out.mutable_output_region()->set_bytes(kTokens * kD * 2);
  std::memset(region.base, 0x5a, region.bytes);
  v1::StepResponse resp;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
    const grpc::Status s = tcp_stub_->Execute(&ctx, out, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("output_region.region"));
  }
  EXPECT_EQ(std::string(region.base, region.bytes), std::string(region.bytes, 0x5a));  // nothing written
  // The engine that registered it still uses it.
  out.set_step_id(2);
  ASSERT_TRUE(Call(out, &resp).ok());
  EXPECT_NE(std::string(region.base, kTokens * kD * 2), std::string(kTokens * kD * 2, 0x5a));
}

class RefusedUidTest : public ServiceTest {
 protected:
  void SetUp() override { Start({geteuid() + 1}); }
};

TEST_F(RefusedUidTest, AConnectionFromAnotherUidIsClosedBeforeGrpc) {
  v1::StepResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::Status s = stub_->Execute(&ctx, Request(1), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_GE(listener_->refused(), 1);
}

TEST_F(ServiceTest, HostileShapesAndEnumsAreRejectedNamingTheField) {
  auto expect = [&](v1::StepRequest bad, const char* field) {
    static uint64_t step = 300;
    bad.set_step_id(step++);
    v1::StepResponse r;
    const grpc::Status s = Call(bad, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(field));
  };
  // Sizes whose products wrap in 64 bits: rows x k and rows x cols x 2 are 0 mod 2^64, with no
  // rows, ids or gates in the message (this crashed the rank).
  struct Wrap {
    int64_t rows, cols;
    int k;
    const char* field;
  };
  for (const Wrap& w : {Wrap{int64_t{1} << 62, 2, 4, "hidden.rows"}, Wrap{int64_t{1} << 55, 256, 512, "k: 512"},
                        Wrap{int64_t{1} << 55, 256, 8, "hidden.rows"}}) {
    v1::StepRequest bad = Request(1);
    bad.mutable_hidden()->set_rows(w.rows);
    bad.mutable_hidden()->set_cols(w.cols);
    bad.mutable_hidden()->clear_data();
    bad.clear_topk_ids();
    bad.clear_topk_weights();
    bad.set_k(w.k);
    expect(bad, w.field);
  }
  v1::StepRequest bad = Request(1);
  bad.mutable_hidden()->set_cols(int64_t{1} << 40);
  expect(bad, "hidden.cols");
  bad = Request(1);
  bad.set_k(1000);
  expect(bad, "k: 1000");
  bad = Request(1);
  bad.set_phase(v1::PHASE_UNSPECIFIED);
  expect(bad, "phase");
  bad = Request(1);
  bad.set_phase(static_cast<v1::Phase>(7));
  expect(bad, "phase: 7");
  // Non-finite rows are rejected in BF16 as in FP16 and FP32.
  for (uint16_t nonfinite : {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}}) {
    bad = Request(1);
    std::memcpy(&(*bad.mutable_hidden()->mutable_data())[2 * 3], &nonfinite, 2);
    expect(bad, "hidden.data[3]");
  }
  bad = Request(1);
  bad.mutable_hidden()->set_dtype(v1::DTYPE_FP16);
  const uint16_t half_nan = 0x7e00;
  std::memcpy(&(*bad.mutable_hidden()->mutable_data())[2 * 3], &half_nan, 2);
  expect(bad, "hidden.data[3]");
  v1::StepResponse ok;
  EXPECT_TRUE(Call(Request(2), &ok).ok());
}

TEST_F(ServiceTest, RegionsAreConfinedAndAShrunkRegionIsAnErrorNotASignal) {
  const std::string tag = std::to_string(getpid());
  const size_t bytes = 2 * kTokens * kD * 2;
  // Outside the prefix, through a symlink, writable by everyone: refused.
  EXPECT_EQ(Register("/other-" + tag, bytes).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register("/moe-a/b", bytes).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  {
    ShmObject target("/moe-target-" + tag, bytes);
    const std::string link = "/dev/shm/moe-link-" + tag;
    unlink(link.c_str());
    ASSERT_EQ(symlink(("/dev/shm/moe-target-" + tag).c_str(), link.c_str()), 0);
    EXPECT_EQ(Register("/moe-link-" + tag, bytes).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);  // a symbolic link is not a region
    unlink(link.c_str());
  }
  {
    ShmObject open_to_all("/moe-open-" + tag, bytes, 0666);
    const grpc::Status s = Register(open_to_all.name, bytes);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  }
  ShmObject region("/moe-shrink-" + tag, bytes);
  v1::StepRequest req = Request(1);
  std::memcpy(region.base, req.hidden().data().data(), req.hidden().data().size());
  req.mutable_hidden()->clear_data();
  req.mutable_hidden_region()->set_region(region.name);
  req.mutable_hidden_region()->set_bytes(kTokens * kD * 2);
  ASSERT_TRUE(Register(region.name, bytes).ok());
  v1::StepResponse resp;
  ASSERT_TRUE(Call(req, &resp).ok());
  // The engine shrinks the object under the rank: the next step that reads it is refused.
  ASSERT_EQ(truncate(("/dev/shm" + region.name).c_str(), 16), 0);
  req.set_step_id(2);
  grpc::Status s = Call(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("hidden_region.region"));
  EXPECT_THAT(s.error_message(), HasSubstr("shrank"));
  v1::StepRequest out = Request(3);
  out.mutable_output_region()->set_region(region.name);
  out.mutable_output_region()->set_bytes(kTokens * kD * 2);
  s = Call(out, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("output_region.region"));
  // Still serving.
  EXPECT_TRUE(Call(Request(4), &resp).ok());
}

// Step rings (server/step_rings.h): the same step through a ring and through gRPC.

// A StepCall of Request(step)'s contents.
StepCall CallOf(const v1::StepRequest& req) {
  StepCall c;
  c.step_id = req.step_id();
  c.layer = req.layer();
  c.decode = req.phase() == v1::PHASE_DECODE;
  c.tokens = req.hidden().rows();
  c.d = static_cast<int>(req.hidden().cols());
  c.hidden.resize(c.tokens * c.d);
  std::memcpy(c.hidden.data(), req.hidden().data().data(), c.hidden.size() * 2);
  c.topk_ids.assign(req.topk_ids().begin(), req.topk_ids().end());
  c.topk_weights.assign(req.topk_weights().begin(), req.topk_weights().end());
  c.k = req.k();
  return c;
}

class RingTest : public ServiceTest {
 protected:
  void SetUp() override {
    ServiceTest::SetUp();
    auto client = ExpertLayerClient::Connect("unix:" + socket_path_, absl::Seconds(5));
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  std::unique_ptr<StepRing> Open(int slots = 2, int64_t max_tokens = 16) {
    StepRingOptions o;
    o.slots = slots;
    o.max_tokens = max_tokens;
    o.d = kD;
    o.k = kK;
    auto ring = client_->OpenRing(o);
    EXPECT_TRUE(ring.ok()) << ring.status();
    return ring.ok() ? *std::move(ring) : nullptr;
  }
  std::unique_ptr<ExpertLayerClient> client_;
};

TEST_F(RingTest, RingStepsEqualGrpcStepsAndWriteTheOutputInPlace) {
  std::unique_ptr<StepRing> ring = Open();
  ASSERT_NE(ring, nullptr);
  EXPECT_EQ(service_->step_rings(), 1);
  for (uint64_t step = 1; step <= 6; step += 2) {
    v1::StepResponse want;
    ASSERT_TRUE(Call(Request(step), &want).ok());
    StepCall call = CallOf(Request(step));
    call.step_id = step + 1;  // each step id once, gRPC and ring steps interleaved
    auto got = ring->Execute(call);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->output.size() * 2, want.output().data().size());
    EXPECT_EQ(std::memcmp(got->output.data(), want.output().data().data(), want.output().data().size()), 0);
    EXPECT_EQ(got->record.placement_generation(), 1);
    EXPECT_EQ(got->record.routes_accepted(), kTokens * kK);
    EXPECT_GT(got->record.compute_latency_us(), 0);
    EXPECT_GE(got->record.server_latency_us(), got->record.compute_latency_us());
    EXPECT_GT(got->record.stages().experts_us(), 0);
  }
  // Two steps in flight on two slots; each answer's rows are in its own slot.
  v1::StepResponse want;
  ASSERT_TRUE(Call(Request(20), &want).ok());
  const StepCall call = CallOf(Request(20));
  const uint16_t* slot_out[2];
  for (int i = 0; i < 2; ++i) {
    auto slot = ring->NextSlot();
    ASSERT_TRUE(slot.ok()) << slot.status();
    std::memcpy(slot->hidden, call.hidden.data(), call.hidden.size() * 2);
    std::memcpy(slot->topk_ids, call.topk_ids.data(), call.topk_ids.size() * 4);
    std::memcpy(slot->topk_weights, call.topk_weights.data(), call.topk_weights.size() * 4);
    slot_out[i] = slot->output;
    StepRing::StepMeta meta;
    meta.step_id = 21 + i;
    meta.tokens = kTokens;
    meta.k = kK;
    ASSERT_TRUE(ring->Submit(meta).ok());
  }
  EXPECT_EQ(ring->NextSlot().status().code(), absl::StatusCode::kFailedPrecondition);  // both slots in flight
  for (int i = 0; i < 2; ++i) {
    const uint16_t* out = nullptr;
    auto rec = ring->Wait(absl::Seconds(30), &out);
    ASSERT_TRUE(rec.ok()) << rec.status();
    EXPECT_EQ(out, slot_out[i]);
    EXPECT_EQ(std::memcmp(out, want.output().data().data(), want.output().data().size()), 0);
  }
  ASSERT_TRUE(ring->Close().ok());
  EXPECT_EQ(service_->step_rings(), 0);
  EXPECT_EQ(ring->Execute(call).status().code(), absl::StatusCode::kUnavailable);
}

// The client checks that the answer in a step's slot is that step's (the result's seq): one that
// names another step is DATA_LOSS, never returned as this step's record and rows.
TEST_F(RingTest, ASlotAnsweringAnotherStepIsDataLoss) {
  std::unique_ptr<StepRing> ring = Open(/*slots=*/2);
  ASSERT_NE(ring, nullptr);
  const StepCall call = CallOf(Request(30));
  auto slot = ring->NextSlot();
  ASSERT_TRUE(slot.ok()) << slot.status();
  std::memcpy(slot->hidden, call.hidden.data(), call.hidden.size() * 2);
  std::memcpy(slot->topk_ids, call.topk_ids.data(), call.topk_ids.size() * 4);
  std::memcpy(slot->topk_weights, call.topk_weights.data(), call.topk_weights.size() * 4);
  StepRing::StepMeta meta;
  meta.step_id = 30;
  meta.tokens = kTokens;
  meta.k = kK;
  ASSERT_TRUE(ring->Submit(meta).ok());
  ring::Geometry g;
  ASSERT_TRUE(ring::ComputeGeometry(16, kD, kK, 2, &g));
  char* slot0 = reinterpret_cast<char*>(slot->hidden) - g.hidden_offset;  // step 0's slot
  auto* header = reinterpret_cast<ring::Header*>(slot0 - ring::kPage);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (header->completed.value.load(std::memory_order_acquire) < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(header->completed.value.load(), 1u) << "the rank never answered";
  auto* result = reinterpret_cast<ring::Result*>(slot0 + ring::kResultOffset);
  EXPECT_EQ(result->seq, 0u);  // step 0's own answer ...
  result->seq = 7;             // ... made to name step 7
  auto rec = ring->Wait(absl::Seconds(30));
  EXPECT_EQ(rec.status().code(), absl::StatusCode::kDataLoss) << rec.status();
  EXPECT_NE(std::string(rec.status().message()).find("answers step 7 where step 0 was awaited"), std::string::npos)
      << rec.status();
}

// What a hostile engine can write into a slot: each bad descriptor or payload is answered in the
// slot with INVALID_ARGUMENT naming the field, and the ring serves the next step.
TEST_F(RingTest, BadSlotsAreAnsweredNamingTheFieldAndTheRingServesOn) {
  std::unique_ptr<StepRing> ring = Open(/*slots=*/1);
  ASSERT_NE(ring, nullptr);
  ring::Geometry g;
  ASSERT_TRUE(ring::ComputeGeometry(16, kD, kK, 1, &g));
  const StepCall good = CallOf(Request(1));
  uint64_t step = 100;
  // Writes `good` into the slot, lets `spoil` change the descriptor or the payload, submits it
  // as an engine would (raw: the client's Submit refuses such descriptors), waits for the rank
  // and reads the slot's result.
  auto slot = ring->NextSlot();
  ASSERT_TRUE(slot.ok());
  char* base = reinterpret_cast<char*>(slot->hidden) - g.hidden_offset;
  auto* header = reinterpret_cast<ring::Header*>(base - ring::kPage);
  auto run = [&](const std::function<void(ring::Descriptor&, char* slot)>& spoil) {
    std::memcpy(base + g.hidden_offset, good.hidden.data(), good.hidden.size() * 2);
    std::memcpy(base + g.ids_offset, good.topk_ids.data(), good.topk_ids.size() * 4);
    std::memcpy(base + g.weights_offset, good.topk_weights.data(), good.topk_weights.size() * 4);
    const uint32_t seq = header->submitted.value.load();
    ring::Descriptor d{};
    d.seq = seq;
    d.phase = v1::PHASE_PREFILL;
    d.k = kK;
    d.step_id = step++;
    d.tokens = kTokens;
    spoil(d, base);
    std::memcpy(base, &d, sizeof(d));
    header->submitted.value.store(seq + 1);
    ring::FutexWake(&header->submitted.value);
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (header->completed.value.load() != seq + 1 && absl::Now() < until) absl::SleepFor(absl::Microseconds(50));
    ring::Result r;
    std::memcpy(&r, base + ring::kResultOffset, sizeof(r));
    EXPECT_EQ(r.seq, seq);
    return r;
  };
  auto expect = [&](const std::function<void(ring::Descriptor&, char*)>& spoil, const char* field) {
    const ring::Result r = run(spoil);
    EXPECT_EQ(r.code, static_cast<int>(absl::StatusCode::kInvalidArgument)) << field << ": " << r.message;
    EXPECT_THAT(std::string(r.message), HasSubstr(field));
  };
  expect([](ring::Descriptor& d, char*) { d.phase = 7; }, "descriptor.phase");
  expect([](ring::Descriptor& d, char*) { d.k = kK + 1; }, "descriptor.k");
  expect([](ring::Descriptor& d, char*) { d.tokens = 17; }, "descriptor.tokens");
  expect([](ring::Descriptor& d, char*) { d.tokens = -1; }, "descriptor.tokens");
  expect([](ring::Descriptor& d, char*) { d.flags = 6; }, "descriptor.flags");
  expect([](ring::Descriptor& d, char*) { d.flags = ring::kFlagDeviceRouting; },
         "descriptor.flags: device routing on a ring without device rows");
  expect([](ring::Descriptor& d, char*) { d.seq += 5; }, "descriptor.seq");
  expect([&](ring::Descriptor&, char* b) { reinterpret_cast<uint16_t*>(b + g.hidden_offset)[3] = 0x7fc0; },  // NaN
         "hidden");
  expect([&](ring::Descriptor&, char* b) { reinterpret_cast<int32_t*>(b + g.ids_offset)[1] = kExperts + 3; },
         "topk_ids");
  // Still serving, through the ring and through gRPC, with the rows of the gRPC step.
  v1::StepResponse want;
  ASSERT_TRUE(Call(Request(1), &want).ok());
  const ring::Result r = run([](ring::Descriptor&, char*) {});
  EXPECT_EQ(r.code, 0) << r.message;
  EXPECT_EQ(std::memcmp(base + g.output_offset, want.output().data().data(), want.output().data().size()), 0);
}

// An engine that submits more steps than the ring has slots breaks the protocol: the rank closes
// the ring, and the client says so instead of waiting.
TEST_F(RingTest, OverrunningTheSlotsClosesTheRing) {
  std::unique_ptr<StepRing> ring = Open(/*slots=*/2);
  ASSERT_NE(ring, nullptr);
  auto slot = ring->NextSlot();
  ASSERT_TRUE(slot.ok());
  ring::Geometry g;
  ASSERT_TRUE(ring::ComputeGeometry(16, kD, kK, 2, &g));
  auto* header = reinterpret_cast<ring::Header*>(reinterpret_cast<char*>(slot->hidden) - g.hidden_offset - ring::kPage);
  header->submitted.value.store(3);
  ring::FutexWake(&header->submitted.value);
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (header->closed.value.load() == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(header->closed.value.load(), 1u);
  EXPECT_EQ(ring->Execute(CallOf(Request(1))).status().code(), absl::StatusCode::kUnavailable);
  v1::StepResponse resp;
  EXPECT_TRUE(Call(Request(2), &resp).ok());  // the rank serves on
}

// The claim: only with the ticket, once, from the opener's uid; the memfd cannot be resized; an
// engine that goes away takes its ring with it; rings are capped; TCP callers get none.
// The claim socket is open to every local user: a peer that trickles its 24 bytes is cut off at
// the claim's deadline (it once held the socket for 2 s a
// byte), and the ring's own engine claims the ring afterwards.
TEST_F(RingTest, ATricklingClaimIsCutOffAndTheRingStaysClaimable) {
  v1::OpenStepRingRequest req;
  req.set_slots(1);
  req.set_max_tokens(8);
  req.set_d(kD);
  req.set_k(kK);
  v1::OpenStepRingResponse opened;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->OpenStepRing(&ctx, req, &opened).ok());
  }
  auto connect_claim = [&] {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, opened.socket_path().c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  };
  const int slow = connect_claim();
  int sent = 0;
  char reply = 0;
  int got = -1;
  bool answered = false;
  while (sent < 23 && !answered) {                     // one byte every 200 ms, never the whole claim
    if (send(slow, "x", 1, MSG_NOSIGNAL) != 1) break;  // answered and closed just now
    ++sent;
    pollfd in{slow, POLLIN, 0};
    answered = poll(&in, 1, 200) == 1;
  }
  pollfd in{slow, POLLIN, 0};
  answered = answered || poll(&in, 1, 1000) == 1;
  ASSERT_TRUE(answered) << "the rank read " << sent << " trickled bytes without answering";
  EXPECT_TRUE(ring::ReceiveReply(slow, &reply, &got));
  EXPECT_EQ(reply, 'N');
  EXPECT_EQ(got, -1);
  EXPECT_LT(sent, 23);
  close(slow);
  // The ring's engine claims it with its ticket.
  const int conn = connect_claim();
  char msg[24];
  const uint64_t id = opened.ring_id();
  std::memcpy(msg, &id, 8);
  std::memcpy(msg + 8, opened.ticket().data(), 16);
  ASSERT_EQ(send(conn, msg, sizeof(msg), MSG_NOSIGNAL), 24);
  ASSERT_TRUE(ring::ReceiveReply(conn, &reply, &got));
  EXPECT_EQ(reply, 'K');
  EXPECT_GE(got, 0);
  if (got >= 0) close(got);
  close(conn);
}

// Claims are read as their bytes arrive, each with its own deadline: connections that send
// nothing (twelve here, 500 ms each when claims were taken one at a time: 6 s) do not hold the
// claim of an engine that sends its message at once.
TEST_F(RingTest, SilentConnectionsDoNotDelayAClaim) {
  v1::OpenStepRingRequest req;
  req.set_slots(1);
  req.set_max_tokens(8);
  req.set_d(kD);
  req.set_k(kK);
  v1::OpenStepRingResponse opened;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->OpenStepRing(&ctx, req, &opened).ok());
  }
  auto connect_claim = [&] {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, opened.socket_path().c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  };
  std::vector<int> silent;
  for (int i = 0; i < 12; ++i) silent.push_back(connect_claim());
  absl::SleepFor(absl::Milliseconds(50));  // accepted before the claim below
  const absl::Time start = absl::Now();
  const int conn = connect_claim();
  char msg[24];
  const uint64_t id = opened.ring_id();
  std::memcpy(msg, &id, 8);
  std::memcpy(msg + 8, opened.ticket().data(), 16);
  ASSERT_EQ(send(conn, msg, sizeof(msg), MSG_NOSIGNAL), 24);
  char reply = 0;
  int got = -1;
  ASSERT_TRUE(ring::ReceiveReply(conn, &reply, &got));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(reply, 'K');
  if (got >= 0) close(got);
  EXPECT_LT(took, absl::Seconds(3)) << "the claim waited behind the silent connections";
  for (int fd : silent) {
    pollfd in{fd, POLLIN, 0};
    EXPECT_EQ(poll(&in, 1, 3000), 1) << "a silent connection was never answered";
    EXPECT_TRUE(ring::ReceiveReply(fd, &reply, &got));
    EXPECT_EQ(reply, 'N');
    close(fd);
  }
  close(conn);
}

TEST_F(RingTest, ClaimsAreGuardedAndAnEngineThatLeavesTakesItsRing) {
  v1::OpenStepRingRequest req;
  req.set_slots(1);
  req.set_max_tokens(8);
  req.set_d(kD);
  req.set_k(kK);
  v1::OpenStepRingResponse opened;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->OpenStepRing(&ctx, req, &opened).ok());
  }
  auto claim = [&](const std::string& ticket, int* memfd) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, opened.socket_path().c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
    char msg[24];
    const uint64_t id = opened.ring_id();
    std::memcpy(msg, &id, 8);
    std::memcpy(msg + 8, ticket.data(), 16);
    // A rank that holds no unclaimed ring for this uid answers 'N' and closes without reading the
    // claim, so the send may meet a closed socket (EPIPE, not SIGPIPE): the reply is what counts.
    (void)send(fd, msg, sizeof(msg), MSG_NOSIGNAL);
    char reply = 0;
    int got = -1;
    *memfd = -1;
    if (ring::ReceiveReply(fd, &reply, &got) && reply == 'K') *memfd = got;
    return fd;
  };
  std::string wrong = opened.ticket();
  wrong[0] ^= 1;
  int memfd = -1;
  close(claim(wrong, &memfd));
  EXPECT_EQ(memfd, -1);
  const int conn = claim(opened.ticket(), &memfd);
  ASSERT_GE(memfd, 0);
  EXPECT_NE(ftruncate(memfd, 4096), 0);                // sealed against shrinking
  EXPECT_NE(ftruncate(memfd, opened.bytes() * 2), 0);  // and growing
  int again = -1;
  close(claim(opened.ticket(), &again));  // single use
  EXPECT_EQ(again, -1);
  close(memfd);
  EXPECT_EQ(service_->step_rings(), 1);
  close(conn);  // the engine goes away: its ring is torn down
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (service_->step_rings() != 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(service_->step_rings(), 0);

  // At most max_rings (3 here) open at once.
  std::vector<std::unique_ptr<StepRing>> rings;
  for (int i = 0; i < 3; ++i) rings.push_back(Open(1, 4));
  auto fourth = client_->OpenRing({1, 4, kD, kK});
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted) << fourth.status();
  // Sizes from the request are checked.
  StepRingOptions huge{1, int64_t{1} << 40, kD, kK};
  EXPECT_EQ(client_->OpenRing(huge).status().code(), absl::StatusCode::kInvalidArgument);
  // TCP callers (token holders elsewhere) get no ring.
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
  const grpc::Status tcp = tcp_stub_->OpenStepRing(&ctx, req, &opened);
  EXPECT_EQ(tcp.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << tcp.error_message();
}

// moe_recorded_work_total counts the growth of the executor's running totals, by outcome.
TEST(RankMetricsTest, RecordedWorkCountsTheTotalsGrowth) {
  RankMetrics metrics("test");
  metrics.RecordedWork(3, 0, 1, 0, 4);
  metrics.RecordedWork(3, 0, 1, 0, 4);  // unchanged: nothing counted
  metrics.RecordedWork(5, 1, 1, 2, 9);
  std::map<std::string, double> got;
  for (const auto& family : metrics.registry()->Collect()) {
    if (family.name != "moe_recorded_work_total") continue;
    for (const auto& m : family.metric) {
      for (const auto& label : m.label) {
        if (label.name == "outcome") got[label.value] = m.counter.value;
      }
    }
  }
  EXPECT_EQ(got,
            (std::map<std::string, double>{{"recorded", 5}, {"stale", 1}, {"failed", 1}, {"evicted", 2}, {"full", 9}}));
}

// moe_answered_steps_held is the last count; moe_answered_cap_waits_total splits the running
// totals by outcome (finished = waits - timeouts) and counts their growth.
TEST(RankMetricsTest, AnsweredWorkSplitsTheCapWaitsByOutcome) {
  RankMetrics metrics("test");
  metrics.AnsweredWork(300, 2, 1);
  metrics.AnsweredWork(12, 5, 1);
  double held = -1;
  std::map<std::string, double> waits;
  for (const auto& family : metrics.registry()->Collect()) {
    for (const auto& m : family.metric) {
      if (family.name == "moe_answered_steps_held") held = m.gauge.value;
      if (family.name != "moe_answered_cap_waits_total") continue;
      for (const auto& label : m.label) {
        if (label.name == "outcome") waits[label.value] = m.counter.value;
      }
    }
  }
  EXPECT_EQ(held, 12);
  EXPECT_EQ(waits, (std::map<std::string, double>{{"finished", 4}, {"timeout", 1}}));
}

// A ring whose rows stay in the engine's GPU memory: its fields are checked before anything is
// mapped, a rank on CPU kernels refuses it naming device_rows, and nothing is left open.
// The device slot layout both sides compute (python/moe_runtime/ring.py device_geometry checks
// the same numbers): 256-byte aligned parts, sizes that overflow refused.
TEST(DeviceGeometryTest, PartsAreAlignedAndOverflowIsRefused) {
  ring::DeviceGeometry g;
  ASSERT_TRUE(ring::ComputeDeviceGeometry(5, 24, 3, 2, &g));
  EXPECT_EQ(g.hidden_offset, 0u);
  EXPECT_EQ(g.output_offset, 256u);   // 5 x 24 x 2 = 240 bytes of rows
  EXPECT_EQ(g.ids_offset, 512u);      // 256 + 240 = 496
  EXPECT_EQ(g.weights_offset, 768u);  // 512 + 5 x 3 x 4 = 572
  EXPECT_EQ(g.slot_bytes, 1024u);     // 768 + 60 = 828
  EXPECT_EQ(g.total_bytes, 2048u);
  EXPECT_FALSE(ring::ComputeDeviceGeometry(int64_t{1} << 40, 1 << 20, 8, 16, &g));
  EXPECT_FALSE(ring::ComputeDeviceGeometry(0, 24, 3, 2, &g));
}

TEST_F(RingTest, DeviceRowsAreCheckedAndNeedDeviceKernels) {
  auto open = [&](int64_t d, uint64_t offset, const std::string& handle) {
    v1::OpenStepRingRequest req;
    req.set_slots(2);
    req.set_max_tokens(8);
    req.set_d(d);
    req.set_k(kK);
    req.mutable_device_rows()->set_ipc_handle(handle);
    req.mutable_device_rows()->set_offset(offset);
    v1::OpenStepRingResponse resp;
    grpc::ClientContext ctx;
    return stub_->OpenStepRing(&ctx, req, &resp);
  };
  const std::string handle(64, 'h');
  grpc::Status s = open(kD + 4, 0, handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("d: 68 is not a multiple of 8"));
  s = open(kD, 100, handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("device_rows.offset"));
  s = open(kD, uint64_t{1} << 60, handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("device_rows.offset"));
  s = open(kD, 256, handle);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("device_rows"));
  EXPECT_THAT(s.error_message(), HasSubstr("device_rows: rows in an engine's GPU memory need device kernels"));
  EXPECT_EQ(service_->step_rings(), 0);
  // The C++ client passes the same request and gets the same refusal; UseRing, which copies host
  // rows, takes no device rows at all.
  StepRingOptions device_ring{2, 8, kD, kK};
  device_ring.device_rows = StepRingOptions::DeviceRows{handle, 256, std::string(64, 'e'), /*done_events=*/true};
  const auto from_client = client_->OpenRing(device_ring);
  EXPECT_EQ(from_client.status().code(), absl::StatusCode::kFailedPrecondition) << from_client.status();
  EXPECT_THAT(std::string(from_client.status().message()), HasSubstr("device_rows"));
  EXPECT_EQ(client_->UseRing(device_ring).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(client_->using_ring());
  EXPECT_EQ(service_->step_rings(), 0);
  // Still serving rings and steps; a host ring has no done events.
  std::unique_ptr<StepRing> ring = Open();
  ASSERT_NE(ring, nullptr);
  EXPECT_TRUE(ring->done_events().empty());
  EXPECT_EQ(ring->last_slot(), -1);
  v1::StepResponse want;
  ASSERT_TRUE(Call(Request(40), &want).ok());
  StepCall call = CallOf(Request(40));
  call.step_id = 41;
  auto got = ring->Execute(call);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::memcmp(got->output.data(), want.output().data().data(), want.output().data().size()), 0);
  EXPECT_EQ(ring->last_slot(), 0);  // the slots in turn
  call.step_id = 42;
  ASSERT_TRUE(ring->Execute(call).ok());
  EXPECT_EQ(ring->last_slot(), 1);
  call.step_id = 43;
  ASSERT_TRUE(ring->Execute(call).ok());
  EXPECT_EQ(ring->last_slot(), 0);
}

}  // namespace
}  // namespace moe
