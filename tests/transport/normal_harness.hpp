// Shared harness of the normal-mode tests: random inputs for R thread ranks, the run through Buffer,
// and the comparison with the independent reference (tests/support/normal_reference.*).
#pragma once

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/quant.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "support/normal_reference.hpp"
#include "support/random.hpp"
#include "support/tensor_bytes.hpp"

namespace epmoe::test {

enum class Scales { none, float32, ue8m0 };

struct NormalCase {
  int R = 2;
  int E = 16;
  int K = 4;
  std::int64_t H = 128;
  std::vector<std::int64_t> T;  ///< tokens per rank; empty: 24 on every rank
  bool fp8 = false;
  Scales scales = Scales::none;  ///< with fp8: float32 or ue8m0
  /// How x_scales are passed (the reference reads them row-major; the received scales are row-major either way).
  ScaleLayout scale_layout = ScaleLayout::row_major;
  bool int32_idx = false;
  bool weights = true;
  double p_minus_one = 0.0;
  int only_expert = -1;
  int all_minus_one_rank = -1;  ///< this rank's ids are all -1
  int alignment = 1;
  int num_worst_tokens = 0;
  bool cached = false;         ///< also run a cached dispatch and compare it
  bool cached_topk = true;     ///< pass topk to the cached dispatch
  bool combine = true;
  bool bias_0 = false, bias_1 = false;
  bool combine_weights = false;
};

inline std::shared_ptr<Group> borrow(Group& g) { return std::shared_ptr<Group>(&g, [](Group*) {}); }

inline Tensor random_fp8(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols) {
  Tensor t = Tensor::empty(DType::fp8_e4m3, {rows, cols});
  std::uniform_int_distribution<int> d(0, 255);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<fp8_e4m3_t>()[i] = fp8_e4m3_t{static_cast<std::uint8_t>(d(rng))};
  return t;
}

inline Tensor random_i32(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols) {
  Tensor t = Tensor::empty(DType::int32, {rows, cols});
  std::uniform_int_distribution<std::int32_t> d(INT32_MIN, INT32_MAX);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<std::int32_t>()[i] = d(rng);
  return t;
}

/// bf16 values with exponents spread over 2^-24..2^24, so float32 sums of a few of them round and the
/// summation order shows in the bits (uniform values in [-1, 1] sum exactly in float32).
inline Tensor random_bf16_wide(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols) {
  Tensor t = Tensor::empty(DType::bf16, {rows, cols});
  std::uniform_int_distribution<int> exponent(-24, 24), mantissa(0, 127), sign(0, 1);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.ptr<bf16_t>()[i] = float_to_bf16((sign(rng) ? -1.0f : 1.0f) * std::ldexp(1.0f + mantissa(rng) / 128.0f, exponent(rng)));
  return t;
}

inline Tensor to_int32_ids(const Tensor& idx) {
  Tensor t = Tensor::empty(DType::int32, idx.shape());
  for (std::int64_t i = 0; i < idx.numel(); ++i) t.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(idx.ptr<std::int64_t>()[i]);
  return t;
}

/// Inputs of every rank for a case (x random bf16, or random fp8 bytes and random scales: the
/// transport must move them verbatim, so no quantizer is needed).
inline std::vector<RefDispatchInput> make_inputs(std::mt19937_64& rng, const NormalCase& c) {
  std::vector<RefDispatchInput> in(static_cast<std::size_t>(c.R));
  for (int r = 0; r < c.R; ++r) {
    const std::int64_t T = c.T.empty() ? 24 : c.T[static_cast<std::size_t>(r)];
    RefDispatchInput& i = in[static_cast<std::size_t>(r)];
    if (c.fp8) {
      i.x = random_fp8(rng, T, c.H);
      const std::int64_t G = num_scale_groups(c.H);
      i.x_scales = c.scales == Scales::ue8m0 ? random_i32(rng, T, (G + 3) / 4) : random_f32(rng, T, G, 1e-4f, 1.0f);
    } else {
      i.x = random_bf16(rng, T, c.H);
    }
    RoutingOptions o;
    o.p_minus_one = c.p_minus_one;
    o.only_expert = c.only_expert;
    Tensor idx = random_topk_idx(rng, T, c.K, c.E, o);
    if (r == c.all_minus_one_rank)
      for (std::int64_t j = 0; j < idx.numel(); ++j) idx.ptr<std::int64_t>()[j] = -1;
    if (c.weights) i.topk_weights = random_topk_weights(rng, idx);
    i.topk_idx = c.int32_idx ? to_int32_ids(idx) : idx;
  }
  return in;
}

/// What one rank got.
struct RankRun {
  DispatchResult dispatch;
  std::optional<DispatchResult> cached;
  CombineResult combine;
  std::optional<CombineResult> roundtrip;  ///< combine(recv_x) for bf16
  Tensor y, y_weights, bias_0, bias_1;     ///< combine inputs
};

inline DispatchArgs dispatch_args(const RefDispatchInput& in, const DispatchLayout& l, const NormalCase& c) {
  DispatchArgs a;
  a.x = in.x;
  a.x_scales = in.x_scales.view();
  a.topk_idx = in.topk_idx;
  a.topk_weights = in.topk_weights.view();
  a.num_tokens_per_rank = l.num_tokens_per_rank;
  a.is_token_in_rank = l.is_token_in_rank;
  a.num_tokens_per_expert = l.num_tokens_per_expert;
  a.expert_alignment = c.alignment;
  a.num_worst_tokens = c.num_worst_tokens;
  return a;
}

inline std::string first_byte_diff(const void* got, const void* want, std::size_t bytes, std::size_t row_bytes) {
  const auto* g = static_cast<const std::uint8_t*>(got);
  const auto* w = static_cast<const std::uint8_t*>(want);
  for (std::size_t i = 0; i < bytes; ++i)
    if (g[i] != w[i])
      return "first difference at byte " + std::to_string(i) + " (row " + std::to_string(row_bytes ? i / row_bytes : 0) +
             "): got " + std::to_string(g[i]) + ", want " + std::to_string(w[i]);
  return "equal";
}

inline void expect_dispatch_eq(const DispatchResult& got, const RefDispatchOutput& want, const NormalCase& c, int rank,
                               bool cached, std::int64_t T) {
  SCOPED_TRACE("rank " + std::to_string(rank) + (cached ? " (cached dispatch)" : ""));
  const std::int64_t rows = want.rows;
  ASSERT_EQ(got.recv_x.shape(), Shape({rows, c.H}));
  ASSERT_EQ(got.recv_x.dtype(), c.fp8 ? DType::fp8_e4m3 : DType::bf16);
  ASSERT_EQ(got.recv_x.nbytes(), want.recv_x.size());
  EXPECT_TRUE(got.recv_x.nbytes() == 0 || std::memcmp(got.recv_x.data(), want.recv_x.data(), want.recv_x.size()) == 0)
      << first_byte_diff(got.recv_x.data(), want.recv_x.data(), want.recv_x.size(), got.recv_x.nbytes() / std::max<std::int64_t>(rows, 1));
  if (c.fp8) {
    ASSERT_TRUE(got.recv_x_scales.defined());
    ASSERT_EQ(got.recv_x_scales.dtype(), c.scales == Scales::ue8m0 ? DType::int32 : DType::fp32);
    ASSERT_EQ(got.recv_x_scales.nbytes(), want.recv_x_scales.size());
    EXPECT_TRUE(want.recv_x_scales.empty() ||
                std::memcmp(got.recv_x_scales.data(), want.recv_x_scales.data(), want.recv_x_scales.size()) == 0)
        << first_byte_diff(got.recv_x_scales.data(), want.recv_x_scales.data(), want.recv_x_scales.size(), 0);
  } else {
    EXPECT_FALSE(got.recv_x_scales.defined());
  }
  const bool topk = !cached || c.cached_topk;
  if (topk) {
    ASSERT_EQ(got.recv_topk_idx.shape(), Shape({rows, c.K}));
    ASSERT_EQ(got.recv_topk_idx.dtype(), DType::int64);
    for (std::int64_t i = 0; i < rows * c.K; ++i)
      ASSERT_EQ(got.recv_topk_idx.ptr<std::int64_t>()[i], want.recv_topk_idx[static_cast<std::size_t>(i)])
          << "row " << i / c.K << " k " << i % c.K;
    if (c.weights) {
      ASSERT_EQ(got.recv_topk_weights.shape(), Shape({rows, c.K}));
      for (std::int64_t i = 0; i < rows * c.K; ++i)
        ASSERT_EQ(float_bits(got.recv_topk_weights.ptr<float>()[i]), float_bits(want.recv_topk_weights[static_cast<std::size_t>(i)]))
            << "row " << i / c.K << " k " << i % c.K;
    } else {
      EXPECT_FALSE(got.recv_topk_weights.defined());
    }
  } else {
    EXPECT_FALSE(got.recv_topk_idx.defined());
    EXPECT_FALSE(got.recv_topk_weights.defined());
  }
  const int E_local = c.E / c.R;
  if (c.num_worst_tokens > 0) EXPECT_TRUE(got.num_recv_tokens_per_expert_list.empty());
  else EXPECT_EQ(got.num_recv_tokens_per_expert_list, std::vector<int>(want.num_recv_tokens_per_expert.begin(), want.num_recv_tokens_per_expert.end()));

  const NormalHandle& h = got.handle;
  EXPECT_TRUE(h.defined());
  EXPECT_EQ(h.num_tokens, T);
  EXPECT_EQ(h.num_recv_tokens, want.num_recv_tokens);
  EXPECT_EQ(h.num_recv_rows, rows);
  EXPECT_EQ(h.hidden, c.H);
  EXPECT_EQ(h.num_experts, c.E);
  EXPECT_EQ(h.expert_alignment, c.alignment);
  ASSERT_EQ(h.num_recv_tokens_per_expert.shape(), Shape({E_local}));
  EXPECT_EQ(0, std::memcmp(h.num_recv_tokens_per_expert.data(), want.num_recv_tokens_per_expert.data(), 4 * static_cast<std::size_t>(E_local)));
  ASSERT_EQ(h.rank_prefix_matrix.shape(), Shape({c.R, c.R}));
  EXPECT_EQ(0, std::memcmp(h.rank_prefix_matrix.data(), want.rank_prefix_matrix.data(), 4 * static_cast<std::size_t>(c.R * c.R)));
  ASSERT_EQ(h.send_pos.shape(), Shape({T, c.R}));
  for (std::int64_t i = 0; i < T * c.R; ++i)
    ASSERT_EQ(h.send_pos.ptr<std::int32_t>()[i], want.send_pos[static_cast<std::size_t>(i)]) << "token " << i / c.R << " rank " << i % c.R;
  ASSERT_EQ(h.is_token_in_rank.shape(), Shape({T, c.R}));
  for (std::int64_t i = 0; i < T * c.R; ++i)
    ASSERT_EQ(h.is_token_in_rank.ptr<bool>()[i], want.send_pos[static_cast<std::size_t>(i)] >= 0) << i;
  ASSERT_EQ(h.recv_src_idx.shape(), Shape({want.num_recv_tokens}));
  for (std::int64_t i = 0; i < want.num_recv_tokens; ++i)
    ASSERT_EQ(h.recv_src_idx.ptr<std::int32_t>()[i], want.recv_src_idx[static_cast<std::size_t>(i)]) << i;
}

/// The handle's tensors: a cached dispatch and a combine read them, and must leave them as the dispatch made them.
inline InputBytes& add_handle(InputBytes& b, const NormalHandle& h) {
  return b.add("handle.rank_prefix_matrix", h.rank_prefix_matrix)
      .add("handle.is_token_in_rank", h.is_token_in_rank)
      .add("handle.send_pos", h.send_pos)
      .add("handle.recv_src_idx", h.recv_src_idx)
      .add("handle.num_recv_tokens_per_expert", h.num_recv_tokens_per_expert);
}

/// A fresh dispatch's inputs: the tokens, their routing and the layout.
inline InputBytes& add_dispatch_inputs(InputBytes& b, const DispatchArgs& a) {
  b.add("x", a.x).add("x_scales", a.x_scales).add("topk_idx", a.topk_idx).add("topk_weights", a.topk_weights);
  b.add("num_tokens_per_rank", a.num_tokens_per_rank).add("is_token_in_rank", a.is_token_in_rank);
  return b.add("num_tokens_per_expert", a.num_tokens_per_expert);
}

/// A combine's own inputs (its handle is the dispatch's, added once).
inline InputBytes& add_combine_inputs(InputBytes& b, const CombineArgs& a) {
  b.add("combine x", a.x).add("combine topk_weights", a.topk_weights);
  return b.add("bias_0", a.bias_0).add("bias_1", a.bias_1);
}

/// Runs the case on R thread ranks and compares every rank with the reference.
inline void run_normal_case(const NormalCase& c) {
  std::mt19937_64 rng(fresh_seed());
  const auto in = make_inputs(rng, c);
  const auto want = reference_dispatch(in, c.E, c.alignment, c.num_worst_tokens);
  std::vector<RankRun> runs(static_cast<std::size_t>(c.R));
  for (int r = 0; r < c.R; ++r) {
    RankRun& run = runs[static_cast<std::size_t>(r)];
    const std::int64_t rows = want[static_cast<std::size_t>(r)].rows;
    run.y = random_bf16_wide(rng, rows, c.H);
    if (c.combine_weights) run.y_weights = random_f32(rng, rows, c.K, 0.0f, 1.0f);
    const std::int64_t T = in[static_cast<std::size_t>(r)].x.size(0);
    if (c.bias_0) run.bias_0 = random_bf16_wide(rng, T, c.H);
    if (c.bias_1) run.bias_1 = random_bf16_wide(rng, T, c.H);
  }

  std::vector<Tensor> given_scales;
  for (const auto& i : in) given_scales.push_back(scales_in_layout(i.x_scales, c.scale_layout));

  run_thread_ranks(c.R, [&](Group& g) {
    const int r = g.rank();
    RankRun& run = runs[static_cast<std::size_t>(r)];
    const RefDispatchInput& mine = in[static_cast<std::size_t>(r)];
    Buffer buf(borrow(g));
    const DispatchLayout l = buf.get_dispatch_layout(mine.topk_idx, c.E);
    DispatchArgs fresh = dispatch_args(mine, l, c);
    fresh.x_scales = given_scales[static_cast<std::size_t>(r)].view();
    // Every call below must leave its inputs as they were (semantics §1), checked once all of them returned.
    InputBytes inputs;
    add_dispatch_inputs(inputs, fresh);
    run.dispatch = buf.dispatch(fresh);
    add_handle(inputs, run.dispatch.handle);
    if (c.cached) {
      DispatchArgs a;
      a.x = mine.x;
      a.x_scales = given_scales[static_cast<std::size_t>(r)].view();
      if (c.cached_topk) {
        a.topk_idx = mine.topk_idx;
        a.topk_weights = mine.topk_weights.view();
      }
      a.handle = &run.dispatch.handle;
      run.cached = buf.dispatch(a);
    }
    if (!c.combine) {
      inputs.expect_unchanged();
      return;
    }
    CombineArgs ca;
    ca.x = run.y;
    ca.handle = &run.dispatch.handle;
    ca.topk_weights = run.y_weights.view();
    ca.bias_0 = run.bias_0.view();
    ca.bias_1 = run.bias_1.view();
    add_combine_inputs(inputs, ca);
    run.combine = buf.combine(ca);
    if (!c.fp8) {
      CombineArgs rt;
      rt.x = run.dispatch.recv_x;
      rt.handle = &run.dispatch.handle;
      add_combine_inputs(inputs, rt);
      run.roundtrip = buf.combine(rt);
    }
    inputs.expect_unchanged();
  });

  for (int r = 0; r < c.R; ++r) {
    const std::int64_t T = in[static_cast<std::size_t>(r)].x.size(0);
    expect_dispatch_eq(runs[static_cast<std::size_t>(r)].dispatch, want[static_cast<std::size_t>(r)], c, r, false, T);
    if (c.cached) expect_dispatch_eq(*runs[static_cast<std::size_t>(r)].cached, want[static_cast<std::size_t>(r)], c, r, true, T);
  }
  if (!c.combine) return;

  std::vector<Tensor> idx, y, yw, b0, b1;
  for (int r = 0; r < c.R; ++r) {
    idx.push_back(in[static_cast<std::size_t>(r)].topk_idx);
    y.push_back(runs[static_cast<std::size_t>(r)].y);
    yw.push_back(runs[static_cast<std::size_t>(r)].y_weights);
    b0.push_back(runs[static_cast<std::size_t>(r)].bias_0);
    b1.push_back(runs[static_cast<std::size_t>(r)].bias_1);
  }
  const auto cw = reference_combine(idx, c.E, y, yw, b0, b1);
  for (int r = 0; r < c.R; ++r) {
    SCOPED_TRACE("combine on rank " + std::to_string(r));
    const std::int64_t T = in[static_cast<std::size_t>(r)].x.size(0);
    const CombineResult& got = runs[static_cast<std::size_t>(r)].combine;
    ASSERT_EQ(got.combined_x.shape(), Shape({T, c.H}));
    ASSERT_EQ(got.combined_x.dtype(), DType::bf16);
    const auto& w = cw[static_cast<std::size_t>(r)];
    for (std::int64_t i = 0; i < T * c.H; ++i)
      ASSERT_EQ(got.combined_x.ptr<bf16_t>()[i].bits, w.combined_x[static_cast<std::size_t>(i)])
          << "token " << i / c.H << " channel " << i % c.H;
    if (c.combine_weights) {
      ASSERT_EQ(got.combined_topk_weights.shape(), Shape({T, c.K}));
      for (std::int64_t i = 0; i < T * c.K; ++i)
        ASSERT_EQ(float_bits(got.combined_topk_weights.ptr<float>()[i]), float_bits(w.combined_topk_weights[static_cast<std::size_t>(i)]))
            << "token " << i / c.K << " k " << i % c.K;
    } else {
      EXPECT_FALSE(got.combined_topk_weights.defined());
    }
    // combine(recv_x): each token comes back once per destination rank, summed in float32.
    if (c.fp8) continue;
    const CombineResult& rt = *runs[static_cast<std::size_t>(r)].roundtrip;
    const auto* x = in[static_cast<std::size_t>(r)].x.ptr<bf16_t>();
    for (std::int64_t t = 0; t < T; ++t) {
      int n = 0;
      for (int d = 0; d < c.R; ++d) n += want[static_cast<std::size_t>(r)].send_pos[static_cast<std::size_t>(t * c.R + d)] >= 0;
      for (std::int64_t h = 0; h < c.H; ++h) {
        float s = 0.0f;
        for (int k = 0; k < n; ++k) s += bf16_to_float(x[t * c.H + h]);
        ASSERT_EQ(rt.combined_x.ptr<bf16_t>()[t * c.H + h].bits, float_to_bf16(s).bits) << "token " << t << " channel " << h;
      }
    }
  }
}

}  // namespace epmoe::test
