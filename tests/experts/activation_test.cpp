// Activation definitions, names and the per-implementation properties, on hand-made values.
#include <gtest/gtest.h>

#include "experts/experts_test_util.hpp"
#include "experts/problem.hpp"

#include <cmath>

namespace epmoe {
namespace {

using test::all_activations;

// (gate, up) pairs and the exact results, computed independently with Python's math module (exp,
// erf) from semantics §7's formulas. The third pair makes swigluoai clamp both inputs, the fourth clamps up.
constexpr double kGate[4] = {1.0, -1.25, 8.0, 0.5};
constexpr double kUp[4] = {2.0, 3.0, -9.0, 8.0};
struct Expected {
  Activation act;
  double v[4];
};
const Expected kExpected[] = {
    {Activation::silu, {1.4621171572600098, -0.8351255205949082, -71.97585479060642, 2.4898373248074184}},
    {Activation::gelu, {1.6826894921370859, -0.3961866512507074, -71.99999999999996, 2.7658498450960525}},
    {Activation::swigluoai, {2.537387297798464, -0.5322627942273227, -41.99971876981991, 2.803107492851041}},
    // Non-gated: only the gate value (the single input x) is used.
    {Activation::silu_no_mul, {0.7310585786300049, -0.27837517353163604, 7.997317198956269, 0.3112296656009273}},
    {Activation::gelu_no_mul, {0.8413447460685429, -0.13206221708356913, 7.999999999999995, 0.34573123063700656}},
    {Activation::relu2_no_mul, {1.0, 0.0, 64.0, 0.25}},
};

TEST(Activation, NamesRoundTripAndGatedness) {
  const char* names[] = {"silu", "gelu", "swigluoai", "silu_no_mul", "gelu_no_mul", "relu2_no_mul"};
  const bool gated[] = {true, true, true, false, false, false};
  for (std::size_t i = 0; i < all_activations().size(); ++i) {
    const Activation a = all_activations()[i];
    EXPECT_EQ(activation_name(a), names[i]);
    EXPECT_EQ(parse_activation(names[i]), a);
    EXPECT_EQ(is_gated(a), gated[i]);
  }
}

TEST(Activation, ParseUnknownNameIsAnErrorNamingTheArgument) {
  for (const char* bad : {"relu", "SiLU", "", "silu_and_mul"}) {
    try {
      parse_activation(bad);
      ADD_FAILURE() << "no error for '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("'activation'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("swigluoai"), std::string::npos) << e.what();
    }
  }
}

TEST(Activation, HandMadeScalarValues) {
  for (const Expected& ex : kExpected)
    for (int i = 0; i < 4; ++i) {
      const double tol = 1e-14 * std::max(1.0, std::fabs(ex.v[i]));
      EXPECT_NEAR(activation_value(ex.act, kGate[i], kUp[i]), ex.v[i], tol) << activation_name(ex.act) << " #" << i;
      // The test reference must agree too, or nothing else it checks can be trusted.
      EXPECT_NEAR(test::naive_activation(ex.act, kGate[i], kUp[i]), ex.v[i], tol)
          << "naive " << activation_name(ex.act) << " #" << i;
    }
  // Edges: silu(0) = gelu(0) = relu2(0) = 0; swigluoai at the clamp boundary and below -7 for up.
  EXPECT_EQ(activation_value(Activation::silu_no_mul, 0.0), 0.0);
  EXPECT_EQ(activation_value(Activation::gelu_no_mul, 0.0), 0.0);
  EXPECT_EQ(activation_value(Activation::relu2_no_mul, -3.0), 0.0);
  EXPECT_DOUBLE_EQ(activation_value(Activation::swigluoai, 7.0, -20.0),
                   activation_value(Activation::swigluoai, 100.0, -7.0));
  // Gate is only clamped from above: a very negative gate is not limited to -7.
  EXPECT_NE(activation_value(Activation::swigluoai, -8.0, 1.0), activation_value(Activation::swigluoai, -7.0, 1.0));
}

TEST(Activation, FormatAndWeightAndReduceNames) {
  EXPECT_EQ(activation_format_name(ActivationFormat::standard), "standard");
  EXPECT_EQ(activation_format_name(ActivationFormat::batched_experts), "batched_experts");
  EXPECT_EQ(weight_and_reduce_name(WeightAndReduce::none), "none");
  EXPECT_EQ(weight_and_reduce_name(WeightAndReduce::contiguous), "contiguous");
  EXPECT_EQ(weight_and_reduce_name(WeightAndReduce::naive_batched), "naive_batched");
  EXPECT_EQ(weight_and_reduce_name(WeightAndReduce::delegate), "delegate");
}

TEST(Experts, EachImplementationAnnouncesItsFormatAndWeightAndReduce) {
  for (auto make : {make_reference_experts, make_blas_experts}) {
    const auto std_reduce = make({ActivationFormat::standard, true});
    const auto std_plain = make({ActivationFormat::standard, false});
    const auto batched = make({ActivationFormat::batched_experts, true});
    EXPECT_EQ(std_reduce->weight_and_reduce(), WeightAndReduce::none);
    EXPECT_EQ(std_plain->weight_and_reduce(), WeightAndReduce::contiguous);
    EXPECT_EQ(batched->weight_and_reduce(), WeightAndReduce::delegate);
    EXPECT_EQ(std_reduce->activation_format(), ActivationFormat::standard);
    EXPECT_EQ(batched->activation_format(), ActivationFormat::batched_experts);
    EXPECT_TRUE(std_reduce->supports_expert_map());
    EXPECT_FALSE(batched->supports_expert_map());
  }
  EXPECT_EQ(make_reference_experts()->name(), "reference");
  EXPECT_EQ(make_blas_experts()->name(), "blas");
}

// A 1-expert MLP whose weights only select inputs: w1 rows are unit vectors picking x entries as gate
// and up, w2 picks channel j into output j. The output is then act(gate_j, up_j) for j < N and 0
// beyond, for both implementations (the BLAS path rounds the activation to bf16 on the way, which
// is within the 1-ulp tolerance here since gate and up are exact).
TEST(Experts, HandMadeSelectorMlpEveryActivation) {
  constexpr std::int64_t H = 8, N = 4;
  // x interleaves gate and up values: x[2j] = gate_j, x[2j+1] = up_j.
  Tensor x = Tensor::empty(DType::bf16, {1, H});
  for (int j = 0; j < N; ++j) {
    x.ptr<bf16_t>()[2 * j] = float_to_bf16(static_cast<float>(kGate[j]));
    x.ptr<bf16_t>()[2 * j + 1] = float_to_bf16(static_cast<float>(kUp[j]));
  }
  Tensor idx = Tensor::empty(DType::int64, {1, 1});
  idx.ptr<std::int64_t>()[0] = 0;
  Tensor wts = Tensor::empty(DType::fp32, {1, 1});
  wts.ptr<float>()[0] = 1.0f;
  for (const Expected& ex : kExpected) {
    const bool gated = is_gated(ex.act);
    const std::int64_t rows = gated ? 2 * N : N;
    Tensor w1 = Tensor::zeros(DType::bf16, {1, rows, H});
    Tensor w2 = Tensor::zeros(DType::bf16, {1, H, N});
    const bf16_t one = float_to_bf16(1.0f);
    for (std::int64_t j = 0; j < N; ++j) {
      if (ex.act == Activation::swigluoai) {  // gate row 2j, up row 2j+1
        w1.ptr<bf16_t>()[(2 * j) * H + 2 * j] = one;
        w1.ptr<bf16_t>()[(2 * j + 1) * H + 2 * j + 1] = one;
      } else if (gated) {  // gate rows [0, N), up rows [N, 2N)
        w1.ptr<bf16_t>()[j * H + 2 * j] = one;
        w1.ptr<bf16_t>()[(N + j) * H + 2 * j + 1] = one;
      } else {
        w1.ptr<bf16_t>()[j * H + 2 * j] = one;
      }
      w2.ptr<bf16_t>()[j * N + j] = one;
    }
    ExpertsInputs in;
    in.hidden = x;
    in.w1 = w1;
    in.w2 = w2;
    in.topk_idx = idx;
    in.topk_weights = wts;
    in.activation = ex.act;
    for (auto make : {make_reference_experts, make_blas_experts}) {
      const auto experts = make({});
      const Tensor out = experts->apply(in);
      for (std::int64_t c = 0; c < H; ++c) {
        const double want = c < N ? ex.v[c] : 0.0;
        const double got = bf16_to_float(out.ptr<bf16_t>()[c]);
        EXPECT_NEAR(got, want, std::fabs(want) * std::ldexp(1.0, -7) + 1e-30)
            << experts->name() << " " << activation_name(ex.act) << " channel " << c;
      }
    }
  }
}

// A double must round to bf16 once: 1 + 2^-8 + 2^-30 lies just above the midpoint between 1 and
// 1 + 2^-7, so it rounds up; going through float first would lose the 2^-30 and tie to 1.
TEST(Experts, DoubleToBf16RoundsOnce) {
  EXPECT_EQ(bf16_to_float(double_to_bf16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30))), 1.0f + 0x1p-7f);
  EXPECT_EQ(bf16_to_float(double_to_bf16(-(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30)))), -(1.0f + 0x1p-7f));
  EXPECT_EQ(bf16_to_float(double_to_bf16(1.0 + std::ldexp(1.0, -8))), 1.0f);  // exact tie: to even
  EXPECT_EQ(bf16_to_float(double_to_bf16(1.0 + std::ldexp(1.0, -8) - std::ldexp(1.0, -40))), 1.0f);
  EXPECT_EQ(bf16_to_float(double_to_bf16(3.0)), 3.0f);
  EXPECT_EQ(bf16_to_float(double_to_bf16(0.0)), 0.0f);
  EXPECT_TRUE(std::isinf(bf16_to_float(double_to_bf16(1e300))));
  EXPECT_TRUE(std::isnan(bf16_to_float(double_to_bf16(std::nan("")))));
}

}  // namespace
}  // namespace epmoe
