// The all-gather + reduce-scatter prepare/finalize and Group::reduce_scatter_sum over MPI, bit for bit against the
// threads backend on the same inputs: every process regenerates every rank's inputs from the shared seed, runs the
// layer on thread ranks inside the process, and compares its own rank's MPI output with that rank's threads output.
#include <epmoe/moe.hpp>

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "mpi/mpi_test_util.hpp"

namespace epmoe::test {
namespace {

struct Inputs {
  Tensor x, topk_idx, topk_weights;
};

constexpr int kE_per_rank = 2, kK = 3;
constexpr std::int64_t kN = 32;

Inputs make_inputs(std::uint64_t seed, int rank, int R, std::int64_t H, bool zero_rank) {
  auto rng = rank_rng(seed, rank, 7);
  const std::int64_t T = zero_rank && rank == R - 1 ? 0 : 3 + static_cast<std::int64_t>(rng() % 20);
  RoutingOptions ro;
  ro.p_minus_one = 0.15;
  Inputs in;
  in.x = random_bf16(rng, T, H);
  in.topk_idx = random_topk_idx(rng, T, kK, kE_per_rank * R, ro);
  in.topk_weights = random_topk_weights(rng, in.topk_idx);
  return in;
}

struct Weights {
  Tensor w1, w2;  // all experts
};

Weights make_weights(std::uint64_t seed, int E, std::int64_t H) {
  auto rng = rank_rng(seed, -1, 8);
  Tensor w1 = random_bf16(rng, E * 2 * kN, H, 0.05f), w2 = random_bf16(rng, E * H, kN, 0.1f);
  return {Tensor::wrap(TensorView(w1.data(), DType::bf16, {E, 2 * kN, H}), std::make_shared<Tensor>(w1)),
          Tensor::wrap(TensorView(w2.data(), DType::bf16, {E, H, kN}), std::make_shared<Tensor>(w2))};
}

Tensor forward(std::shared_ptr<Group> group, const Inputs& in, const Weights& w, DispatchDtype dtype) {
  const int r = group->rank(), R = group->size();
  PrepareFinalizeOptions po;
  po.dispatch_dtype = dtype;
  MoELayer layer(make_all_gather_prepare_finalize(std::move(group), po), make_reference_experts());
  MoEForwardArgs a;
  a.hidden = in.x;
  a.w1 = w.w1.view().slice_rows(r * kE_per_rank, (r + 1) * kE_per_rank);
  a.w2 = w.w2.view().slice_rows(r * kE_per_rank, (r + 1) * kE_per_rank);
  a.topk_idx = in.topk_idx;
  a.topk_weights = in.topk_weights;
  a.global_num_experts = kE_per_rank * R;
  return layer.forward(a).output;
}

void expect_mpi_equals_threads(std::int64_t H, DispatchDtype dtype, bool zero_rank) {
  const std::uint64_t seed = shared_seed();
  const int R = world_size(), me = world_rank();
  const Weights w = make_weights(seed, kE_per_rank * R, H);
  std::vector<Inputs> inputs;
  for (int r = 0; r < R; ++r) inputs.push_back(make_inputs(seed, r, R, H, zero_rank));
  std::vector<Tensor> threads(static_cast<std::size_t>(R));
  run_thread_ranks(R, [&](Group& g) {
    std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
    threads[static_cast<std::size_t>(g.rank())] = forward(group, inputs[static_cast<std::size_t>(g.rank())], w, dtype);
  });
  const Tensor mine = forward(test_group(), inputs[static_cast<std::size_t>(me)], w, dtype);
  const Tensor& want = threads[static_cast<std::size_t>(me)];
  ASSERT_EQ(mine.shape(), want.shape());
  if (mine.nbytes())  // a rank with no tokens has empty outputs (null data): memcmp must not see them
    EXPECT_EQ(std::memcmp(mine.data(), want.data(), mine.nbytes()), 0) << "rank " << me << " seed " << seed;
}

TEST(MpiAllGatherMode, Bf16LayerMatchesTheThreadsBackend) { expect_mpi_equals_threads(128, DispatchDtype::bf16, false); }
TEST(MpiAllGatherMode, Fp8LayerWithAPartialScaleGroupMatchesTheThreadsBackend) {
  expect_mpi_equals_threads(2880, DispatchDtype::fp8, false);
}
TEST(MpiAllGatherMode, ZeroTokenRankMatchesTheThreadsBackend) { expect_mpi_equals_threads(256, DispatchDtype::bf16, true); }

TEST(MpiAllGatherMode, ReduceScatterSumsInRankOrderBitForBit) {
  const std::uint64_t seed = shared_seed();
  const int R = world_size(), me = world_rank();
  const std::size_t count = 3001;
  std::vector<std::vector<float>> send(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    auto rng = rank_rng(seed, r, 9);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (std::size_t i = 0; i < static_cast<std::size_t>(R) * count; ++i)
      send[static_cast<std::size_t>(r)].push_back(u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 30) - 15));
  }
  std::vector<float> got(count, -3.0f);
  auto g = test_group();
  g->reduce_scatter_sum(send[static_cast<std::size_t>(me)].data(), got.data(), count, "test reduce_scatter");
  for (std::size_t i = 0; i < count; ++i) {
    float want = send[0][static_cast<std::size_t>(me) * count + i];
    for (int q = 1; q < R; ++q) want += send[static_cast<std::size_t>(q)][static_cast<std::size_t>(me) * count + i];
    ASSERT_EQ(std::memcmp(&got[i], &want, 4), 0) << "rank " << me << " i " << i;
  }
}

}  // namespace
}  // namespace epmoe::test
