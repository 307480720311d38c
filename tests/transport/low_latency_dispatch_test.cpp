// Low-latency dispatch and combine on thread ranks against the independent reference
// (tests/support/low_latency_reference): layout, counts, src_info, layout_range and rows bit for bit,
// fp8 bytes equal to quantize_fp8 of the source row, combine bit for bit.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "transport/low_latency_test_common.hpp"

namespace epmoe::test::ll {
namespace {

// Runs `rounds` x (dispatch, combine) on fresh inputs and checks every rank's outputs. The second
// round reuses both halves of the window, so it exercises the "consumed" waits too.
void run_case(const Case& c, int rounds = 2) {
  std::mt19937_64 rng(fresh_seed());
  std::vector<std::vector<LowLatencyRankInput>> inputs;
  std::vector<std::vector<Tensor>> expert_out;
  for (int i = 0; i < rounds; ++i) {
    inputs.push_back(make_inputs(rng, c));
    expert_out.push_back(make_expert_out(rng, c));
  }
  std::vector<std::vector<DispatchCopy>> got(static_cast<std::size_t>(rounds),
                                             std::vector<DispatchCopy>(static_cast<std::size_t>(c.R)));
  std::vector<std::vector<Tensor>> combined(static_cast<std::size_t>(rounds),
                                            std::vector<Tensor>(static_cast<std::size_t>(c.R)));
  std::vector<std::vector<Tensor>> outs(static_cast<std::size_t>(rounds));
  for (int i = 0; i < rounds; ++i)
    for (int r = 0; r < c.R; ++r) {
      // Caller-provided `out` (poisoned) on odd rounds.
      Tensor o = Tensor::empty(DType::bf16, {c.tokens(r), c.H});
      for (std::int64_t j = 0; j < o.numel(); ++j) o.ptr<bf16_t>()[j].bits = 0x7fc1;
      outs[static_cast<std::size_t>(i)].push_back(o);
    }

  run_buffers(c.R, [&](Buffer& buffer, Group& g) {
    const int r = g.rank();
    for (int i = 0; i < rounds; ++i) {
      const auto& in = inputs[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)];
      const LowLatencyDispatchArgs da = dispatch_args(c, in);
      InputBytes unwritten;  // inputs are never written (semantics §1)
      add_dispatch_inputs(unwritten, da);
      const LowLatencyDispatchResult d = buffer.low_latency_dispatch(da);
      EXPECT_FALSE(d.hook.defined());
      EXPECT_EQ(d.handle.num_max_dispatch_tokens_per_rank, c.tmax);
      got[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)] = copy_dispatch(d);
      LowLatencyCombineArgs ca;
      ca.x = expert_out[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)];
      ca.topk_idx = in.topk_idx;
      ca.topk_weights = in.topk_weights;
      ca.handle = &d.handle;
      if (i % 2 == 1) ca.out = outs[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)];
      add_combine_inputs(unwritten, ca);
      const LowLatencyCombineResult cr = buffer.low_latency_combine(ca);
      unwritten.expect_unchanged();
      if (i % 2 == 1) EXPECT_EQ(cr.combined_x.data(), ca.out.data) << "combine must write into and return `out`";
      combined[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)] = clone(cr.combined_x);
    }
  });

  for (int i = 0; i < rounds; ++i) {
    const auto& in = inputs[static_cast<std::size_t>(i)];
    const auto ref = reference_low_latency_dispatch(in, c.E);
    const auto q = quantize_all(c, in);
    const auto want = reference_low_latency_combine(in, ref, expert_out[static_cast<std::size_t>(i)], c.E);
    for (int d = 0; d < c.R; ++d) {
      expect_dispatch_matches(c, d, got[static_cast<std::size_t>(i)][static_cast<std::size_t>(d)], in, ref, q);
      expect_bf16_equal(combined[static_cast<std::size_t>(i)][static_cast<std::size_t>(d)],
                        want[static_cast<std::size_t>(d)],
                        describe_case(c) + " combine round " + std::to_string(i) + " rank " + std::to_string(d));
    }
  }
}

struct Shape4 {
  int R, E, K;
  std::int64_t H;
  int tmax;
  double p_minus_one;
};

// R in {1, 2, 3, 4, 8}, K in {1, 2, 8, 9}, H in {16, 128, 2048, 2880, 4096, 7168}; small Tmax keeps the window
// (E * Tmax * H elements per half) small. E_local = 1024, the most a rank may own (semantics §1), on tiny rows.
const Shape4 kShapes[] = {
    {1, 4, 2, 128, 8, 0.0},   {2, 8, 1, 2048, 8, 0.0},  {2, 16, 8, 128, 16, 0.2}, {3, 12, 9, 2880, 5, 0.1},
    {4, 16, 2, 7168, 4, 0.0}, {4, 32, 8, 7168, 3, 0.1}, {8, 32, 8, 128, 8, 0.3},  {8, 16, 9, 2048, 4, 0.0},
    {8, 32, 1, 2880, 2, 0.0}, {3, 24, 8, 7168, 2, 0.0}, {2, 8, 8, 4096, 4, 0.1},  {4, 32, 9, 4096, 2, 0.0},
    {2, 2048, 4, 16, 3, 0.1},
};

enum class Format { bf16, fp8, fp8_round, fp8_ue8m0 };

class LowLatencyShapes : public ::testing::TestWithParam<std::tuple<int, Format>> {};

TEST_P(LowLatencyShapes, DispatchAndCombineMatchReference) {
  const Shape4 s = kShapes[std::get<0>(GetParam())];
  const Format f = std::get<1>(GetParam());
  Case c;
  c.R = s.R;
  c.E = s.E;
  c.K = s.K;
  c.H = s.H;
  c.tmax = s.tmax;
  c.routing.p_minus_one = s.p_minus_one;
  c.use_fp8 = f != Format::bf16;
  c.round_scale = f == Format::fp8_round || f == Format::fp8_ue8m0;
  c.use_ue8m0 = f == Format::fp8_ue8m0;
  // Uneven token counts: rank r has tmax - r % 2 tokens (at least 1).
  for (int r = 0; r < c.R; ++r) c.T.push_back(std::max(1, c.tmax - r % 2));
  run_case(c);
}

INSTANTIATE_TEST_SUITE_P(Matrix, LowLatencyShapes,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(std::size(kShapes))),
                                            ::testing::Values(Format::bf16, Format::fp8, Format::fp8_round,
                                                              Format::fp8_ue8m0)));

TEST(LowLatencyDispatch, MinusOneIdsAndOneRankWithAllMinusOne) {
  Case c;
  c.R = 3;
  c.E = 12;
  c.K = 4;
  c.tmax = 6;
  c.routing.p_minus_one = 0.4;
  std::mt19937_64 rng(fresh_seed());
  // run_case draws its own inputs; to force one rank to all -1 we go through a custom run.
  auto in = make_inputs(rng, c);
  for (std::int64_t i = 0; i < in[1].topk_idx.numel(); ++i) {
    in[1].topk_idx.ptr<std::int64_t>()[i] = -1;
    in[1].topk_weights.ptr<float>()[i] = 0.0f;
  }
  auto y = make_expert_out(rng, c);
  std::vector<DispatchCopy> got(3);
  std::vector<Tensor> comb(3);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const auto& mine = in[static_cast<std::size_t>(g.rank())];
    auto d = b.low_latency_dispatch(dispatch_args(c, mine));
    got[static_cast<std::size_t>(g.rank())] = copy_dispatch(d);
    LowLatencyCombineArgs ca;
    ca.x = y[static_cast<std::size_t>(g.rank())];
    ca.topk_idx = mine.topk_idx;
    ca.topk_weights = mine.topk_weights;
    ca.handle = &d.handle;
    comb[static_cast<std::size_t>(g.rank())] = clone(b.low_latency_combine(ca).combined_x);
  });
  const auto ref = reference_low_latency_dispatch(in, c.E);
  const auto want = reference_low_latency_combine(in, ref, y, c.E);
  for (int d = 0; d < c.R; ++d) {
    expect_dispatch_matches(c, d, got[static_cast<std::size_t>(d)], in, ref, {});
    for (int e = 0; e < c.E / c.R; ++e)  // nothing from rank 1
      EXPECT_EQ(got[static_cast<std::size_t>(d)].layout_range.ptr<std::int64_t>()[e * c.R + 1] & 0xffffffff, 0);
    expect_bf16_equal(comb[static_cast<std::size_t>(d)], want[static_cast<std::size_t>(d)], "combine");
  }
  // Rank 1's tokens have no expert: its combine result is +0.
  for (std::int64_t i = 0; i < comb[1].numel(); ++i) EXPECT_EQ(comb[1].ptr<bf16_t>()[i].bits, 0);
}

TEST(LowLatencyDispatch, ZeroTokenRank) {
  Case c;
  c.R = 4;
  c.E = 16;
  c.K = 3;
  c.tmax = 4;
  c.T = {0, 4, 2, 0};
  run_case(c);
  c.use_fp8 = true;
  run_case(c);
}

// No rank has a token: the dispatch and the combine still meet and complete, every count is 0, the outputs are empty.
TEST(LowLatencyDispatch, EveryRankHasZeroTokens) {
  Case c;
  c.R = 3;
  c.E = 12;
  c.K = 3;
  c.tmax = 4;
  c.T = {0, 0, 0};
  for (bool fp8 : {false, true}) {
    c.use_fp8 = fp8;
    run_case(c);
  }
}

TEST(LowLatencyDispatch, EveryTokenToOneExpert) {
  Case c;
  c.R = 4;
  c.E = 8;
  c.K = 2;
  c.H = 256;
  c.tmax = 6;
  c.routing.only_expert = 5;  // rank 2, local expert 1: R * Tmax rows, the full capacity
  run_case(c);
  c.use_fp8 = true;
  run_case(c, 1);
}

TEST(LowLatencyDispatch, FullBatchTEqualsTmax) {
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 8;  // every expert of both ranks: R * Tmax rows per expert
  c.H = 512;
  c.tmax = 16;
  run_case(c);
}

TEST(LowLatencyDispatch, Int32TopkIdxAndCumulativeStats) {
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 3;
  c.tmax = 8;
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto ref = reference_low_latency_dispatch(in, c.E);
  std::vector<DispatchCopy> got(2);
  std::vector<Tensor> stats(2);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const auto& mine = in[static_cast<std::size_t>(g.rank())];
    Tensor idx32 = Tensor::empty(DType::int32, mine.topk_idx.shape());
    for (std::int64_t i = 0; i < idx32.numel(); ++i)
      idx32.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(mine.topk_idx.ptr<std::int64_t>()[i]);
    Tensor st = Tensor::empty(DType::int32, {c.E / c.R});
    for (int e = 0; e < c.E / c.R; ++e) st.ptr<std::int32_t>()[e] = 100 + e;
    auto a = dispatch_args(c, mine);
    a.topk_idx = idx32;
    a.cumulative_local_expert_recv_stats = st;
    for (int i = 0; i < 2; ++i) {
      auto d = b.low_latency_dispatch(a);
      got[static_cast<std::size_t>(g.rank())] = copy_dispatch(d);
    }
    stats[static_cast<std::size_t>(g.rank())] = st;
  });
  for (int d = 0; d < c.R; ++d) {
    expect_dispatch_matches(c, d, got[static_cast<std::size_t>(d)], in, ref, {});
    for (int e = 0; e < c.E / c.R; ++e)
      EXPECT_EQ(
          stats[static_cast<std::size_t>(d)].ptr<std::int32_t>()[e],
          100 + e + 2 * static_cast<int>(ref[static_cast<std::size_t>(d)].rows[static_cast<std::size_t>(e)].size()));
  }
}

// DeepEP's wait-cost statistics (semantics §5): int64 [R], entry s += the nanoseconds this rank's receive waited for
// rank s. A rank that arrives late by a known sleep shows at least that much in its peers' entry for it; the entries
// accumulate from the caller's values; the results are those of a call without statistics.
TEST(LowLatencyDispatch, WaitCostStatsCountTheWaitForEachSource) {
  Case c;
  c.R = 2;
  c.E = 8;
  c.K = 2;
  c.tmax = 6;
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto expert_out = make_expert_out(rng, c);
  const auto ref = reference_low_latency_dispatch(in, c.E);
  const auto want = reference_low_latency_combine(in, ref, expert_out, c.E);
  constexpr std::int64_t kBase = 1000, kLateNs = 150'000'000;  // the late rank sleeps 150 ms
  std::vector<Tensor> dstats, cstats, combined(2);
  std::vector<DispatchCopy> got(2);
  for (int r = 0; r < c.R; ++r) {
    dstats.push_back(Tensor::empty(DType::int64, {c.R}));
    cstats.push_back(Tensor::empty(DType::int64, {c.R}));
    for (int s = 0; s < c.R; ++s) dstats.back().ptr<std::int64_t>()[s] = cstats.back().ptr<std::int64_t>()[s] = kBase;
  }
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    auto a = dispatch_args(c, in[static_cast<std::size_t>(r)]);
    // The first call fixes the settings with a collective, which would absorb the late rank's sleep.
    (void)b.low_latency_dispatch(a);
    a.dispatch_wait_recv_cost_stats = dstats[static_cast<std::size_t>(r)];
    g.barrier("test: before the late rank");
    if (r == 1) std::this_thread::sleep_for(std::chrono::nanoseconds(kLateNs));  // late to the dispatch
    const LowLatencyDispatchResult d = b.low_latency_dispatch(a);
    got[static_cast<std::size_t>(r)] = copy_dispatch(d);
    LowLatencyCombineArgs ca;
    ca.x = expert_out[static_cast<std::size_t>(r)];
    ca.topk_idx = a.topk_idx;
    ca.topk_weights = a.topk_weights;
    ca.handle = &d.handle;
    // A statistic of the wrong shape is named before any communication, and the buffer stays usable.
    const Tensor square = Tensor::zeros(DType::int64, {c.R, c.R});
    ca.combine_wait_recv_cost_stats = square;
    const Caught bad = catch_error([&] { b.low_latency_combine(ca); });
    EXPECT_EQ(bad.code, ErrorCode::invalid_argument) << bad.what;
    EXPECT_NE(bad.what.find("'combine_wait_recv_cost_stats'"), std::string::npos) << bad.what;
    ca.combine_wait_recv_cost_stats = cstats[static_cast<std::size_t>(r)];
    g.barrier("test: before the late rank");
    if (r == 0) std::this_thread::sleep_for(std::chrono::nanoseconds(kLateNs));  // late to the combine
    combined[static_cast<std::size_t>(r)] = clone(b.low_latency_combine(ca).combined_x);
  });
  const auto entry = [](const Tensor& t, int s) { return t.ptr<std::int64_t>()[s]; };
  EXPECT_GE(entry(dstats[0], 1) - kBase, kLateNs * 2 / 3) << "rank 0 waited for rank 1's dispatch";
  EXPECT_GE(entry(cstats[1], 0) - kBase, kLateNs * 2 / 3) << "rank 1 waited for rank 0's combine";
  for (int r = 0; r < c.R; ++r)
    for (int s = 0; s < c.R; ++s) {
      EXPECT_GE(entry(dstats[static_cast<std::size_t>(r)], s), kBase);
      EXPECT_GE(entry(cstats[static_cast<std::size_t>(r)], s), kBase);
    }
  for (int d = 0; d < c.R; ++d) {
    expect_dispatch_matches(c, d, got[static_cast<std::size_t>(d)], in, ref, quantize_all(c, in));
    expect_bf16_equal(combined[static_cast<std::size_t>(d)], want[static_cast<std::size_t>(d)],
                      "combine rank " + std::to_string(d));
  }
}

// semantics §5: (T * R * K + E) / E in integer division, the engines' GEMM size. Hand-computed: DeepEP's decode shape,
// no tokens (1), a quotient that truncates, and products past 32 bits.
TEST(LowLatencyExpectedM, IsTheEnginesFormulaInIntegerDivision) {
  static_assert(low_latency_expected_m(128, 8, 8, 256) == 33);  // usable at compile time: 8448 / 256
  EXPECT_EQ(low_latency_expected_m(128, 8, 8, 256), 33);
  EXPECT_EQ(low_latency_expected_m(0, 4, 8, 64), 1);
  EXPECT_EQ(low_latency_expected_m(1, 2, 2, 8), 1);              // 12 / 8
  EXPECT_EQ(low_latency_expected_m(7, 3, 5, 12), 9);             // 117 / 12 = 9.75
  EXPECT_EQ(low_latency_expected_m(8, 1, 1, 8), 2);              // 16 / 8
  EXPECT_EQ(low_latency_expected_m(4096, 64, 16, 65536), 65);    // 4259840 / 65536
  EXPECT_EQ(low_latency_expected_m(std::int64_t{1} << 20, 1024, 16, 1024), (std::int64_t{1} << 24) + 1);  // 2^34 tokens
}

TEST(LowLatencyDispatch, SizeHintCoversTheBufferAndExactSizeWorks) {
  Case c;
  c.R = 2;
  c.E = 4;
  c.K = 2;
  c.H = 256;
  c.tmax = 4;
  const std::int64_t hint = Buffer::get_low_latency_rdma_size_hint(c.tmax, c.H, c.R, c.E);
  // Both halves hold at least the packed bf16 outputs.
  EXPECT_GE(hint, 2 * static_cast<std::int64_t>(c.E) * c.tmax * c.H * 2);
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto ref = reference_low_latency_dispatch(in, c.E);
  std::vector<DispatchCopy> got(2);
  BufferOptions o;
  o.num_rdma_bytes = hint;
  run_buffers(
      c.R,
      [&](Buffer& b, Group& g) {
        auto d = b.low_latency_dispatch(dispatch_args(c, in[static_cast<std::size_t>(g.rank())]));
        got[static_cast<std::size_t>(g.rank())] = copy_dispatch(d);
      },
      o);
  for (int d = 0; d < c.R; ++d) expect_dispatch_matches(c, d, got[static_cast<std::size_t>(d)], in, ref, {});
}

TEST(LowLatencyDispatch, CleanResetsAndLaterCallsMatchReference) {
  Case c;
  c.R = 2;
  c.E = 4;
  c.K = 2;
  c.tmax = 4;
  std::mt19937_64 rng(fresh_seed());
  const auto in0 = make_inputs(rng, c), in1 = make_inputs(rng, c);
  std::vector<DispatchCopy> got(2);
  std::vector<Caught> stale(2);
  run_buffers(c.R, [&](Buffer& b, Group& g) {
    const int r = g.rank();
    b.clean_low_latency_buffer(c.tmax, c.H, c.E);  // before any call: fixes the settings
    auto d0 = b.low_latency_dispatch(dispatch_args(c, in0[static_cast<std::size_t>(r)]));
    b.clean_low_latency_buffer(c.tmax, c.H, c.E);
    LowLatencyCombineArgs ca;
    Tensor y = Tensor::zeros(DType::bf16, {c.E / c.R, c.R * c.tmax, c.H});
    ca.x = y;
    ca.topk_idx = in0[static_cast<std::size_t>(r)].topk_idx;
    ca.topk_weights = in0[static_cast<std::size_t>(r)].topk_weights;
    ca.handle = &d0.handle;
    stale[static_cast<std::size_t>(r)] = catch_error([&] { b.low_latency_combine(ca); });
    auto d1 = b.low_latency_dispatch(dispatch_args(c, in1[static_cast<std::size_t>(r)]));
    got[static_cast<std::size_t>(r)] = copy_dispatch(d1);
  });
  const auto ref = reference_low_latency_dispatch(in1, c.E);
  for (int d = 0; d < c.R; ++d) {
    EXPECT_TRUE(stale[static_cast<std::size_t>(d)].thrown);
    EXPECT_EQ(stale[static_cast<std::size_t>(d)].code, ErrorCode::stale_handle)
        << stale[static_cast<std::size_t>(d)].what;
    expect_dispatch_matches(c, d, got[static_cast<std::size_t>(d)], in1, ref, {});
  }
}

}  // namespace
}  // namespace epmoe::test::ll
