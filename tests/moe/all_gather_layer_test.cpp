// The all-gather + reduce-scatter prepare/finalize (make_all_gather_prepare_finalize, semantics §8) in the layer on
// thread ranks: against the independent float64 layer reference, and against normal mode on the same inputs.
#include <epmoe/moe.hpp>
#include <epmoe/quant.hpp>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "support/moe_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using test::fresh_seed;

// Tokens per rank may differ (T[r] = 0 allowed).
struct Problem {
  int R, E, K;
  std::vector<std::int64_t> T;
  std::int64_t H, N;
  std::vector<Tensor> x, topk_idx, topk_weights;  // per rank
  Tensor w1, w2;                                  // all experts, gated (silu)
};

Problem make_problem(std::mt19937_64& rng, int E, int K, std::vector<std::int64_t> T, std::int64_t H, std::int64_t N,
                     test::RoutingOptions ro = {}) {
  const int R = static_cast<int>(T.size());
  Problem p{R, E, K, T, H, N, {}, {}, {}, {}, {}};
  Tensor w1 = test::random_bf16(rng, E * 2 * N, H, 1.0f / std::sqrt(static_cast<float>(H)));
  Tensor w2 = test::random_bf16(rng, E * H, N, 1.0f / std::sqrt(static_cast<float>(N)));
  p.w1 = Tensor::wrap(TensorView(w1.data(), DType::bf16, {E, 2 * N, H}), std::make_shared<Tensor>(w1));
  p.w2 = Tensor::wrap(TensorView(w2.data(), DType::bf16, {E, H, N}), std::make_shared<Tensor>(w2));
  for (int r = 0; r < R; ++r) {
    p.x.push_back(test::random_bf16(rng, T[static_cast<std::size_t>(r)], H));
    p.topk_idx.push_back(test::random_topk_idx(rng, T[static_cast<std::size_t>(r)], K, E, ro));
    p.topk_weights.push_back(test::random_topk_weights(rng, p.topk_idx.back()));
  }
  return p;
}

Tensor concat_rows(const std::vector<Tensor>& parts) {
  std::int64_t rows = 0;
  for (const auto& t : parts) rows += t.size(0);
  Tensor out = Tensor::empty(parts[0].dtype(), {rows, parts[0].size(1)});
  std::size_t off = 0;
  for (const auto& t : parts) {
    if (t.nbytes()) std::memcpy(static_cast<char*>(out.data()) + off, t.data(), t.nbytes());
    off += t.nbytes();
  }
  return out;
}

struct RunOptions {
  bool all_gather = true;  // false: normal mode over a threads Buffer
  DispatchDtype dtype = DispatchDtype::bf16;
  bool reference_experts = false;
  bool weight_on_input = false;
  int forwards = 1;  // the same layer run this many times (the last output kept)
};

std::vector<Tensor> run_layer(const Problem& p, const RunOptions& o) {
  std::vector<Tensor> out(static_cast<std::size_t>(p.R));
  run_thread_ranks(p.R, [&](Group& g) {
    const int r = g.rank(), E_local = p.E / p.R;
    std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);  // non-owning alias of the rank's group
    PrepareFinalizeOptions po;
    po.dispatch_dtype = o.dtype;
    auto pf = o.all_gather ? make_all_gather_prepare_finalize(group, po)
                           : make_normal_prepare_finalize(std::make_shared<Buffer>(group), po);
    MoELayer layer(pf, o.reference_experts ? make_reference_experts() : make_blas_experts());
    MoEForwardArgs a;
    a.hidden = p.x[static_cast<std::size_t>(r)];
    a.w1 = p.w1.view().slice_rows(r * E_local, (r + 1) * E_local);
    a.w2 = p.w2.view().slice_rows(r * E_local, (r + 1) * E_local);
    a.topk_idx = p.topk_idx[static_cast<std::size_t>(r)];
    a.topk_weights = p.topk_weights[static_cast<std::size_t>(r)];
    a.global_num_experts = p.E;
    a.apply_router_weight_on_input = o.weight_on_input;
    for (int i = 0; i < o.forwards; ++i) out[static_cast<std::size_t>(r)] = layer.forward(a).output;
  });
  return out;
}

double layer_error(const Problem& p, const RunOptions& o) {
  const std::vector<Tensor> got = run_layer(p, o);
  for (int r = 0; r < p.R; ++r) {
    EXPECT_EQ(got[static_cast<std::size_t>(r)].shape(), (Shape{p.T[static_cast<std::size_t>(r)], p.H})) << "rank " << r;
  }
  Tensor x = concat_rows(p.x);
  if (o.dtype == DispatchDtype::fp8) {  // the reference sees what the experts saw: the fp8 values
    const Fp8Tensor q = quantize_fp8(x);
    x = dequantize_fp8(q.data, q.scales, DType::bf16);
  }
  const auto want = test::moe_layer_reference(x, p.w1, p.w2, concat_rows(p.topk_idx), concat_rows(p.topk_weights),
                                              "silu", o.weight_on_input);
  return test::relative_l2(concat_rows(got), want);
}

std::string label(const Problem& p, DispatchDtype d) {
  std::string t;
  for (auto v : p.T) t += std::to_string(v) + " ";
  return fmt::format("R={} H={} T=[{}] {}", p.R, p.H, t, d == DispatchDtype::fp8 ? "fp8" : "bf16");
}

TEST(AllGatherLayer, MatchesFloat64ReferenceOnOneTwoAndFourThreadRanks) {
  std::mt19937_64 rng(fresh_seed());
  for (int R : {1, 2, 4})
    for (DispatchDtype d : {DispatchDtype::bf16, DispatchDtype::fp8}) {
      std::vector<std::int64_t> T;
      for (int r = 0; r < R; ++r) T.push_back(9 + 7 * r);  // unequal counts: the gathers pad to T_max
      test::RoutingOptions ro;
      ro.p_minus_one = 0.1;
      const Problem p = make_problem(rng, 16, 4, T, 256, 64, ro);
      RunOptions o;
      o.dtype = d;
      o.forwards = 2;  // a second forward on the same layer reuses nothing stale
      EXPECT_LE(layer_error(p, o), 1e-2) << label(p, d);
    }
}

TEST(AllGatherLayer, ARankWithZeroTokens) {
  std::mt19937_64 rng(fresh_seed());
  for (DispatchDtype d : {DispatchDtype::bf16, DispatchDtype::fp8}) {
    const Problem p = make_problem(rng, 8, 2, {12, 0, 5, 0}, 128, 32);
    RunOptions o;
    o.dtype = d;
    EXPECT_LE(layer_error(p, o), 1e-2) << label(p, d);
  }
  const Problem p = make_problem(rng, 8, 2, {0, 6}, 128, 32);
  EXPECT_LE(layer_error(p, {}), 1e-2) << label(p, DispatchDtype::bf16);
}

TEST(AllGatherLayer, AllMinusOneIdsGiveZerosAndOneExpertTakingEveryToken) {
  std::mt19937_64 rng(fresh_seed());
  for (int R : {2, 4}) {
    test::RoutingOptions none;
    none.p_minus_one = 1.0;
    const Problem empty = make_problem(rng, 8, 3, std::vector<std::int64_t>(static_cast<std::size_t>(R), 10), 128, 32,
                                       none);
    for (const Tensor& out : run_layer(empty, {}))
      for (std::int64_t i = 0; i < out.numel(); ++i)
        ASSERT_EQ(out.ptr<bf16_t>()[i].bits & 0x7fff, 0) << "R=" << R << " nonzero at " << i;
    test::RoutingOptions one;
    one.only_expert = 5;  // on rank 2 of 4, rank 1 of 2: the other ranks' experts get nothing
    const Problem hot = make_problem(rng, 8, 3, std::vector<std::int64_t>(static_cast<std::size_t>(R), 10), 128, 32, one);
    EXPECT_LE(layer_error(hot, {}), 1e-2) << label(hot, DispatchDtype::bf16);
  }
}

TEST(AllGatherLayer, ApplyRouterWeightOnInputWithKEqualsOne) {
  std::mt19937_64 rng(fresh_seed());
  for (int R : {1, 2}) {
    const Problem p = make_problem(rng, 8, 1, std::vector<std::int64_t>(static_cast<std::size_t>(R), 16), 128, 64);
    RunOptions o;
    o.weight_on_input = true;
    EXPECT_LE(layer_error(p, o), 1e-2) << label(p, DispatchDtype::bf16);
  }
  const Problem p2 = make_problem(rng, 8, 2, {4, 4}, 128, 64);
  RunOptions bad;
  bad.weight_on_input = true;
  try {
    run_layer(p2, bad);
    FAIL() << "K = 2 with apply_router_weight_on_input accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("apply_router_weight_on_input"), std::string::npos) << e.what();
  }
}

TEST(AllGatherLayer, ModelHiddenSizes2048And2880) {
  std::mt19937_64 rng(fresh_seed());
  for (std::int64_t H : {2048, 2880})  // 2880: a last fp8 scale group of 64 channels
    for (DispatchDtype d : {DispatchDtype::bf16, DispatchDtype::fp8}) {
      const Problem p = make_problem(rng, 8, 2, {6, 3}, H, 32);
      RunOptions o;
      o.dtype = d;
      EXPECT_LE(layer_error(p, o), 1e-2) << label(p, d);
    }
}

// Both add the same bf16 partial per (token, rank) in rank order in float32 and round once (a rank without an
// expert of the token adds an exact zero here), and the reference experts compute each row alone, so the bits agree.
TEST(AllGatherLayer, OutputIsBitIdenticalToNormalModeWithReferenceExperts) {
  std::mt19937_64 rng(fresh_seed());
  for (int R : {1, 2, 4})
    for (DispatchDtype d : {DispatchDtype::bf16, DispatchDtype::fp8}) {
      std::vector<std::int64_t> T;
      for (int r = 0; r < R; ++r) T.push_back(r == 1 ? 0 : 8 + 3 * r);
      test::RoutingOptions ro;
      ro.p_minus_one = 0.2;
      const Problem p = make_problem(rng, 8, 4, T, 256, 32, ro);
      RunOptions ag, normal;
      ag.dtype = normal.dtype = d;
      ag.reference_experts = normal.reference_experts = true;
      normal.all_gather = false;
      const auto a = run_layer(p, ag), b = run_layer(p, normal);
      for (int r = 0; r < R; ++r) {
        const Tensor& x = a[static_cast<std::size_t>(r)];
        const Tensor& y = b[static_cast<std::size_t>(r)];
        ASSERT_EQ(x.shape(), y.shape()) << label(p, d);
        // A rank with no tokens has empty outputs (null data): memcmp must not see them.
        if (x.nbytes()) EXPECT_EQ(std::memcmp(x.data(), y.data(), x.nbytes()), 0) << label(p, d) << " rank " << r;
      }
    }
}

TEST(AllGatherLayer, BadArgumentsAreRefusedBeforeAnyCommunicationNamingThem) {
  EXPECT_THROW(make_all_gather_prepare_finalize(nullptr), Error);
  PrepareFinalizeOptions ue8m0;
  ue8m0.dispatch_dtype = DispatchDtype::fp8;
  ue8m0.use_ue8m0 = true;
  ThreadWorld one(1);
  EXPECT_THROW(make_all_gather_prepare_finalize(one.group(0), ue8m0), Error);

  std::mt19937_64 rng(fresh_seed());
  const auto expect_named = [](const std::function<void()>& fn, const std::string& name) {
    try {
      fn();
      ADD_FAILURE() << name << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  // Every rank fails locally: none reaches a collective (a rank that did would wait out the timeout).
  std::vector<Tensor> xs, idxs, ws;
  for (int r = 0; r < 2; ++r) {
    xs.push_back(test::random_bf16(rng, 4, 64));
    idxs.push_back(test::random_topk_idx(rng, 4, 2, 8));
    ws.push_back(test::random_topk_weights(rng, idxs.back()));
  }
  const Tensor w_short = test::random_f32(rng, 3, 2), x72 = test::random_bf16(rng, 4, 72);
  run_thread_ranks(2, [&](Group& g) {
    std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
    auto pf = make_all_gather_prepare_finalize(group);
    const Tensor& x = xs[static_cast<std::size_t>(g.rank())];
    const Tensor& idx = idxs[static_cast<std::size_t>(g.rank())];
    const Tensor& w = ws[static_cast<std::size_t>(g.rank())];
    expect_named([&] { pf->dispatch_a({x, idx, w, 7, false}); }, "global_num_experts");
    EXPECT_EQ(pf->stage(), Stage::initial);
    idx.ptr<std::int64_t>()[3] = 8;
    expect_named([&] { pf->dispatch_a({x, idx, w, 8, false}); }, "topk_idx");
    expect_named([&] { pf->dispatch_a({x, idx, w, 8, false}); }, "8 at [1, 1]");  // [t, k] with K = 2
    idx.ptr<std::int64_t>()[3] = 1;
    expect_named([&] { pf->dispatch_a({x, idx, w_short, 8, false}); }, "topk_weights");
    PrepareFinalizeOptions fp8;
    fp8.dispatch_dtype = DispatchDtype::fp8;
    expect_named([&] { make_all_gather_prepare_finalize(group, fp8)->dispatch_a({x72, idx, w, 8, false}); }, "hidden");
    // A good dispatch, then a fused output of the wrong shape: refused before the reduce-scatter.
    pf->dispatch_a({x, idx, w, 8, false});
    const PrepareOutput in = pf->dispatch_b();
    EXPECT_EQ(in.hidden.shape(), (Shape{8, 64}));
    Tensor bad = Tensor::zeros(DType::bf16, {8, 64});
    expect_named([&] { pf->combine_a(bad, WeightAndReduce::contiguous); }, "fused_expert_output");
    Tensor fused = Tensor::zeros(DType::bf16, {8, 2, 64});
    pf->combine_a(fused, WeightAndReduce::delegate);
    EXPECT_EQ(pf->combine_b().shape(), (Shape{4, 64}));
  });
}

TEST(AllGatherLayer, DifferingHiddenSizeIsAMismatchOnEveryRank) {
  std::mt19937_64 rng(fresh_seed());
  const auto errors = run_thread_ranks_collect(2, [&](Group& g) {
    std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
    auto pf = make_all_gather_prepare_finalize(group);
    Tensor x = Tensor::zeros(DType::bf16, {4, g.rank() == 0 ? 64 : 128});
    Tensor idx = Tensor::zeros(DType::int64, {4, 2});
    Tensor w = Tensor::zeros(DType::fp32, {4, 2});
    pf->dispatch_a({x, idx, w, 8, false});
  });
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), ErrorCode::rank_mismatch) << err.what();
      EXPECT_NE(std::string(err.what()).find("hidden"), std::string::npos) << err.what();
    }
  }
}

// The experts' input: rows r * T_max + t are rank r's tokens, padding rows carry -1, ids are local.
TEST(AllGatherLayer, ExpertsSeeEveryRanksRowsWithLocalIds) {
  std::mt19937_64 rng(fresh_seed());
  const Problem p = make_problem(rng, 8, 2, {3, 5}, 64, 16);
  run_thread_ranks(2, [&](Group& g) {
    const int r = g.rank();
    std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
    auto pf = make_all_gather_prepare_finalize(group);
    pf->dispatch_a({p.x[static_cast<std::size_t>(r)], p.topk_idx[static_cast<std::size_t>(r)],
                    p.topk_weights[static_cast<std::size_t>(r)], 8, false});
    const PrepareOutput in = pf->dispatch_b();
    ASSERT_EQ(in.hidden.shape(), (Shape{10, 64}));
    std::vector<std::int32_t> counts(4, 0);
    for (int q = 0; q < 2; ++q)
      for (std::int64_t t = 0; t < 5; ++t)
        for (int k = 0; k < 2; ++k) {
          const std::int64_t got = in.topk_idx.ptr<std::int64_t>()[(q * 5 + t) * 2 + k];
          std::int64_t want = -1;
          if (t < p.T[static_cast<std::size_t>(q)]) {
            const std::int64_t e = p.topk_idx[static_cast<std::size_t>(q)].ptr<std::int64_t>()[t * 2 + k];
            if (e >= r * 4 && e < r * 4 + 4) want = e - r * 4;
            EXPECT_EQ(std::memcmp(in.hidden.ptr<bf16_t>() + (q * 5 + t) * 64,
                                  p.x[static_cast<std::size_t>(q)].ptr<bf16_t>() + t * 64, 64 * 2),
                      0);
          }
          EXPECT_EQ(got, want) << "rank " << r << " row " << q * 5 + t << " k " << k;
          if (want >= 0) ++counts[static_cast<std::size_t>(want)];
        }
    for (int e = 0; e < 4; ++e) EXPECT_EQ(in.expert_num_tokens.ptr<std::int32_t>()[e], counts[static_cast<std::size_t>(e)]);
    Tensor fused = Tensor::zeros(DType::bf16, {10, 2, 64});
    pf->combine_a(fused, WeightAndReduce::contiguous);
    (void)pf->combine_b();
  });
}

}  // namespace
}  // namespace epmoe
