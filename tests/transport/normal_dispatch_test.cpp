// Normal-mode dispatch and combine on thread ranks against the independent reference
// (tests/support/normal_reference.*): every output bit for bit, on every rank.
#include "transport/normal_harness.hpp"

namespace epmoe::test {
namespace {

NormalCase basic(int R, int E, int K, std::int64_t H, std::int64_t T) {
  NormalCase c;
  c.R = R;
  c.E = E;
  c.K = K;
  c.H = H;
  c.T.assign(static_cast<std::size_t>(R), T);
  return c;
}

// ---- ranks, top-k and hidden sizes ----

TEST(NormalDispatch, OneRank) { run_normal_case(basic(1, 8, 2, 128, 40)); }

TEST(NormalDispatch, RanksAndTopkSweepBf16) {
  for (int R : {1, 2, 3, 4, 8})
    for (int K : {1, 2, 8, 9}) {
      SCOPED_TRACE("R=" + std::to_string(R) + " K=" + std::to_string(K));
      NormalCase c = basic(R, 8 * R > K ? 8 * R : 16 * R, K, 128, 0);
      for (int r = 0; r < R; ++r) c.T[static_cast<std::size_t>(r)] = 10 + 7 * r;  // ranks differ in T
      c.p_minus_one = 0.1;
      c.combine_weights = true;
      run_normal_case(c);
      if (HasFatalFailure()) return;
    }
}

TEST(NormalDispatch, HiddenSizes) {
  for (std::int64_t H : {128, 2048, 2880, 4096, 7168}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    NormalCase c = basic(4, 32, 8, H, H > 2048 ? 6 : 20);
    c.bias_0 = true;
    run_normal_case(c);
    if (HasFatalFailure()) return;
  }
}

TEST(NormalDispatch, DeepSeekShapeSmallT) {
  NormalCase c = basic(8, 256, 8, 7168, 5);
  c.combine_weights = true;
  run_normal_case(c);
}

TEST(NormalDispatch, Int32TopkIdx) {
  NormalCase c = basic(3, 24, 4, 256, 30);
  c.int32_idx = true;
  c.p_minus_one = 0.2;
  run_normal_case(c);
}

TEST(NormalDispatch, WithoutTopkWeights) {
  NormalCase c = basic(2, 8, 3, 128, 16);
  c.weights = false;
  run_normal_case(c);
}

// E_local = 1024, the most a rank may own (semantics §1), on tiny rows; counts aligned, so every expert's is checked.
TEST(NormalDispatch, ThousandTwentyFourLocalExperts) {
  NormalCase c = basic(2, 2048, 4, 16, 30);
  c.alignment = 3;
  c.p_minus_one = 0.1;
  c.combine_weights = true;
  run_normal_case(c);
}

// ---- routing edge cases ----

TEST(NormalDispatch, SomeMinusOneIds) {
  NormalCase c = basic(4, 16, 8, 128, 40);
  c.p_minus_one = 0.5;
  c.combine_weights = true;
  run_normal_case(c);
}

TEST(NormalDispatch, AllIdsOfOneRankAreMinusOne) {
  NormalCase c = basic(4, 16, 4, 128, 30);
  c.all_minus_one_rank = 2;
  c.bias_0 = c.bias_1 = true;  // its combine is the biases alone
  run_normal_case(c);
}

TEST(NormalDispatch, RankWithZeroTokens) {
  NormalCase c = basic(3, 12, 4, 256, 20);
  c.T = {20, 0, 11};
  c.bias_0 = true;
  c.combine_weights = true;
  run_normal_case(c);
}

TEST(NormalDispatch, AllRanksZeroTokens) {
  NormalCase c = basic(2, 8, 2, 128, 0);
  run_normal_case(c);
}

TEST(NormalDispatch, EveryTokenToOneExpert) {
  NormalCase c = basic(4, 32, 4, 128, 25);
  c.only_expert = 21;  // on rank 2: the other ranks receive nothing
  c.combine_weights = true;
  run_normal_case(c);
}

// ---- counts ----

TEST(NormalDispatch, ExpertAlignment128) {
  NormalCase c = basic(2, 16, 4, 128, 50);
  c.alignment = 128;
  run_normal_case(c);
}

TEST(NormalDispatch, ExpertAlignment7WithMinusOnes) {
  NormalCase c = basic(3, 9, 3, 128, 33);
  c.alignment = 7;
  c.p_minus_one = 0.3;
  run_normal_case(c);
}

TEST(NormalDispatch, NumWorstTokensPadsOutputs) {
  NormalCase c = basic(4, 16, 4, 256, 20);
  c.num_worst_tokens = 4 * 20 + 5;  // enough for every rank, with padding rows
  c.combine_weights = true;
  c.bias_0 = true;
  run_normal_case(c);
}

TEST(NormalDispatch, NumWorstTokensExactFit) {
  NormalCase c = basic(2, 8, 8, 128, 15);  // K = 8 of 8 experts: every token goes to both ranks
  c.num_worst_tokens = 30;
  run_normal_case(c);
}

TEST(NormalDispatch, NumWorstTokensFp8) {
  NormalCase c = basic(3, 12, 2, 2880, 6);
  c.fp8 = true;
  c.scales = Scales::float32;
  c.num_worst_tokens = 40;
  run_normal_case(c);
}

// ---- cached dispatch ----

TEST(NormalDispatch, CachedDispatchEqualsUncached) {
  NormalCase c = basic(4, 16, 4, 256, 30);
  c.p_minus_one = 0.2;
  c.cached = true;
  run_normal_case(c);
}

TEST(NormalDispatch, CachedDispatchWithoutTopk) {
  NormalCase c = basic(3, 12, 3, 128, 17);
  c.cached = true;
  c.cached_topk = false;
  run_normal_case(c);
}

TEST(NormalDispatch, CachedDispatchFp8WithWorstTokens) {
  NormalCase c = basic(2, 8, 2, 512, 12);
  c.fp8 = true;
  c.scales = Scales::ue8m0;
  c.num_worst_tokens = 30;
  c.cached = true;
  run_normal_case(c);
}

// ---- fp8 ----

TEST(NormalDispatch, Fp8Float32Scales) {
  for (std::int64_t H : {128, 2880, 7168}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    NormalCase c = basic(4, 32, 8, H, H > 128 ? 6 : 30);
    c.fp8 = true;
    c.scales = Scales::float32;
    run_normal_case(c);
    if (HasFatalFailure()) return;
  }
}

TEST(NormalDispatch, Fp8Ue8m0Scales) {
  for (std::int64_t H : {16, 2880, 7168}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    NormalCase c = basic(3, 12, 2, H, 8);
    c.fp8 = true;
    c.scales = Scales::ue8m0;
    c.p_minus_one = 0.25;
    run_normal_case(c);
    if (HasFatalFailure()) return;
  }
}

// DeepGEMM's column-major TMA-aligned scales (float32 and packed UE8M0) as x_scales: received row-major, the same
// bytes as from row-major scales; T not a multiple of 4 (padded columns), T = 1, a rank with no tokens, cached.
TEST(NormalDispatch, Fp8ColumnMajorScales) {
  for (Scales s : {Scales::float32, Scales::ue8m0})
    for (std::int64_t H : {2048, 2880, 7168}) {
      SCOPED_TRACE("H=" + std::to_string(H) + (s == Scales::ue8m0 ? " ue8m0" : " float32"));
      NormalCase c = basic(4, 16, 4, H, 7);
      c.T = {7, 1, 0, 13};
      c.fp8 = true;
      c.scales = s;
      c.scale_layout = ScaleLayout::column_major;
      c.cached = true;
      c.num_worst_tokens = H == 2880 ? 40 : 0;
      run_normal_case(c);
      if (HasFatalFailure()) return;
    }
}

// ---- combine ----

TEST(NormalCombine, BiasesAndWeights) {
  NormalCase c = basic(4, 16, 8, 512, 25);
  c.bias_0 = c.bias_1 = true;
  c.combine_weights = true;
  c.p_minus_one = 0.2;
  run_normal_case(c);
}

TEST(NormalCombine, OnlyBias1) {
  NormalCase c = basic(2, 8, 2, 128, 25);
  c.bias_1 = true;
  run_normal_case(c);
}

TEST(NormalCombine, EightRanksWeightsRankDifferentT) {
  NormalCase c = basic(8, 64, 9, 256, 0);
  c.T = {3, 0, 17, 9, 1, 30, 2, 11};
  c.combine_weights = true;
  c.bias_0 = true;
  run_normal_case(c);
}

// Repeated calls on one buffer: handles stay independent, results stay exact.
TEST(NormalDispatch, RepeatedCallsOnOneBuffer) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = basic(3, 12, 4, 128, 20);
  const auto in1 = make_inputs(rng, c), in2 = make_inputs(rng, c);
  const auto want1 = reference_dispatch(in1, c.E, 1, 0), want2 = reference_dispatch(in2, c.E, 1, 0);
  std::vector<DispatchResult> got1(3), got2(3);
  run_thread_ranks(3, [&](Group& g) {
    Buffer buf(borrow(g));
    const int r = g.rank();
    for (int iter = 0; iter < 3; ++iter) {
      const auto& in = (iter % 2 ? in2 : in1)[static_cast<std::size_t>(r)];
      auto res = buf.dispatch(dispatch_args(in, buf.get_dispatch_layout(in.topk_idx, c.E), c));
      (iter % 2 ? got2 : got1)[static_cast<std::size_t>(r)] = std::move(res);
    }
  });
  for (int r = 0; r < 3; ++r) {
    expect_dispatch_eq(got1[static_cast<std::size_t>(r)], want1[static_cast<std::size_t>(r)], c, r, false, 20);
    expect_dispatch_eq(got2[static_cast<std::size_t>(r)], want2[static_cast<std::size_t>(r)], c, r, false, 20);
  }
}

// Outputs above 1 MiB come from the buffer's recycling pool: ones still held must not be reused by
// later calls, released ones are, and outputs may outlive their Buffer.
TEST(NormalDispatch, LargeOutputsHeldAcrossCallsAndBeyondTheBuffer) {
  std::mt19937_64 rng(fresh_seed());
  NormalCase c = basic(2, 8, 2, 2048, 400);  // recv_x of 1.6 to 3.2 MB per rank
  const auto in1 = make_inputs(rng, c), in2 = make_inputs(rng, c);
  const auto want1 = reference_dispatch(in1, c.E, 1, 0), want2 = reference_dispatch(in2, c.E, 1, 0);
  std::vector<DispatchResult> held(2), last(2);
  std::vector<const void*> first_storage(2), reused_storage(2);
  run_thread_ranks(2, [&](Group& g) {
    const int r = g.rank();
    Buffer buf(borrow(g));
    auto call = [&](const std::vector<RefDispatchInput>& in) {
      const auto& mine = in[static_cast<std::size_t>(r)];
      return buf.dispatch(dispatch_args(mine, buf.get_dispatch_layout(mine.topk_idx, c.E), c));
    };
    held[static_cast<std::size_t>(r)] = call(in1);
    for (int i = 0; i < 3; ++i) {
      DispatchResult tmp = call(in2);  // released at the end of each iteration
      if (i == 0) first_storage[static_cast<std::size_t>(r)] = tmp.recv_x.data();
      if (i == 2) reused_storage[static_cast<std::size_t>(r)] = tmp.recv_x.data();
    }
    last[static_cast<std::size_t>(r)] = call(in2);
  });  // the buffers are gone; the results still own their storage
  for (int r = 0; r < 2; ++r) {
    expect_dispatch_eq(held[static_cast<std::size_t>(r)], want1[static_cast<std::size_t>(r)], c, r, false, 400);
    expect_dispatch_eq(last[static_cast<std::size_t>(r)], want2[static_cast<std::size_t>(r)], c, r, false, 400);
    EXPECT_NE(held[static_cast<std::size_t>(r)].recv_x.data(), first_storage[static_cast<std::size_t>(r)]);
    EXPECT_EQ(first_storage[static_cast<std::size_t>(r)], reused_storage[static_cast<std::size_t>(r)]) << "storage not recycled";
  }
}

// A hand-made case, independent of both the reference and the code: R = 2, E = 4 (2 per rank).
TEST(NormalDispatch, HandMadeTwoRanks) {
  // rank 0: t0 -> {0, 3}, t1 -> {1, -1}, t2 -> {2, -1};  rank 1: t0 -> {3, 2}, t1 -> {0, 2}.
  std::int64_t ids0[] = {0, 3, 1, -1, 2, -1}, ids1[] = {3, 2, 0, 2};
  float w0[] = {0.5f, 0.25f, 1.0f, 0.0f, 2.0f, 0.0f}, w1[] = {3.0f, 4.0f, 5.0f, 6.0f};
  std::vector<DispatchResult> got(2);
  std::vector<CombineResult> comb(2);
  // x rows: token t of rank r is the constant 10*r + t + 1.
  std::vector<Tensor> xs;
  for (int r = 0; r < 2; ++r) {
    const std::int64_t T = r == 0 ? 3 : 2;
    Tensor x = Tensor::empty(DType::bf16, {T, 8});
    for (std::int64_t i = 0; i < T * 8; ++i) x.ptr<bf16_t>()[i] = float_to_bf16(static_cast<float>(10 * r + i / 8 + 1));
    xs.push_back(x);
  }
  run_thread_ranks(2, [&](Group& g) {
    Buffer buf(borrow(g));
    const int r = g.rank();
    const std::int64_t T = r == 0 ? 3 : 2;
    TensorView idx(r == 0 ? ids0 : ids1, DType::int64, {T, 2});
    TensorView w(r == 0 ? w0 : w1, DType::fp32, {T, 2});
    const DispatchLayout l = buf.get_dispatch_layout(idx, 4);
    DispatchArgs a = make_dispatch_args(l, xs[static_cast<std::size_t>(r)], idx, w);
    got[static_cast<std::size_t>(r)] = buf.dispatch(a);
    CombineArgs ca;
    ca.x = got[static_cast<std::size_t>(r)].recv_x;
    ca.handle = &got[static_cast<std::size_t>(r)].handle;
    ca.topk_weights = got[static_cast<std::size_t>(r)].recv_topk_weights;
    comb[static_cast<std::size_t>(r)] = buf.combine(ca);
  });
  // Rank 0 receives (rank 0: t0, t1) then (rank 1: t1); rank 1 receives (rank 0: t0, t2) then (rank 1: t0, t1).
  auto row_value = [](const DispatchResult& d, int row) { return bf16_to_float(d.recv_x.ptr<bf16_t>()[row * 8]); };
  ASSERT_EQ(got[0].recv_x.size(0), 3);
  EXPECT_EQ(row_value(got[0], 0), 1.0f);
  EXPECT_EQ(row_value(got[0], 1), 2.0f);
  EXPECT_EQ(row_value(got[0], 2), 12.0f);
  ASSERT_EQ(got[1].recv_x.size(0), 4);
  EXPECT_EQ(row_value(got[1], 0), 1.0f);
  EXPECT_EQ(row_value(got[1], 1), 3.0f);
  EXPECT_EQ(row_value(got[1], 2), 11.0f);
  EXPECT_EQ(row_value(got[1], 3), 12.0f);
  const std::int64_t idx0[] = {0, -1, 1, -1, 0, -1};
  const std::int64_t idx1[] = {-1, 1, 0, -1, 1, 0, -1, 0};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(got[0].recv_topk_idx.ptr<std::int64_t>()[i], idx0[i]) << i;
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got[1].recv_topk_idx.ptr<std::int64_t>()[i], idx1[i]) << i;
  const float wt1[] = {0.0f, 0.25f, 2.0f, 0.0f, 3.0f, 4.0f, 0.0f, 6.0f};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got[1].recv_topk_weights.ptr<float>()[i], wt1[i]) << i;
  EXPECT_EQ(got[0].num_recv_tokens_per_expert_list, (std::vector<int>{2, 1}));
  EXPECT_EQ(got[1].num_recv_tokens_per_expert_list, (std::vector<int>{3, 2}));
  const std::int32_t prefix[] = {2, 2, 3, 4};
  EXPECT_EQ(0, std::memcmp(got[0].handle.rank_prefix_matrix.data(), prefix, sizeof(prefix)));
  const std::int32_t send_pos0[] = {0, 0, 1, -1, -1, 1}, send_pos1[] = {-1, 2, 2, 3};
  EXPECT_EQ(0, std::memcmp(got[0].handle.send_pos.data(), send_pos0, sizeof(send_pos0)));
  EXPECT_EQ(0, std::memcmp(got[1].handle.send_pos.data(), send_pos1, sizeof(send_pos1)));
  // Combine of recv_x: rank 0 t0 went to both ranks -> 2; t1, t2 once; rank 1 t0 once -> 11, t1 to both -> 24.
  const float c0[] = {2.0f, 2.0f, 3.0f}, c1[] = {11.0f, 24.0f};
  for (int t = 0; t < 3; ++t) EXPECT_EQ(bf16_to_float(comb[0].combined_x.ptr<bf16_t>()[t * 8 + 5]), c0[t]) << t;
  for (int t = 0; t < 2; ++t) EXPECT_EQ(bf16_to_float(comb[1].combined_x.ptr<bf16_t>()[t * 8 + 5]), c1[t]) << t;
  // Weights come back whole: each rank returned the weights of its own experts.
  for (int i = 0; i < 6; ++i) EXPECT_EQ(comb[0].combined_topk_weights.ptr<float>()[i], w0[i]) << i;
  for (int i = 0; i < 4; ++i) EXPECT_EQ(comb[1].combined_topk_weights.ptr<float>()[i], w1[i]) << i;
}

}  // namespace
}  // namespace epmoe::test
