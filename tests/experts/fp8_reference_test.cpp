// The float64 reference of the fp8 block-scaled experts (ExpertsQuant::fp8_block) against the independent naive
// model in tests/support/experts_fp8_reference (every activation, both formats, fp8 / bf16 / float32 inputs,
// partial 128-blocks, expert_map, apply_router_weight_on_input), a hand-made case with an exact answer, zero
// tokens, and the fp8 argument checks (wrong scale shapes and dtypes, missing or extra scales).
#include <gtest/gtest.h>

#include "experts/experts_fp8_test_util.hpp"

#include <functional>
#include <string>

namespace epmoe {
namespace {

using namespace epmoe::test;

// Both models are float64 with the same quantization rule: they differ only by summation order.
constexpr double kAgree = 1e-9;

void expect_arg_error(const std::function<void()>& f, const std::string& argument) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
  }
}

TEST(ExpertsFp8Reference, StandardMatchesTheNaiveModelForEveryActivationAndInput) {
  std::mt19937_64 rng(fresh_seed());
  for (Activation act : all_activations())
    for (Fp8Input input : {Fp8Input::bf16, Fp8Input::fp32, Fp8Input::fp8})
      for (bool reduce : {true, false}) {
        Fp8StandardOptions o;
        o.input = input;
        const Fp8StandardCase c = make_fp8_standard(rng, act, o);
        const ExpertsConfig cfg = fp8_config(ActivationFormat::standard, reduce);
        const std::vector<double> want = c.naive(reduce);
        const std::vector<double> got = reference_experts_f64(c.inputs(), cfg);
        ASSERT_EQ(got.size(), want.size());
        EXPECT_LE(relative_l2(want, got), kAgree) << activation_name(act) << " input " << static_cast<int>(input);
        // The bf16 result is the float64 one rounded once.
        const Tensor out = make_reference_experts(cfg)->apply(c.inputs());
        EXPECT_LE(relative_l2(want, out.view()), 4e-3);
      }
}

TEST(ExpertsFp8Reference, ExpertMapInt32IdsAndWeightOnInput) {
  std::mt19937_64 rng(fresh_seed());
  Fp8StandardOptions o;
  o.e_global = 12;
  o.idx_int32 = true;
  const Fp8StandardCase c = make_fp8_standard(rng, Activation::silu, o);
  EXPECT_LE(relative_l2(c.naive(true), reference_experts_f64(c.inputs(), fp8_config(ActivationFormat::standard))),
            kAgree);
  Fp8StandardOptions w;
  w.k = 1;
  w.input = Fp8Input::fp32;
  Fp8StandardCase cw = make_fp8_standard(rng, Activation::gelu, w);
  cw.weight_on_input = true;
  EXPECT_LE(relative_l2(cw.naive(true), reference_experts_f64(cw.inputs(), fp8_config(ActivationFormat::standard))),
            kAgree);
}

TEST(ExpertsFp8Reference, BatchedMatchesTheNaiveModelAndLeavesRowsPastTheCounts) {
  std::mt19937_64 rng(fresh_seed());
  for (Fp8Input input : {Fp8Input::bf16, Fp8Input::fp8})
    for (Activation act : {Activation::silu, Activation::swigluoai, Activation::relu2_no_mul}) {
      const Fp8BatchedCase c = make_fp8_batched(rng, act, {3, 0, 6}, 6, 272, 48, input);
      const ExpertsConfig cfg = fp8_config(ActivationFormat::batched_experts);
      EXPECT_LE(relative_l2(c.naive(), reference_experts_f64(c.inputs(), cfg)), kAgree);
      Tensor out = poisoned_bf16(Shape{3, 6, 272});
      make_reference_experts(cfg)->apply(c.inputs(), out);
      const auto* o = out.ptr<bf16_t>();
      for (std::int64_t e = 0; e < 3; ++e)
        for (std::int64_t t = 0; t < 6; ++t)
          for (std::int64_t h = 0; h < 272; ++h) {
            const bool counted = t < c.counts.ptr<std::int32_t>()[e];
            ASSERT_EQ(is_poison(o[(e * 6 + t) * 272 + h]), !counted) << e << " " << t << " " << h;
          }
    }
}

// x = 2 everywhere (fp8 code 1.0, scale 2); w1 = 0.25 (code 1.0, scale 0.25): g = 16 * 0.5 = 8;
// relu2: 64 in every channel, which semantics §6 stores as 448 * (64 / 448); w2 = 1/16: y = 16 * 64 / 16 = 64.
TEST(ExpertsFp8Reference, HandMadeCaseHasTheExactAnswer) {
  const std::int64_t H = 16, N = 16;
  auto filled = [](DType t, Shape s, auto v) {
    Tensor x = Tensor::empty(t, s);
    using V = decltype(v);
    for (std::int64_t i = 0; i < x.numel(); ++i) static_cast<V*>(x.data())[i] = v;
    return x;
  };
  const fp8_e4m3_t one{0x38};
  ASSERT_EQ(fp8_e4m3_to_float(one), 1.0f);
  ExpertsInputs in;
  const Tensor x = filled(DType::fp8_e4m3, {2, H}, one), xs = filled(DType::fp32, {2, 1}, 2.0f);
  const Tensor w1 = filled(DType::fp8_e4m3, {1, N, H}, one), w1s = filled(DType::fp32, {1, 1, 1}, 0.25f);
  const Tensor w2 = filled(DType::fp8_e4m3, {1, H, N}, one), w2s = filled(DType::fp32, {1, 1, 1}, 1.0f / 16);
  const Tensor idx = filled(DType::int64, {2, 1}, std::int64_t{0});
  Tensor tw = filled(DType::fp32, {2, 1}, 0.5f);
  in.hidden = x;
  in.hidden_scales = xs;
  in.w1 = w1;
  in.w1_scales = w1s;
  in.w2 = w2;
  in.w2_scales = w2s;
  in.topk_idx = idx;
  in.topk_weights = tw;
  in.activation = Activation::relu2_no_mul;
  const std::vector<double> r = reference_experts_f64(in, fp8_config(ActivationFormat::standard));
  ASSERT_EQ(r.size(), static_cast<std::size_t>(2 * H));
  const double stored = 448.0 * static_cast<double>(64.0f / 448.0f);
  for (double v : r) EXPECT_NEAR(v, 0.5 * stored, 1e-12);
  const Tensor out = make_reference_experts(fp8_config(ActivationFormat::standard))->apply(in);
  for (std::int64_t i = 0; i < out.numel(); ++i) EXPECT_EQ(bf16_to_float(out.ptr<bf16_t>()[i]), 32.0f);
}

TEST(ExpertsFp8Reference, ZeroTokensGiveAnEmptyResult) {
  std::mt19937_64 rng(fresh_seed());
  Fp8StandardOptions o;
  o.m = 0;
  for (Fp8Input input : {Fp8Input::bf16, Fp8Input::fp8}) {
    o.input = input;
    const Fp8StandardCase c = make_fp8_standard(rng, Activation::silu, o);
    const auto experts = make_reference_experts(fp8_config(ActivationFormat::standard));
    EXPECT_EQ(experts->output_shape(c.inputs()), (Shape{0, o.h}));
    EXPECT_EQ(experts->apply(c.inputs()).numel(), 0);
  }
}

TEST(ExpertsFp8Reference, BadArgumentsAreRejectedNamingTheArgument) {
  std::mt19937_64 rng(fresh_seed());
  Fp8StandardOptions o;
  o.input = Fp8Input::fp8;
  const Fp8StandardCase c = make_fp8_standard(rng, Activation::silu, o);
  const auto experts = make_reference_experts(fp8_config(ActivationFormat::standard));
  const Tensor f32_3 = Tensor::zeros(DType::fp32, {o.e_local, 1, 1});
  const Tensor bf16_w = Tensor::zeros(DType::bf16, c.w.w1.shape());
  const Tensor f16_scales = Tensor::zeros(DType::fp16, c.w.w2_scales.shape());
  auto run = [&](const std::function<void(ExpertsInputs&)>& edit) {
    return [&, edit] {
      ExpertsInputs in = c.inputs();
      edit(in);
      experts->apply(in);
    };
  };
  expect_arg_error(run([&](ExpertsInputs& in) { in.w1_scales = f32_3; }), "w1_scales");
  expect_arg_error(run([&](ExpertsInputs& in) { in.w1_scales = {}; }), "w1_scales");
  expect_arg_error(run([&](ExpertsInputs& in) { in.w2_scales = f16_scales; }), "w2_scales");
  expect_arg_error(run([&](ExpertsInputs& in) { in.w2_scales = c.w.w1_scales; }), "w2_scales");
  expect_arg_error(run([&](ExpertsInputs& in) { in.w1 = bf16_w; }), "w1");
  expect_arg_error(run([&](ExpertsInputs& in) { in.hidden_scales = {}; }), "hidden_scales");
  expect_arg_error(run([&](ExpertsInputs& in) { in.hidden_scales = c.w.w1_scales; }), "hidden_scales");
  // bf16 hidden with scales, and an fp8 hidden with the router weight to fold in.
  const Tensor xb = random_bf16(rng, o.m, o.h);
  expect_arg_error(run([&](ExpertsInputs& in) { in.hidden = xb; }), "hidden_scales");
  Fp8StandardOptions k1 = o;
  k1.k = 1;
  Fp8StandardCase c1 = make_fp8_standard(rng, Activation::silu, k1);
  c1.weight_on_input = true;
  expect_arg_error([&] { experts->apply(c1.inputs()); }, "apply_router_weight_on_input");
  // H % 16 != 0; and bf16 experts configured without fp8 see fp8 weights as the wrong dtype.
  Fp8StandardOptions odd = o;
  odd.h = 136;
  odd.input = Fp8Input::bf16;
  const Fp8StandardCase co = make_fp8_standard(rng, Activation::silu, odd);
  expect_arg_error([&] { experts->apply(co.inputs()); }, "w2");
  expect_arg_error([&] { make_reference_experts()->apply(c.inputs()); }, "w1");
  // Ids are still checked.
  Tensor bad = Tensor::empty(DType::int64, c.topk_idx.shape());
  std::memcpy(bad.data(), c.topk_idx.data(), c.topk_idx.nbytes());
  bad.ptr<std::int64_t>()[1] = o.e_local;
  expect_arg_error(run([&](ExpertsInputs& in) { in.topk_idx = bad; }), "topk_idx");
}

}  // namespace
}  // namespace epmoe
