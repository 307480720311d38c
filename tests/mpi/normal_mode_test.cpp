// Normal-mode dispatch and combine over MPI, bit for bit against the threads backend on the same
// inputs (semantics §13). Every process regenerates every rank's inputs from the shared seed, runs the
// threads backend over all of them (epmoe::run_thread_ranks, inside the process), and compares its
// own rank's MPI results with the threads result of the same rank.
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/mpi.hpp>
#include <epmoe/quant.hpp>

#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "mpi/compare.hpp"
#include "mpi/mpi_test_util.hpp"

namespace epmoe::test {
namespace {

struct NormalCase {
  std::string name;
  int E = 0;  // 0: 4 * R
  int K = 4;
  std::int64_t H = 128;
  bool fp8 = false;
  bool ue8m0 = false;
  bool weights = true;
  bool int32_idx = false;
  double p_minus_one = 0.1;
  int zero_token_rank = -1;  // this rank has T = 0
  int alignment = 1;
  int num_worst_tokens = 0;
  bool bias = false;
  bool combine_weights = false;
  bool cached = false;
  /// This process passes column-major x_scales (the threads reference row-major ones): the same bytes must arrive.
  bool column_major_scales = false;
};

struct RankInput {
  Tensor x, x_scales, topk_idx, topk_weights;
};

Tensor random_bytes_tensor(std::mt19937_64& rng, DType dtype, std::int64_t rows, std::int64_t cols) {
  Tensor t = Tensor::empty(dtype, {rows, cols});
  auto* p = static_cast<std::uint8_t*>(t.data());
  for (std::size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<std::uint8_t>(rng());
  return t;
}

RankInput make_input(std::uint64_t seed, int rank, int R, const NormalCase& c) {
  auto rng = rank_rng(seed, rank, 1);
  const std::int64_t T = rank == c.zero_token_rank ? 0 : 5 + static_cast<std::int64_t>(rng() % 40);
  const int E = c.E ? c.E : 4 * R;
  RankInput in;
  if (c.fp8) {
    in.x = random_bytes_tensor(rng, DType::fp8_e4m3, T, c.H);  // moved verbatim: any bytes do
    const std::int64_t G = num_scale_groups(c.H);
    in.x_scales =
        c.ue8m0 ? random_bytes_tensor(rng, DType::int32, T, (G + 3) / 4) : random_f32(rng, T, G, 1e-3f, 1.0f);
  } else {
    in.x = random_bf16(rng, T, c.H);
  }
  RoutingOptions o;
  o.p_minus_one = c.p_minus_one;
  Tensor idx = random_topk_idx(rng, T, c.K, E, o);
  if (c.weights) in.topk_weights = random_topk_weights(rng, idx);
  if (c.int32_idx) {
    Tensor i32 = Tensor::empty(DType::int32, idx.shape());
    for (std::int64_t i = 0; i < idx.numel(); ++i)
      i32.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(idx.ptr<std::int64_t>()[i]);
    idx = i32;
  }
  in.topk_idx = idx;
  return in;
}

/// What one rank computed (inputs of combine included, drawn after the dispatch from the seed).
struct RankRun {
  DispatchResult dispatch;
  std::optional<DispatchResult> cached;
  Tensor y, y_weights, bias_0, bias_1;
  CombineResult combine;
};

DispatchArgs dispatch_args(const RankInput& in, const DispatchLayout& layout, const NormalCase& c) {
  DispatchArgs a = make_dispatch_args(layout, in.x, in.topk_idx, in.topk_weights.view());
  a.x_scales = in.x_scales.view();
  a.expert_alignment = c.alignment;
  a.num_worst_tokens = c.num_worst_tokens;
  return a;
}

/// The same steps on any backend: dispatch (and a cached dispatch), then combine of random rows.
RankRun run_rank(Buffer& buffer, const RankInput& in, std::uint64_t seed, const NormalCase& c) {
  const int E = c.E ? c.E : 4 * buffer.num_ranks();
  RankRun run;
  const DispatchLayout layout = buffer.get_dispatch_layout(in.topk_idx, E);
  run.dispatch = buffer.dispatch(dispatch_args(in, layout, c));
  if (c.cached) {
    DispatchArgs a;
    a.x = in.x;
    a.x_scales = in.x_scales.view();
    a.handle = &run.dispatch.handle;
    run.cached = buffer.dispatch(a);
  }
  auto rng = rank_rng(seed, buffer.rank(), 2);
  const std::int64_t rows = run.dispatch.recv_x.size(0), T = in.x.size(0);
  run.y = random_bf16(rng, rows, c.H);
  if (c.combine_weights) run.y_weights = random_f32(rng, rows, c.K, 0.0f, 1.0f);
  if (c.bias) {
    run.bias_0 = random_bf16(rng, T, c.H);
    run.bias_1 = random_bf16(rng, T, c.H);
  }
  CombineArgs ca;
  ca.x = run.y;
  ca.handle = &run.dispatch.handle;
  ca.topk_weights = run.y_weights.view();
  ca.bias_0 = run.bias_0.view();
  ca.bias_1 = run.bias_1.view();
  run.combine = buffer.combine(ca);
  return run;
}

void expect_same_dispatch(const DispatchResult& got, const DispatchResult& want) {
  EXPECT_TRUE(same_tensor(got.recv_x, want.recv_x)) << "recv_x";
  EXPECT_TRUE(same_tensor(got.recv_x_scales, want.recv_x_scales)) << "recv_x_scales";
  EXPECT_TRUE(same_tensor(got.recv_topk_idx, want.recv_topk_idx)) << "recv_topk_idx";
  EXPECT_TRUE(same_tensor(got.recv_topk_weights, want.recv_topk_weights)) << "recv_topk_weights";
  EXPECT_EQ(got.num_recv_tokens_per_expert_list, want.num_recv_tokens_per_expert_list);
  const NormalHandle &g = got.handle, &w = want.handle;
  EXPECT_TRUE(same_tensor(g.rank_prefix_matrix, w.rank_prefix_matrix)) << "rank_prefix_matrix";
  EXPECT_TRUE(same_tensor(g.is_token_in_rank, w.is_token_in_rank)) << "is_token_in_rank";
  EXPECT_TRUE(same_tensor(g.send_pos, w.send_pos)) << "send_pos";
  EXPECT_TRUE(same_tensor(g.recv_src_idx, w.recv_src_idx)) << "recv_src_idx";
  EXPECT_TRUE(same_tensor(g.num_recv_tokens_per_expert, w.num_recv_tokens_per_expert)) << "num_recv_tokens_per_expert";
  EXPECT_EQ(g.num_tokens, w.num_tokens);
  EXPECT_EQ(g.num_recv_tokens, w.num_recv_tokens);
  EXPECT_EQ(g.num_recv_rows, w.num_recv_rows);
  EXPECT_EQ(g.hidden, w.hidden);
  EXPECT_EQ(g.num_experts, w.num_experts);
  EXPECT_EQ(g.expert_alignment, w.expert_alignment);
}

void run_case(const NormalCase& c) {
  SCOPED_TRACE(c.name);
  const std::uint64_t seed = shared_seed();
  const int R = world_size(), me = world_rank();
  std::vector<RankInput> inputs;
  for (int r = 0; r < R; ++r) inputs.push_back(make_input(seed, r, R, c));

  // The reference: the threads backend over every rank's inputs, in this process.
  std::vector<RankRun> threads(static_cast<std::size_t>(R));
  run_thread_ranks(R, [&](Group& g) {
    Buffer buffer(std::shared_ptr<Group>(&g, [](Group*) {}));
    const auto r = static_cast<std::size_t>(g.rank());
    threads[r] = run_rank(buffer, inputs[r], seed, c);
  });

  Buffer buffer(test_group());
  RankInput mine = inputs[static_cast<std::size_t>(me)];
  if (c.column_major_scales) mine.x_scales = scales_in_layout(mine.x_scales, ScaleLayout::column_major);
  const RankRun got = run_rank(buffer, mine, seed, c);
  const RankRun& want = threads[static_cast<std::size_t>(me)];
  {
    SCOPED_TRACE("dispatch");
    expect_same_dispatch(got.dispatch, want.dispatch);
  }
  if (c.cached) {
    SCOPED_TRACE("cached dispatch");
    expect_same_dispatch(*got.cached, *want.cached);
  }
  EXPECT_TRUE(same_tensor(got.combine.combined_x, want.combine.combined_x)) << "combined_x";
  EXPECT_TRUE(same_tensor(got.combine.combined_topk_weights, want.combine.combined_topk_weights))
      << "combined_topk_weights";
}

TEST(MpiNormalMode, Bf16DispatchAndCombineMatchTheThreadsBackend) {
  run_case({.name = "bf16", .combine_weights = true});
}

TEST(MpiNormalMode, Fp8WithFloatScalesMatchesTheThreadsBackend) {
  run_case({.name = "fp8 float32 scales", .H = 384, .fp8 = true, .cached = true});
}

TEST(MpiNormalMode, Fp8WithUe8m0ScalesAndPartialScaleGroupMatchesTheThreadsBackend) {
  run_case({.name = "fp8 ue8m0, H = 2880", .K = 8, .H = 2880, .fp8 = true, .ue8m0 = true});
}

TEST(MpiNormalMode, Fp8WithColumnMajorScalesMatchesTheThreadsBackend) {
  run_case({.name = "fp8 column-major float32 scales", .H = 2880, .fp8 = true, .cached = true,
            .column_major_scales = true});
  run_case({.name = "fp8 column-major ue8m0 scales", .H = 2048, .fp8 = true, .ue8m0 = true,
            .zero_token_rank = world_size() - 1, .column_major_scales = true});
}

TEST(MpiNormalMode, ZeroTokenRankBiasesAlignmentAndInt32IdsMatchTheThreadsBackend) {
  run_case({.name = "zero-token rank",
            .K = 3,
            .int32_idx = true,
            .p_minus_one = 0.3,
            .zero_token_rank = world_size() - 1,
            .alignment = 4,
            .bias = true,
            .combine_weights = true,
            .cached = true});
}

TEST(MpiNormalMode, WithoutWeightsAndWithWorstCasePaddingMatchesTheThreadsBackend) {
  run_case({.name = "num_worst_tokens", .weights = false, .zero_token_rank = 0, .num_worst_tokens = 200});
}

TEST(MpiNormalMode, RankWhoseTokensAllGoNowhereMatchesTheThreadsBackend) {
  run_case({.name = "all -1", .K = 2, .p_minus_one = 1.0, .bias = true});
}

TEST(MpiNormalMode, BadIdsAreRejectedOnEveryRankBeforeAnyExchange) {
  // Every rank passes an expert id == E: each raises invalid_argument locally (nothing was sent),
  // and the same buffer then dispatches correctly (no stray messages are left on the group).
  const std::uint64_t seed = shared_seed();
  const int R = world_size(), me = world_rank();
  NormalCase c{.name = "bad ids"};
  const RankInput good = make_input(seed, me, R, c);
  Buffer buffer(test_group());
  const DispatchLayout layout = buffer.get_dispatch_layout(good.topk_idx, 4 * R);
  RankInput bad = good;
  bad.topk_idx = Tensor::empty(DType::int64, good.topk_idx.shape());
  std::memcpy(bad.topk_idx.data(), good.topk_idx.data(), good.topk_idx.nbytes());
  bad.topk_idx.ptr<std::int64_t>()[0] = 4 * R;  // T >= 5 on every rank here
  auto e = catch_error([&] { buffer.dispatch(dispatch_args(bad, layout, c)); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::invalid_argument) << e->what();
  const DispatchResult after = buffer.dispatch(dispatch_args(good, layout, c));
  EXPECT_EQ(after.recv_x.size(1), c.H);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiNormalMode, HiddenSizeDifferingOnOneRankIsAMismatchOnEveryRank) {
  const std::uint64_t seed = shared_seed();
  const int R = world_size(), me = world_rank();
  NormalCase c{.name = "H mismatch"};
  if (me == R - 1) c.H = 256;
  const RankInput in = make_input(seed, me, R, c);
  Buffer buffer(test_group());
  const DispatchLayout layout = buffer.get_dispatch_layout(in.topk_idx, 4 * R);
  auto e = catch_error([&] { buffer.dispatch(dispatch_args(in, layout, c)); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), ErrorCode::rank_mismatch) << e->what();
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace epmoe::test
