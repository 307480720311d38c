// A low-latency combine whose x has another hidden size than its dispatch is refused naming x and the
// dispatch's H, and the buffer still combines the dispatch's own x afterwards.
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "support/random.hpp"

#include <random>
#include <vector>

namespace epmoe {
namespace {

using test::fresh_seed;

TEST(LowLatencyCombine, XOfAnotherHiddenSizeThanTheDispatchIsRefusedNamingBoth) {
  constexpr int R = 2, E = 4, K = 2, tmax = 4;
  constexpr std::int64_t T = 3, H = 128;
  std::mt19937_64 rng(fresh_seed());
  std::vector<Tensor> x, idx, w;
  for (int r = 0; r < R; ++r) {
    x.push_back(test::random_bf16(rng, T, H));
    idx.push_back(test::random_topk_idx(rng, T, K, E));
    w.push_back(test::random_topk_weights(rng, idx.back()));
  }
  std::vector<std::string> wider(R), narrower(R);
  run_thread_ranks(R, [&](Group& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    Buffer buf(std::shared_ptr<Group>(&g, [](Group*) {}));
    LowLatencyDispatchArgs da;
    da.x = x[r];
    da.topk_idx = idx[r];
    da.topk_weights = w[r];
    da.num_max_dispatch_tokens_per_rank = tmax;
    da.num_experts = E;
    da.use_fp8 = false;
    const LowLatencyDispatchResult d = buf.low_latency_dispatch(da);
    LowLatencyCombineArgs ca;
    ca.topk_idx = idx[r];
    ca.topk_weights = w[r];
    ca.handle = &d.handle;
    for (auto [h, msg] : {std::pair{H + 16, &wider[r]}, std::pair{H - 64, &narrower[r]}}) {
      const Tensor y = Tensor::zeros(DType::bf16, {E / R, R * tmax, h});
      ca.x = y;
      try {
        buf.low_latency_combine(ca);
      } catch (const Error& e) {
        *msg = std::string(error_code_name(e.code())) + ": " + e.what();
      }
    }
    ca.x = d.packed_recv_x;  // the dispatch's own H still combines
    const Tensor out = buf.low_latency_combine(ca).combined_x;
    EXPECT_EQ(out.shape(), (Shape{T, H}));
  });
  for (int r = 0; r < R; ++r) {
    for (const std::string* m : {&wider[static_cast<std::size_t>(r)], &narrower[static_cast<std::size_t>(r)]}) {
      EXPECT_NE(m->find("invalid_argument"), std::string::npos) << *m;
      EXPECT_NE(m->find("'x'"), std::string::npos) << *m;
      EXPECT_NE(m->find("H = 128 of the handle's dispatch"), std::string::npos) << *m;
    }
    EXPECT_NE(wider[static_cast<std::size_t>(r)].find("[2, 8, 144]"), std::string::npos) << wider[0];
    EXPECT_NE(narrower[static_cast<std::size_t>(r)].find("[2, 8, 64]"), std::string::npos) << narrower[0];
  }
}

}  // namespace
}  // namespace epmoe
