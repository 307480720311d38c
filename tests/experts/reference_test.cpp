// The library's float64 reference experts against the independent naive model in tests/support:
// the unrounded results agree to ~1e-12 relative, the bf16 outputs to 1 ulp.
#include <gtest/gtest.h>

#include "experts/experts_test_util.hpp"

#include <cmath>

namespace epmoe {
namespace {

using namespace epmoe::test;

// Unrounded: relative L2 and the largest element error, both against the reference's scale.
void expect_f64_close(const std::vector<double>& want, const std::vector<double>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  double max_ref = 0.0, max_err = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(want[i]));
    max_err = std::max(max_err, std::fabs(want[i] - got[i]));
  }
  ASSERT_GT(max_ref, 0.0) << what << ": a degenerate case (all zeros) proves nothing";
  EXPECT_LE(relative_l2(want, got), 1e-12) << what;
  EXPECT_LE(max_err, 1e-12 * max_ref) << what;
}

// bf16 output within one bf16 ulp of the exact value (a correct rounding is within half of one).
void expect_bf16_within_ulp(const std::vector<double>& want, const Tensor& out, const std::string& what) {
  ASSERT_EQ(static_cast<std::int64_t>(want.size()), out.numel()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double got = bf16_to_float(out.ptr<bf16_t>()[i]);
    const double w = want[i];
    const double ulp = w == 0.0 ? 0.0 : std::ldexp(1.0, std::ilogb(w) - 7);
    if (std::fabs(got - w) > ulp + 1e-300 && bad++ < 5)
      ADD_FAILURE() << what << ": element " << i << " = " << got << ", exact " << w;
  }
  EXPECT_EQ(bad, 0) << what;
}

TEST(ReferenceExperts, StandardReducedAndUnreducedMatchNaiveEveryActivation) {
  std::mt19937_64 rng(fresh_seed());
  for (Activation act : all_activations())
    for (bool reduce : {true, false}) {
      StandardOptions o;
      o.m = 24;
      o.h = 128;
      o.n = 96;
      o.e_local = 6;
      const StandardCase c = make_standard(rng, act, o);
      const ExpertsConfig cfg{ActivationFormat::standard, reduce};
      const std::string what = fmt::format("{} reduce={}", activation_name(act), reduce);
      const std::vector<double> want = c.naive(reduce);
      expect_f64_close(want, reference_experts_f64(c.inputs(), cfg), what);
      const auto experts = make_reference_experts(cfg);
      Tensor out = poisoned_bf16(experts->output_shape(c.inputs()));
      experts->apply(c.inputs(), out);
      expect_bf16_within_ulp(want, out, what);
    }
}

TEST(ReferenceExperts, ExpertMapWithMinusOneInt32IdsFp32Hidden) {
  std::mt19937_64 rng(fresh_seed());
  for (bool reduce : {true, false}) {
    StandardOptions o;
    o.m = 40;
    o.k = 6;
    o.e_local = 4;
    o.e_global = 16;  // three quarters of the ids map to -1
    o.idx_int32 = true;
    o.hidden_fp32 = true;
    o.h = 256;
    o.n = 64;
    const StandardCase c = make_standard(rng, Activation::silu, o);
    const ExpertsConfig cfg{ActivationFormat::standard, reduce};
    ExpertsInputs in = c.inputs();
    in.global_num_experts = 16;
    const std::vector<double> want = c.naive(reduce);
    expect_f64_close(want, reference_experts_f64(in, cfg), "expert_map");
    const Tensor out = make_reference_experts(cfg)->apply(in);
    expect_bf16_within_ulp(want, out, "expert_map");
  }
}

TEST(ReferenceExperts, RouterWeightOnInputWithK1) {
  std::mt19937_64 rng(fresh_seed());
  for (bool reduce : {true, false}) {
    StandardOptions o;
    o.k = 1;
    o.p_minus_one = 0.2;
    StandardCase c = make_standard(rng, Activation::gelu, o);
    c.weight_on_input = true;
    const ExpertsConfig cfg{ActivationFormat::standard, reduce};
    const std::vector<double> want = c.naive(reduce);
    expect_f64_close(want, reference_experts_f64(c.inputs(), cfg), "weight on input");
    expect_bf16_within_ulp(want, make_reference_experts(cfg)->apply(c.inputs()), "weight on input");
  }
}

TEST(ReferenceExperts, BatchedMatchesNaiveAndLeavesRowsPastTheCountUntouched) {
  std::mt19937_64 rng(fresh_seed());
  for (Activation act : all_activations()) {
    const BatchedCase c = make_batched(rng, act, {3, 0, 16, 7}, 16, 128, 64);
    const ExpertsConfig cfg{ActivationFormat::batched_experts};
    const std::vector<double> want = c.naive();
    expect_f64_close(want, reference_experts_f64(c.inputs(), cfg), std::string(activation_name(act)));
    const auto experts = make_reference_experts(cfg);
    Tensor out = poisoned_bf16(experts->output_shape(c.inputs()));
    experts->apply(c.inputs(), out);
    const std::int32_t* counts = c.counts.ptr<std::int32_t>();
    for (std::int64_t e = 0; e < 4; ++e)
      for (std::int64_t i = 0; i < 16; ++i)
        for (std::int64_t h = 0; h < 128; ++h) {
          const bf16_t v = out.ptr<bf16_t>()[(e * 16 + i) * 128 + h];
          if (i < counts[e]) {
            ASSERT_FALSE(is_poison(v)) << "row " << i << " of expert " << e << " not written";
          } else {
            ASSERT_TRUE(is_poison(v)) << "row " << i << " of expert " << e << " written past the count";
          }
        }
    // The allocating form zero-fills past the counts, so it can be compared as a whole.
    expect_bf16_within_ulp(want, experts->apply(c.inputs()), std::string(activation_name(act)));
  }
}

}  // namespace
}  // namespace epmoe
