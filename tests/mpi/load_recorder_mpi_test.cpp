// MoELayer feeding an ExpertLoadRecorder over MPI ranks (semantics §9): every process regenerates every rank's
// routing from the shared seed and counts it by hand; each rank's recorded loads must be its experts' slice of that
// count over the window, and global_loads (one all-gather over the MPI group) the whole count. Normal, low-latency
// and automatic (alternating) modes; the last rank sends no tokens on one step.
#include <epmoe/eplb.hpp>
#include <epmoe/moe.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "mpi/mpi_test_util.hpp"

namespace epmoe::test {
namespace {

using i64 = std::int64_t;
using V = std::vector<i64>;

constexpr int kK = 2, kTmax = 16, kSteps = 5;
constexpr i64 kH = 128, kN = 32, kWindow = 3;

struct Step {
  Tensor x, idx, w;
};

Step make_step(std::uint64_t seed, int rank, int R, int step, int E) {
  auto rng = rank_rng(seed, rank, 100 + static_cast<std::uint64_t>(step));
  const i64 T = rank == R - 1 && step == 2 ? 0 : 1 + static_cast<i64>(rng() % kTmax);
  RoutingOptions o;
  o.p_minus_one = 0.2;
  Step s{random_bf16(rng, T, kH), random_topk_idx(rng, T, kK, E, o), {}};
  s.w = random_topk_weights(rng, s.idx);
  return s;
}

void run_mode(DispatchMode mode) {
  const std::uint64_t seed = shared_seed();
  const int R = world_size(), r = world_rank(), El = 2, E = El * R;
  auto rng = rank_rng(seed, 0, 1);  // the weights: the same on every rank
  const Tensor w1 = random_bf16(rng, E * 2 * kN, kH, 1.0f / std::sqrt(static_cast<float>(kH)));
  const Tensor w2 = random_bf16(rng, E * kH, kN, 1.0f / std::sqrt(static_cast<float>(kN)));
  const TensorView w1v(w1.ptr<bf16_t>() + r * El * 2 * kN * kH, DType::bf16, {El, 2 * kN, kH});
  const TensorView w2v(w2.ptr<bf16_t>() + r * El * kH * kN, DType::bf16, {El, kH, kN});
  ExpertsConfig standard, batched;
  batched.format = ActivationFormat::batched_experts;
  const auto group = test_group();
  auto buffer = std::make_shared<Buffer>(group);
  MoELayer layer(buffer, mode, kTmax, std::shared_ptr<Experts>(make_reference_experts(standard)),
                 std::shared_ptr<Experts>(make_reference_experts(batched)));
  auto recorder = std::make_shared<ExpertLoadRecorder>(1, E, R, kWindow);
  layer.set_load_recorder(recorder, 0);
  std::vector<V> counts;  // every rank's routing, counted by hand, per step
  for (int s = 0; s < kSteps; ++s) {
    V c(static_cast<size_t>(E), 0);
    for (int q = 0; q < R; ++q) {
      const Step st = make_step(seed, q, R, s, E);
      for (i64 i = 0; i < st.idx.numel(); ++i)
        if (const i64 e = st.idx.ptr<i64>()[i]; e >= 0) ++c[static_cast<size_t>(e)];
    }
    counts.push_back(c);
    const Step mine = make_step(seed, r, R, s, E);
    MoEForwardArgs a;
    a.hidden = mine.x;
    a.w1 = w1v;
    a.w2 = w2v;
    a.topk_idx = mine.idx;
    a.topk_weights = mine.w;
    a.global_num_experts = E;
    a.is_extend_in_batch = s % 2 == 0;
    layer.forward(a);
    V want(static_cast<size_t>(E), 0);
    for (size_t k = counts.size() > kWindow ? counts.size() - kWindow : 0; k < counts.size(); ++k)
      for (int e = 0; e < E; ++e) want[e] += counts[k][e];
    V slice(static_cast<size_t>(E), 0);
    for (int e = r * El; e < (r + 1) * El; ++e) slice[e] = want[e];
    EXPECT_EQ(recorder->loads(), slice) << dispatch_mode_name(mode) << " rank " << r << " step " << s;
    EXPECT_EQ(recorder->global_loads(*group), want) << dispatch_mode_name(mode) << " step " << s;
  }
}

TEST(MpiLoadRecorder, NormalModeGlobalLoadsEqualTheHandCount) { run_mode(DispatchMode::normal); }
TEST(MpiLoadRecorder, LowLatencyModeGlobalLoadsEqualTheHandCount) { run_mode(DispatchMode::low_latency); }
TEST(MpiLoadRecorder, AutomaticModeGlobalLoadsEqualTheHandCount) { run_mode(DispatchMode::automatic); }

}  // namespace
}  // namespace epmoe::test
