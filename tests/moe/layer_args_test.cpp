// MoELayer::forward's argument checks (every argument before any communication, the message naming the
// right one) and the layer's state after a failed call, on CPU thread ranks.
#include <epmoe/moe.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "experts/experts_fp8_test_util.hpp"
#include "support/moe_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using test::fresh_seed;

constexpr int kR = 2, kE = 4, kK = 2;
constexpr std::int64_t kT = 6, kH = 32, kN = 16;

struct Inputs {
  Tensor w1, w2;                                  // all experts: [E, 2N, H], [E, H, N]
  std::vector<Tensor> x, topk_idx, topk_weights;  // per rank
};

Inputs make_inputs(std::mt19937_64& rng) {
  Inputs in;
  const Tensor w1 = test::random_bf16(rng, kE * 2 * kN, kH, 0.25f);
  const Tensor w2 = test::random_bf16(rng, kE * kH, kN, 0.25f);
  in.w1 = Tensor::wrap(TensorView(w1.data(), DType::bf16, {kE, 2 * kN, kH}), std::make_shared<Tensor>(w1));
  in.w2 = Tensor::wrap(TensorView(w2.data(), DType::bf16, {kE, kH, kN}), std::make_shared<Tensor>(w2));
  for (int r = 0; r < kR; ++r) {
    in.x.push_back(test::random_bf16(rng, kT, kH));
    in.topk_idx.push_back(test::random_topk_idx(rng, kT, kK, kE));
    in.topk_weights.push_back(test::random_topk_weights(rng, in.topk_idx.back()));
  }
  return in;
}

MoEForwardArgs valid_args(const Inputs& in, int rank) {
  const std::int64_t e_local = kE / kR;
  MoEForwardArgs a;
  a.hidden = in.x[static_cast<std::size_t>(rank)];
  a.w1 = in.w1.view().slice_rows(rank * e_local, (rank + 1) * e_local);
  a.w2 = in.w2.view().slice_rows(rank * e_local, (rank + 1) * e_local);
  a.topk_idx = in.topk_idx[static_cast<std::size_t>(rank)];
  a.topk_weights = in.topk_weights[static_cast<std::size_t>(rank)];
  a.activation = Activation::silu;
  a.global_num_experts = kE;
  return a;
}

// The float64 layer reference of one rank's tokens (written from semantics §7/8, not calling the layer).
double error_vs_reference(const Inputs& in, int rank, const Tensor& got) {
  const auto want = test::moe_layer_reference(in.x[static_cast<std::size_t>(rank)], in.w1, in.w2,
                                              in.topk_idx[static_cast<std::size_t>(rank)],
                                              in.topk_weights[static_cast<std::size_t>(rank)], "silu");
  return test::relative_l2(got, want);
}

std::shared_ptr<Group> borrow(Group& g) { return std::shared_ptr<Group>(&g, [](Group*) {}); }

struct BadCase {
  std::string name;
  std::function<void(MoEForwardArgs&, std::vector<Tensor>& keep)> spoil;
  std::vector<std::string> parts;  // the message names these
};

std::vector<BadCase> bad_cases() {
  const std::int64_t e_local = kE / kR;
  const auto f32 = [](const TensorView& v, std::vector<Tensor>& keep) {
    keep.push_back(Tensor::zeros(DType::fp32, v.shape));
    return keep.back().view();
  };
  const auto bf16 = [](Shape s, std::vector<Tensor>& keep) {
    keep.push_back(Tensor::zeros(DType::bf16, s));
    return keep.back().view();
  };
  // A view that says it lives on a GPU (its bytes are on the host: nothing may read them, the checks only look).
  const auto on_gpu = [](const TensorView& v) { return TensorView(v.data, v.dtype, v.shape, Device::cuda(0)); };
  return {
      {"topk_idx on a GPU", [=](MoEForwardArgs& a, auto&) { a.topk_idx = on_gpu(a.topk_idx); },
       {"'topk_idx'", "on cpu (hidden's device)", "int64[6, 2] cuda:0"}},
      {"topk_weights on a GPU", [=](MoEForwardArgs& a, auto&) { a.topk_weights = on_gpu(a.topk_weights); },
       {"'topk_weights'", "on cpu (hidden's device)", "float32[6, 2] cuda:0"}},
      {"hidden on a GPU with CPU experts", [=](MoEForwardArgs& a, auto&) { a.hidden = on_gpu(a.hidden); },
       {"'hidden'", "a CPU tensor (the 'blas' experts run on the CPU)", "bfloat16[6, 32] cuda:0"}},
      {"w1 float32", [=](MoEForwardArgs& a, auto& k) { a.w1 = f32(a.w1, k); }, {"'w1'", "bfloat16", "float32"}},
      {"w2 float32", [=](MoEForwardArgs& a, auto& k) { a.w2 = f32(a.w2, k); }, {"'w2'", "bfloat16", "float32"}},
      {"w1 missing", [](MoEForwardArgs& a, auto&) { a.w1 = TensorView(); }, {"'w1'", "None"}},
      {"w2 with the wrong N",
       [=](MoEForwardArgs& a, auto& k) { a.w2 = bf16({e_local, kH, kN / 2}, k); },
       {"'w2'", "expected shape [2, 32, 16]", "N = 16 from w1", "[2, 32, 8]"}},
      {"w2 with the wrong H",
       [=](MoEForwardArgs& a, auto& k) { a.w2 = bf16({e_local, kH + 8, kN}, k); },
       {"'w2'", "expected shape [2, 32, 16]", "[2, 40, 16]"}},
      {"w2 with too many experts",
       [=](MoEForwardArgs& a, auto& k) { a.w2 = bf16({e_local + 1, kH, kN}, k); },
       {"'w2'", "[2, 32, 16]", "[3, 32, 16]", "E_local = 2"}},
      {"w1 with the wrong H",
       [=](MoEForwardArgs& a, auto& k) { a.w1 = bf16({e_local, 2 * kN, kH + 8}, k); },
       {"'w1'", "[2, 2N, 32]", "H = 32 from hidden", "[2, 32, 40]"}},
      {"w1 with odd rows for a gated activation",
       [=](MoEForwardArgs& a, auto& k) { a.w1 = bf16({e_local, 2 * kN + 1, kH}, k); },
       {"'w1'", "gated activation 'silu'", "[2, 33, 32]"}},
      {"w1 of two dimensions",
       [=](MoEForwardArgs& a, auto& k) { a.w1 = bf16({e_local * 2 * kN, kH}, k); }, {"'w1'", "3 dimensions"}},
      {"activation out of range",
       [](MoEForwardArgs& a, auto&) { a.activation = static_cast<Activation>(42); }, {"'activation'", "42"}},
      {"global_num_experts zero", [](MoEForwardArgs& a, auto&) { a.global_num_experts = 0; },
       {"'global_num_experts'", "> 0"}},
      {"output of the wrong shape",
       [=](MoEForwardArgs& a, auto& k) { a.output = bf16({kT, kH + 1}, k); }, {"'output'", "[6, 32]", "[6, 33]"}},
  };
}

void expect_invalid(const std::function<void()>& call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << m;
    for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "'" << p << "' not in: " << m;
  }
}

// Rank 1 alone makes each bad call: were any of them to communicate, rank 1 would wait for rank 0 (which makes
// no such call) and time out, or leave the ranks out of step. Afterwards both ranks run valid calls on the same
// layers, whose results match the float64 reference.
void bad_arguments_fail_alone_and_leave_the_layer_usable(bool low_latency) {
  std::mt19937_64 rng(fresh_seed());
  const Inputs in = make_inputs(rng);
  std::vector<Tensor> out(kR), again(kR);
  run_thread_ranks(
      kR,
      [&](Group& g) {
        const int r = g.rank();
        auto buffer = std::make_shared<Buffer>(borrow(g));
        ExpertsConfig ec;
        std::shared_ptr<PrepareFinalize> pf;
        if (low_latency) {
          pf = make_low_latency_prepare_finalize(buffer, static_cast<int>(kT));
          ec.format = ActivationFormat::batched_experts;
        } else {
          pf = make_normal_prepare_finalize(buffer);
        }
        MoELayer layer(pf, std::shared_ptr<Experts>(make_blas_experts(ec)));
        if (r == 1) {
          for (const BadCase& c : bad_cases()) {
            SCOPED_TRACE(c.name);
            std::vector<Tensor> keep;
            MoEForwardArgs a = valid_args(in, r);
            c.spoil(a, keep);
            expect_invalid([&] { layer.forward(a); }, c.parts);
            EXPECT_EQ(layer.prepare_finalize().stage(), Stage::initial);
          }
        }
        out[static_cast<std::size_t>(r)] = layer.forward(valid_args(in, r)).output;
        again[static_cast<std::size_t>(r)] = layer.forward(valid_args(in, r)).output;
      },
      10.0);
  for (int r = 0; r < kR; ++r) {
    EXPECT_LE(error_vs_reference(in, r, out[static_cast<std::size_t>(r)]), 1e-2) << "rank " << r;
    EXPECT_LE(error_vs_reference(in, r, again[static_cast<std::size_t>(r)]), 1e-2) << "rank " << r;
  }
}

TEST(MoELayerArgs, NormalModeBadWeightsFailBeforeCommunicatingNamingTheRightArgument) {
  bad_arguments_fail_alone_and_leave_the_layer_usable(false);
}

TEST(MoELayerArgs, LowLatencyModeBadWeightsFailBeforeCommunicatingNamingTheRightArgument) {
  bad_arguments_fail_alone_and_leave_the_layer_usable(true);
}

TEST(MoELayerArgs, NoEpBadWeightsNameTheRightArgumentAndLeaveTheLayerUsable) {
  std::mt19937_64 rng(fresh_seed());
  const Inputs in = make_inputs(rng);
  MoELayer layer(make_no_ep_prepare_finalize(), std::shared_ptr<Experts>(make_reference_experts()));
  MoEForwardArgs good = valid_args(in, 0);
  good.w1 = in.w1;  // one rank: every expert is local
  good.w2 = in.w2;
  std::vector<Tensor> keep;
  MoEForwardArgs bad = good;
  keep.push_back(Tensor::zeros(DType::bf16, {kE, kH, kN + 8}));
  bad.w2 = keep.back();
  expect_invalid([&] { layer.forward(bad); }, {"'w2'", "expected shape [4, 32, 16]", "got bfloat16[4, 32, 24]"});
  bad = good;
  keep.push_back(Tensor::zeros(DType::bf16, {kE - 1, 2 * kN, kH}));
  bad.w1 = keep.back();
  expect_invalid([&] { layer.forward(bad); }, {"'w1'", "E_local = 4 from global_num_experts = 4"});
  // A bad id is named with its [t, k], as the caller indexes topk_idx.
  bad = good;
  keep.push_back(test::random_topk_idx(rng, kT, kK, kE));
  keep.back().ptr<std::int64_t>()[1 * kK + 1] = kE;
  bad.topk_idx = keep.back();
  expect_invalid([&] { layer.forward(bad); }, {"'topk_idx'", std::to_string(kE) + " at [1, 1]"});
  EXPECT_LE(error_vs_reference(in, 0, layer.forward(good).output), 1e-2);
}

// Experts that say they run on a GPU (the layer's device checks key on the name "cuda") and must never run here.
class FakeCudaExperts final : public Experts {
 public:
  FakeCudaExperts() : Experts(ExpertsConfig{}) {}
  std::string_view name() const override { return "cuda"; }

 protected:
  void run(const ExpertsProblem&, const TensorView&) const override { ADD_FAILURE() << "the experts ran"; }
};

// CUDA experts given a CPU hidden: refused naming hidden before the prepare step (which would otherwise run on the
// CPU and dispatch, and the experts refuse its output only then, leaving the ranks out of step). Rank 1 alone makes
// the call, twice (the layer stays usable: the second is refused the same way, not as unusable); afterwards both
// ranks run a valid forward over the same buffer, which a bad call that communicated would have put out of step.
TEST(MoELayerArgs, CudaExpertsWithACpuHiddenAreRefusedBeforeCommunicating) {
  std::mt19937_64 rng(fresh_seed());
  const Inputs in = make_inputs(rng);
  std::vector<Tensor> out(kR);
  run_thread_ranks(
      kR,
      [&](Group& g) {
        const int r = g.rank();
        auto buffer = std::make_shared<Buffer>(borrow(g));
        if (r == 1) {
          MoELayer layer(make_normal_prepare_finalize(buffer), std::make_shared<FakeCudaExperts>());
          MoEForwardArgs a = valid_args(in, r);
          a.w1 = TensorView(a.w1.data, a.w1.dtype, a.w1.shape, Device::cuda(0));  // the weights where the experts run
          a.w2 = TensorView(a.w2.data, a.w2.dtype, a.w2.shape, Device::cuda(0));
          for (int call = 0; call < 2; ++call) {
            SCOPED_TRACE("call " + std::to_string(call));
            expect_invalid([&] { layer.forward(a); },
                           {"'hidden'", "a CUDA tensor (the 'cuda' experts run on a GPU)", "bfloat16[6, 32] cpu"});
            EXPECT_EQ(layer.prepare_finalize().stage(), Stage::initial);
          }
        }
        MoELayer layer(make_normal_prepare_finalize(buffer), std::shared_ptr<Experts>(make_blas_experts()));
        out[static_cast<std::size_t>(r)] = layer.forward(valid_args(in, r)).output;
      },
      10.0);
  for (int r = 0; r < kR; ++r) EXPECT_LE(error_vs_reference(in, r, out[static_cast<std::size_t>(r)]), 1e-2) << "rank " << r;
}

// A failure after the dispatch has started (here a hook that throws before the combine on rank 1) leaves the
// ranks out of step: rank 0 times out in the combine; later calls on either rank raise unusable naming the
// earlier failure, not a stage error.
TEST(MoELayerArgs, AFailureAfterTheDispatchMakesLaterCallsUnusableNamingIt) {
  std::mt19937_64 rng(fresh_seed());
  const Inputs in = make_inputs(rng);
  std::vector<std::string> first(kR), later(kR);
  std::vector<ErrorCode> later_code(kR, ErrorCode::internal);
  const auto errors = run_thread_ranks_collect(
      kR,
      [&](Group& g) {
        const int r = g.rank();
        g.set_timeout_s(1.0);
        MoELayer layer(make_normal_prepare_finalize(std::make_shared<Buffer>(borrow(g))),
                       std::shared_ptr<Experts>(make_blas_experts()));
        if (r == 1)
          layer.prepare_finalize().before_combine = [] { throw std::runtime_error("hook failed on purpose"); };
        try {
          layer.forward(valid_args(in, r));
        } catch (const std::exception& e) {
          first[static_cast<std::size_t>(r)] = e.what();
        }
        try {
          layer.forward(valid_args(in, r));
        } catch (const Error& e) {
          later[static_cast<std::size_t>(r)] = e.what();
          later_code[static_cast<std::size_t>(r)] = e.code();
        }
      },
      10.0);
  for (const auto& e : errors) EXPECT_FALSE(e);
  EXPECT_EQ(first[1], "hook failed on purpose");
  EXPECT_NE(first[0].find("timed out"), std::string::npos) << first[0];
  for (int r = 0; r < kR; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const std::string& m = later[static_cast<std::size_t>(r)];
    EXPECT_EQ(later_code[static_cast<std::size_t>(r)], ErrorCode::unusable) << m;
    EXPECT_NE(m.find("earlier forward failed"), std::string::npos) << m;
    EXPECT_NE(m.find(first[static_cast<std::size_t>(r)]), std::string::npos) << m;
  }
  EXPECT_NE(later[1].find("AFTER_DISPATCH_B"), std::string::npos) << later[1];
}

// A batched no-EP prepare's slots are int32-counted: a max_tokens_per_expert past 2^31 - 1 is named when the
// prepare is made (it had reached the slabs' allocation, whose byte count wrapped).
TEST(NoEpPrepareArgs, MaxTokensPerExpertPast31BitsIsNamed) {
  for (std::int64_t huge : {std::int64_t{1} << 31, std::int64_t{1} << 40, std::int64_t{1} << 62}) {
    NoEpOptions no_ep;
    no_ep.format = ActivationFormat::batched_experts;
    no_ep.max_tokens_per_expert = huge;
    try {
      make_no_ep_prepare_finalize({}, no_ep);
      ADD_FAILURE() << "no error for max_tokens_per_expert = " << huge;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("'max_tokens_per_expert'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::to_string(huge)), std::string::npos) << e.what();
    }
  }
}

// ---- fp8 block-scaled weights and GPU shared experts: the layer's argument checks ----

// fp8 weights of all kF8E experts (H = 144, N = 48: partial 128-blocks) and rank-local inputs.
constexpr int kF8E = 4;
constexpr std::int64_t kF8H = 144, kF8N = 48, kF8T = 10;

struct Fp8Layer {
  test::Fp8Weights w;  // [E, 2N, H] / [E, H, N] with their block scales
  std::vector<Tensor> x, topk_idx, topk_weights;
};

Fp8Layer make_fp8_layer(std::mt19937_64& rng) {
  Fp8Layer l;
  l.w = test::random_fp8_weights(rng, kF8E, kF8N, kF8H, Activation::silu);
  for (int r = 0; r < kR; ++r) {
    l.x.push_back(test::random_bf16(rng, kF8T, kF8H));
    l.topk_idx.push_back(test::random_topk_idx(rng, kF8T, kK, kF8E));
    l.topk_weights.push_back(test::random_topk_weights(rng, l.topk_idx.back()));
  }
  return l;
}

// Rank r's arguments with its e_local of the kF8E experts.
MoEForwardArgs fp8_args(const Fp8Layer& l, int r, int e_local) {
  MoEForwardArgs a;
  const auto ru = static_cast<std::size_t>(r);
  a.hidden = l.x[ru];
  a.w1 = l.w.w1.view().slice_rows(r * e_local, (r + 1) * e_local);
  a.w2 = l.w.w2.view().slice_rows(r * e_local, (r + 1) * e_local);
  a.w1_scale = l.w.w1_scales.view().slice_rows(r * e_local, (r + 1) * e_local);
  a.w2_scale = l.w.w2_scales.view().slice_rows(r * e_local, (r + 1) * e_local);
  a.topk_idx = l.topk_idx[ru];
  a.topk_weights = l.topk_weights[ru];
  a.global_num_experts = kF8E;
  return a;
}

// The naive float64 model of the fp8 experts (weights dequantized per block, activations quantized per 1x128
// group, tests/support/experts_fp8_reference) over all experts for rank r's tokens.
double fp8_error(const Fp8Layer& l, int r, const Tensor& got) {
  const auto ru = static_cast<std::size_t>(r);
  const std::vector<double> want =
      test::naive_fp8_experts_standard(l.x[ru], {}, l.w.w1, l.w.w1_scales, l.w.w2, l.w.w2_scales, l.topk_weights[ru],
                                       l.topk_idx[ru], Activation::silu, {}, false, true);
  return test::relative_l2(want, got.view());
}

std::vector<BadCase> fp8_bad_cases(int e_local) {
  const auto make = [](DType t, Shape s, std::vector<Tensor>& keep) {
    keep.push_back(Tensor::zeros(t, s));
    return keep.back().view();
  };
  const std::string s1 = "[" + std::to_string(e_local) + ", 1, 2]", s2 = "[" + std::to_string(e_local) + ", 2, 1]";
  return {
      {"fp8 weights without w1_scale", [](MoEForwardArgs& a, auto&) { a.w1_scale = TensorView(); },
       {"'w1_scale'", "None (fp8 weights need their block scales)", s1}},
      {"fp8 weights without w2_scale", [](MoEForwardArgs& a, auto&) { a.w2_scale = TensorView(); },
       {"'w2_scale'", "None", s2}},
      {"w1_scale of w2's shape",
       [=](MoEForwardArgs& a, auto& k) { a.w1_scale = make(DType::fp32, {e_local, 2, 1}, k); },
       {"'w1_scale'", "float32 " + s1, "one scale per 128x128 block", "float32" + s2}},
      {"w2_scale with a block too many",
       [=](MoEForwardArgs& a, auto& k) { a.w2_scale = make(DType::fp32, {e_local, 2, 2}, k); },
       {"'w2_scale'", "[E_local, ceil(H/128), ceil(N/128)]"}},
      {"w1_scale bfloat16", [=](MoEForwardArgs& a, auto& k) { a.w1_scale = make(DType::bf16, {e_local, 1, 2}, k); },
       {"'w1_scale'", "contiguous float32", "bfloat16" + s1}},
      {"bf16 w1 for fp8 experts",
       [=](MoEForwardArgs& a, auto& k) { a.w1 = make(DType::bf16, {e_local, 2 * kF8N, kF8H}, k); },
       {"'w1'", "float8_e4m3fn weights for the 'reference' experts with fp8_block weights"}},
      {"bf16 w2 for fp8 experts", [=](MoEForwardArgs& a, auto& k) { a.w2 = make(DType::bf16, {e_local, kF8H, kF8N}, k); },
       {"'w2'", "float8_e4m3fn"}},
  };
}

// fp8 weights with their scales through the layer: rank 1 alone makes every bad call (a call that communicated would
// wait for rank 0 and time out), then both ranks run good ones over the normal-mode buffer against the float64 model.
TEST(MoELayerArgs, Fp8WeightScalesAreCheckedBeforeCommunicatingAndTheLayerMatchesFloat64) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Fp8Layer l = make_fp8_layer(rng);
  std::vector<Tensor> out(kR);
  ExpertsConfig ec;
  ec.quant = ExpertsQuant::fp8_block;
  run_thread_ranks(
      kR,
      [&](Group& g) {
        const int r = g.rank();
        MoELayer layer(make_normal_prepare_finalize(std::make_shared<Buffer>(borrow(g))),
                       std::shared_ptr<Experts>(make_reference_experts(ec)));
        if (r == 1)
          for (const BadCase& c : fp8_bad_cases(kF8E / kR)) {
            SCOPED_TRACE(c.name);
            std::vector<Tensor> keep;
            MoEForwardArgs a = fp8_args(l, r, kF8E / kR);
            c.spoil(a, keep);
            expect_invalid([&] { layer.forward(a); }, c.parts);
            EXPECT_EQ(layer.prepare_finalize().stage(), Stage::initial);
          }
        out[static_cast<std::size_t>(r)] = layer.forward(fp8_args(l, r, kF8E / kR)).output;
      },
      10.0);
  for (int r = 0; r < kR; ++r)
    EXPECT_LE(fp8_error(l, r, out[static_cast<std::size_t>(r)]), 1e-2) << "rank " << r << " seed " << seed;
  // No EP: one rank holds every expert.
  MoELayer no_ep(make_no_ep_prepare_finalize(), std::shared_ptr<Experts>(make_reference_experts(ec)));
  for (const BadCase& c : fp8_bad_cases(kF8E)) {
    SCOPED_TRACE(c.name);
    std::vector<Tensor> keep;
    MoEForwardArgs a = fp8_args(l, 0, kF8E);
    c.spoil(a, keep);
    expect_invalid([&] { no_ep.forward(a); }, c.parts);
  }
  EXPECT_LE(fp8_error(l, 0, no_ep.forward(fp8_args(l, 0, kF8E)).output), 1e-2) << "seed " << seed;
}

// bf16 experts refuse block scales and fp8 weights, naming them.
TEST(MoELayerArgs, Bf16ExpertsRefuseWeightScalesAndFp8Weights) {
  std::mt19937_64 rng(fresh_seed());
  const Inputs in = make_inputs(rng);
  const Fp8Layer l = make_fp8_layer(rng);
  MoELayer layer(make_no_ep_prepare_finalize(), std::shared_ptr<Experts>(make_reference_experts()));
  MoEForwardArgs good = valid_args(in, 0);
  good.w1 = in.w1;
  good.w2 = in.w2;
  const Tensor s1 = Tensor::zeros(DType::fp32, {kE, 1, 1}), s2 = Tensor::zeros(DType::fp32, {kE, 1, 1});
  MoEForwardArgs bad = good;
  bad.w1_scale = s1;
  expect_invalid([&] { layer.forward(bad); },
                 {"'w1_scale'", "None for the 'reference' experts with bfloat16 weights", "made with quant fp8_block",
                  "float32[4, 1, 1]"});
  bad = good;
  bad.w2_scale = s2;
  expect_invalid([&] { layer.forward(bad); }, {"'w2_scale'", "None"});
  MoEForwardArgs fp8 = fp8_args(l, 0, kF8E);  // fp8 weights and scales for bf16 experts
  expect_invalid([&] { layer.forward(fp8); }, {"'w1'", "bfloat16", "float8_e4m3fn"});
  EXPECT_LE(error_vs_reference(in, 0, layer.forward(good).output), 1e-2);
}

// make_cuda_shared_experts checks its weights before anything else (also in builds without CUDA).
TEST(MoELayerArgs, CudaSharedExpertsRefuseCpuOrMisshapenWeights) {
  std::mt19937_64 rng(fresh_seed());
  const Tensor w1 = test::random_bf16(rng, 2 * kN, kH), w2 = test::random_bf16(rng, kH, kN);
  expect_invalid([&] { make_cuda_shared_experts(w1, w2); }, {"'w1_shared'", "CUDA tensor", "cpu"});
  // Views that say they live on a GPU (nothing reads them: the shapes are refused first).
  const auto gpu = [](const Tensor& t, Shape s) {
    return Tensor::wrap(TensorView(t.data(), t.dtype(), s, Device::cuda(0)), nullptr);
  };
  expect_invalid([&] { make_cuda_shared_experts(gpu(w1, {2 * kN, kH}), gpu(w2, {kN, kH})); },
                 {"'w2_shared'", "[32, 16]", "bfloat16[16, 32] cuda:0"});
  expect_invalid([&] { make_cuda_shared_experts(gpu(w1, {2 * kN - 1, kH}), gpu(w2, {kH, kN})); },
                 {"'w1_shared'", "gated activation 'silu'"});
  expect_invalid([&] { make_cuda_shared_experts(gpu(w1, {2 * kN, kH}), Tensor()); }, {"'w2_shared'", "None"});
}
// ---- end fp8 block-scaled weights and GPU shared experts ----

}  // namespace
}  // namespace epmoe
