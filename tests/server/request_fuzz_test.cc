// Bounded random-mutation fuzzing of request decoding and validation, through the real engine
// Unix socket of a one-rank service (loopback transport, CPU kernels). Each iteration sends the
// serialized bytes of a valid StepRequest after random mutation: half structured (a field set to
// a hostile value: huge or negative shapes, unknown enums, NaN rows, sizes that wrap in 64 bits,
// region references), half raw (bytes flipped, inserted, deleted or truncated, so protobuf
// decoding sees garbage too). Every call must answer within its deadline (no hang), the process
// must not die, and a valid step must be answered bit-exact afterwards; the daemon's RSS must
// stay flat over 10^4 rejected requests.
//
// MOE_FUZZ_ITERATIONS (default 20000, the CI slice) and MOE_FUZZ_SEED set the run; the nightly
// run (10^6) and its figures are in bench/RESULTS.md.
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "gtest/gtest.h"

#include "rpc/unix_socket.h"
#include "server/expert_layer_service.h"
#include "tests/server/one_rank_fixture.h"
#include "tests/server/step_request_builder.h"

namespace moe {
namespace {

constexpr int kD = 64, kK = 2, kExperts = 4, kTokens = 5;

int64_t RssKiB() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6);
  }
  return -1;
}

class RequestFuzzTest : public testing::OneRankTest {
 protected:
  void SetUp() override {
    SetUpRank(kExperts, kD, 32, 3);
    path_ = "/tmp/moe-fuzz-" + std::to_string(getpid()) + "-" + std::to_string(std::random_device()()) + ".sock";
    listener_ = *UnixSocketListener::Create(path_, {});
    EngineApiOptions o;
    o.max_step_tokens = 4096;
    o.max_request_bytes = 1 << 22;
    UnixSocketListener* l = listener_.get();
    o.peer_uid = [l](const std::string& peer) { return l->PeerUid(peer); };
    service_ = std::make_unique<ExpertLayerServiceImpl>(executor_.get(), &metrics_, o);
    grpc::ServerBuilder b;
    b.RegisterService(service_.get());
    b.SetMaxReceiveMessageSize(1 << 23);
    server_ = b.BuildAndStart();
    listener_->Start(server_.get());
    channel_ = grpc::CreateChannel("unix:" + path_, grpc::InsecureChannelCredentials());
    generic_ = std::make_unique<grpc::GenericStub>(channel_);
  }
  void TearDown() override {
    listener_.reset();
    server_->Shutdown();
  }

  v1::StepRequest Valid(uint64_t step) {
    return testing::ValidStepRequest(step, step % 2 ? v1::PHASE_DECODE : v1::PHASE_PREFILL, {kTokens, kD, kK, kExperts},
                                     [](int i) { return std::sin(0.1f * i); });
  }

  // One structured mutation: a field set to a value a hostile or broken engine could send.
  void Mutate(v1::StepRequest* r, std::mt19937_64& rng) {
    auto any64 = [&]() -> int64_t {
      switch (rng() % 6) {
        case 0:
          return -static_cast<int64_t>(rng() % 1000);
        case 1:
          return static_cast<int64_t>(1) << (rng() % 63);
        case 2:
          return static_cast<int64_t>(rng());
        case 3:
          return INT64_MAX - static_cast<int64_t>(rng() % 4);
        case 4:
          return INT64_MIN + static_cast<int64_t>(rng() % 4);
        default:
          return static_cast<int64_t>(rng() % 64);
      }
    };
    switch (rng() % 16) {
      case 0:
        r->mutable_hidden()->set_rows(any64());
        break;
      case 1:
        r->mutable_hidden()->set_cols(any64());
        break;
      case 2:
        r->set_k(static_cast<int32_t>(any64()));
        break;
      case 3:
        r->set_phase(static_cast<v1::Phase>(static_cast<int>(rng() % 8) - 2));
        break;
      case 4:
        r->mutable_hidden()->set_dtype(static_cast<v1::DType>(static_cast<int>(rng() % 8) - 2));
        break;
      case 5:
        if (r->topk_ids_size() > 0) r->set_topk_ids(rng() % r->topk_ids_size(), static_cast<int32_t>(any64()));
        break;
      case 6: {
        const float bad[] = {NAN, INFINITY, -1.0f, 1e38f, -0.0f};
        if (r->topk_weights_size() > 0) r->set_topk_weights(rng() % r->topk_weights_size(), bad[rng() % 5]);
        break;
      }
      case 7:
        r->mutable_hidden()->mutable_data()->resize(rng() % (kTokens * kD * 4));
        break;
      case 8: {
        const uint16_t bad[] = {0x7fc0, 0x7f80, 0xff80, 0xffff};
        const uint16_t v = bad[rng() % 4];
        std::string* data = r->mutable_hidden()->mutable_data();
        if (data->size() >= 2) std::memcpy(&(*data)[2 * (rng() % (data->size() / 2))], &v, 2);
        break;
      }
      case 9:
        r->set_admitted(std::string(rng() % 32, static_cast<char>(rng())));
        break;
      case 10: {
        // Rows and k whose products wrap in 64 bits, with nothing behind them.
        const int shift = 40 + static_cast<int>(rng() % 23);
        r->mutable_hidden()->set_rows(int64_t{1} << shift);
        r->mutable_hidden()->set_cols(int64_t{1} << (63 - shift));
        r->set_k(1 << (rng() % 10));
        r->mutable_hidden()->clear_data();
        r->clear_topk_ids();
        r->clear_topk_weights();
        break;
      }
      case 11:
        r->mutable_hidden_region()->set_region(rng() % 2 ? "/moe-none" : "/../etc/passwd");
        r->mutable_hidden_region()->set_offset(static_cast<uint64_t>(any64()));
        r->mutable_hidden_region()->set_bytes(static_cast<uint64_t>(any64()));
        if (rng() % 2) r->mutable_hidden()->clear_data();
        break;
      case 12:
        r->mutable_output_region()->set_region("/moe-none");
        r->mutable_output_region()->set_bytes(static_cast<uint64_t>(any64()));
        break;
      case 13:
        r->set_expected_generation(any64());
        break;
      case 14:
        r->add_topk_ids(1);
        break;
      default:
        r->clear_topk_weights();
        break;
    }
  }

  // Raw mutation of serialized bytes.
  static void MutateBytes(std::string* b, std::mt19937_64& rng) {
    const int n = 1 + static_cast<int>(rng() % 8);
    for (int i = 0; i < n && !b->empty(); ++i) {
      const size_t at = rng() % b->size();
      switch (rng() % 4) {
        case 0:
          (*b)[at] = static_cast<char>(rng());
          break;
        case 1:
          b->insert(at, 1, static_cast<char>(rng()));
          break;
        case 2:
          b->erase(at, 1 + rng() % 16);
          break;
        default:
          b->resize(at);
          break;
      }
    }
  }

  // Sends raw bytes as an Execute request; returns the status code (DEADLINE_EXCEEDED: a hang).
  grpc::StatusCode Send(const std::string& bytes, std::string* reply = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::Slice slice(bytes);
    grpc::ByteBuffer req(&slice, 1), resp;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    generic_->UnaryCall(&ctx, "/moe.v1.ExpertLayerService/Execute", grpc::StubOptions(), &req, &resp,
                        [&](grpc::Status s) {
                          std::lock_guard<std::mutex> lock(mu);
                          status = std::move(s);
                          done = true;
                          cv.notify_all();
                        });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    if (reply != nullptr && status.ok()) {
      std::vector<grpc::Slice> slices;
      (void)resp.Dump(&slices);
      reply->clear();
      for (const grpc::Slice& s : slices) reply->append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    return status.error_code();
  }

  std::string OutputOf(const std::string& reply) {
    v1::StepResponse r;
    EXPECT_TRUE(r.ParseFromString(reply));
    return r.output().data();
  }

  RankMetrics metrics_{"fuzz"};
  std::string path_;
  std::unique_ptr<UnixSocketListener> listener_;
  std::unique_ptr<ExpertLayerServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> generic_;
};

TEST_F(RequestFuzzTest, MutatedRequestsAreAnsweredAndTheRankKeepsServing) {
  const char* env = std::getenv("MOE_FUZZ_ITERATIONS");
  const int64_t iterations = env != nullptr ? std::atoll(env) : 20000;
  const char* seed_env = std::getenv("MOE_FUZZ_SEED");
  std::mt19937_64 rng(seed_env != nullptr ? std::strtoull(seed_env, nullptr, 10) : 20261130);
  std::string reference;
  ASSERT_EQ(Send(Valid(2).SerializeAsString(), &reference), grpc::StatusCode::OK);
  const std::string want = OutputOf(reference);
  std::map<grpc::StatusCode, int64_t> codes;
  for (int64_t i = 0; i < iterations; ++i) {
    v1::StepRequest r = Valid(100 + i);
    const int structured = 1 + static_cast<int>(rng() % 3);
    for (int m = 0; m < structured; ++m) Mutate(&r, rng);
    std::string bytes = r.SerializeAsString();
    if (rng() % 2) MutateBytes(&bytes, rng);
    const grpc::StatusCode code = Send(bytes);
    ASSERT_NE(code, grpc::StatusCode::DEADLINE_EXCEEDED) << "iteration " << i << " hung";
    ASSERT_NE(code, grpc::StatusCode::UNAVAILABLE) << "iteration " << i << ": the service went away";
    ++codes[code];
    if (i % 1000 == 999) {
      std::string reply;
      ASSERT_EQ(Send(Valid(2).SerializeAsString(), &reply), grpc::StatusCode::OK) << "after iteration " << i;
      ASSERT_EQ(OutputOf(reply), want) << "after iteration " << i;
    }
  }
  for (const auto& [code, n] : codes)
    std::printf("status %d: %lld\n", static_cast<int>(code), static_cast<long long>(n));
  EXPECT_GT(codes[grpc::StatusCode::INVALID_ARGUMENT], 0);
}

TEST_F(RequestFuzzTest, RssStaysFlatOverTenThousandRejectedRequests) {
  std::mt19937_64 rng(7);
  auto reject_batch = [&](int n) {
    for (int i = 0; i < n; ++i) {
      v1::StepRequest r = Valid(10 + i);
      r.mutable_hidden()->set_rows(int64_t{1} << 62);  // rejected at the edge
      r.mutable_hidden()->set_cols(2);
      r.mutable_hidden()->clear_data();
      ASSERT_EQ(Send(r.SerializeAsString()), grpc::StatusCode::INVALID_ARGUMENT);
    }
  };
  reject_batch(2000);  // warm up: gRPC's and the allocator's pools
  const int64_t before = RssKiB();
  reject_batch(10000);
  const int64_t after = RssKiB();
  std::printf("RSS over 10^4 rejected requests: %lld KiB -> %lld KiB (%+lld KiB)\n", static_cast<long long>(before),
              static_cast<long long>(after), static_cast<long long>(after - before));
  // Flat: a leak of one allocation per request would grow it by more.
  EXPECT_LT(after - before, 4096);
  std::string reply;
  EXPECT_EQ(Send(Valid(2).SerializeAsString(), &reply), grpc::StatusCode::OK);
}

}  // namespace
}  // namespace moe
