// Latency of a trivial unary RPC to a running moe-rankd (ExpertLayerService.UnregisterRegion of a
// name that is not registered: answered at once with NOT_FOUND), back to back and after 2 ms of
// idle, from one thread and from a fresh thread per call: what the transport and the hosts'
// wakeups cost around a layer step, apart from its work. 300 calls a mode.
//   bazel run //bench:rpc_ping -- unix:<the rank's --engine_socket>   (the engine API's default)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "bench/stats.h"
#include "proto/moe/v1/expert_layer.grpc.pb.h"
int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: rpc_ping host:port\n");
    return 2;
  }
  auto ch = grpc::CreateChannel(argv[1], grpc::InsecureChannelCredentials());
  auto stub = moe::v1::ExpertLayerService::NewStub(ch);
  for (int mode = 0; mode < 4; ++mode) {
    std::vector<double> us;
    for (int i = 0; i < 300; ++i) {
      moe::v1::UnregisterRegionRequest req;
      req.set_name("nope");
      moe::v1::UnregisterRegionResponse resp;
      auto call = [&] {
        grpc::ClientContext ctx;
        auto t0 = std::chrono::steady_clock::now();
        stub->UnregisterRegion(&ctx, req, &resp);
        us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      };
      if (mode % 2 == 0)
        call();
      else
        std::thread(call).join();
      if (mode >= 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const char* names[4] = {"back to back, one thread", "back to back, fresh thread", "after 2 ms idle, one thread",
                            "after 2 ms idle, fresh thread"};
    std::printf("%s: p50 %.0f us p90 %.0f us\n", names[mode], moe::bench::Quantile(us, 0.5),
                moe::bench::Quantile(us, 0.9));
  }
}
