// The all-gather + reduce-scatter prepare/finalize (make_all_gather_prepare_finalize, semantics §8) with the CUDA
// experts on GPU ranks: R = gputest::thread_ranks() thread ranks over a threads Group (rank r on cuda:r, each on a
// stream of its own; R = 1 keeps everything on the device, R > 1 is the host-staged baseline), against the float64
// layer reference of the values the experts saw and the same layer on CPU ranks (BLAS experts): relative L2 <= 1e-2
// (semantics §13). Covered: bf16 and fp8 (float32 and UE8M0 scales) wires, H = 2048 and 2880, K = 8 and K = 1 with the
// router weight on the input and int32 ids, experts reducing or not, a rank with zero tokens, two forwards through
// one layer (an output given, then allocated). At R = 1 the experts read the caller's tensors themselves (no copy).
#include <gtest/gtest.h>

#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/stream.hpp>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/gpu_util.hpp"
#include "gpu/moe_layer_test_util.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::borrow;
using gputest::cuda_ok;

struct RankStream {
  cudaStream_t s = nullptr;
  std::unique_ptr<StreamGuard> guard;
  RankStream() {
    cuda_ok(cudaStreamCreate(&s), "cudaStreamCreate");
    guard = std::make_unique<StreamGuard>(Stream{s});
  }
  ~RankStream() {
    guard.reset();
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
};

struct Case : gputest::LayerCase {
  bool reduce = true;
  int experts(int R) const { return R * ((8 + R - 1) / R); }
  std::string name() const {
    std::string t = "T=[";
    for (std::size_t i = 0; i < T.size(); ++i) t += (i ? "," : "") + std::to_string(T[i]);
    return "all_gather " + t + "] H=" + std::to_string(H) + " K=" + std::to_string(K) +
           (fp8 ? (ue8m0 ? " fp8/ue8m0" : " fp8/f32") : " bf16") + (reduce ? " reduced" : " contiguous") +
           (weight_on_input ? " weight-on-input int32 ids" : "");
  }
};

gputest::Outs run_layer(const Case& c, const gputest::ExpertWeights& m, const gputest::Ins& in, int R, bool gpu) {
  gputest::Outs outs(static_cast<std::size_t>(R));
  const int El = c.experts(R) / R;
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    const auto ru = static_cast<std::size_t>(r);
    if (gpu) cuda_ok(cudaSetDevice(r), "cudaSetDevice");
    std::unique_ptr<RankStream> stream;
    if (gpu) stream = std::make_unique<RankStream>();
    ExpertsConfig ec;
    ec.reduce = c.reduce;
    std::shared_ptr<Experts> experts(gpu ? make_cuda_experts(ec) : make_blas_experts(ec));
    MoELayer layer(make_all_gather_prepare_finalize(borrow(g), c.options()), experts);
    const gputest::ExpertWeights w = gputest::rank_weights(m, r, El, gpu);
    for (int f = 0; f < c.forwards; ++f) {
      outs[ru].push_back(gputest::forward_checked(layer, c, c.name(), in[ru][static_cast<std::size_t>(f)], w,
                                                  c.experts(R), r, gpu, /*give_output=*/f == 0));
      EXPECT_EQ(layer.prepare_finalize().stage(), Stage::initial);
    }
    if (gpu) cuda_ok(cudaDeviceSynchronize(), "sync");
  });
  return outs;
}

void check_case(const Case& c, std::uint64_t seed) {
  const auto run = [&](const gputest::ExpertWeights& m, const gputest::Ins& in, int R, bool gpu) {
    return run_layer(c, m, in, R, gpu);
  };
  gputest::check_layer_case(c, c.name(), seed, [&](int R) { return c.experts(R); }, run, 80);
}

TEST(GpuMoELayerAllGather, Bf16AndFp8MatchFloat64AndTheCpuRanks) {
  const std::uint64_t seed = test::fresh_seed();
  std::uint64_t i = 0;
  for (const std::int64_t H : {std::int64_t{2048}, std::int64_t{2880}})
    for (int wire = 0; wire < 3; ++wire) {
      Case c;
      c.H = H;
      c.fp8 = wire > 0;
      c.ue8m0 = wire == 2;
      c.reduce = (i % 2) == 0;
      check_case(c, seed + i++);
    }
}

TEST(GpuMoELayerAllGather, ZeroTokensOnARankAndKOneWithTheWeightOnTheInput) {
  const std::uint64_t seed = test::fresh_seed();
  Case c;
  c.T = {40, 0};
  check_case(c, seed);
  Case k1;
  k1.set_k_one_weight_on_input_int32_ids();
  k1.reduce = false;
  check_case(k1, seed + 1);
  k1.fp8 = true;
  check_case(k1, seed + 2);
}

// R = 1 on one GPU: nothing is copied -- the experts read the caller's hidden states, ids and weights.
TEST(GpuMoELayerAllGather, OneRankHandsTheCallersTensorsToTheExperts) {
  if (gputest::thread_ranks() < 1) GTEST_SKIP() << "no GPU";
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  std::mt19937_64 rng(test::fresh_seed());
  const Tensor x = gputest::to_gpu(test::random_bf16(rng, 16, 256), 0);
  const Tensor idx_host = test::random_topk_idx(rng, 16, 4, 8);
  const Tensor idx = gputest::to_gpu(idx_host, 0);
  const Tensor w = gputest::to_gpu(test::random_topk_weights(rng, idx_host), 0);
  ThreadWorld world(1);
  auto pf = make_all_gather_prepare_finalize(world.group(0));
  pf->dispatch_a(gputest::prepare_inputs(x, idx, w, 8));
  const PrepareOutput out = pf->dispatch_b();
  EXPECT_EQ(out.hidden.data(), x.data());
  EXPECT_EQ(out.topk_idx.data(), idx.data());
  EXPECT_EQ(out.topk_weights.data(), w.data());
  EXPECT_TRUE(out.expert_num_tokens.device().is_cuda());
  const Tensor fused = gputest::to_device(Tensor::zeros(DType::bf16, {16, 256}));
  pf->combine_a(fused, WeightAndReduce::none);
  const Tensor y = gputest::to_cpu(pf->combine_b());
  for (std::int64_t i = 0; i < y.numel(); ++i) ASSERT_EQ(y.ptr<bf16_t>()[i].bits, 0) << i;
}

}  // namespace
}  // namespace epmoe
