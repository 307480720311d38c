// Zero tokens and bad arguments, for both implementations (the check is shared, but each must honour it).
#include <gtest/gtest.h>

#include "experts/experts_test_util.hpp"

#include <functional>

namespace epmoe {
namespace {

using namespace epmoe::test;

using Factory = std::unique_ptr<Experts> (*)(const ExpertsConfig&);

class ExpertsEdge : public ::testing::TestWithParam<Factory> {
 protected:
  std::unique_ptr<Experts> make(const ExpertsConfig& cfg = {}) const { return GetParam()(cfg); }
};

// Expects invalid_argument naming `argument` in quotes.
void expect_arg_error(const std::function<void()>& f, const std::string& argument, const std::string& also = "") {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
    if (!also.empty()) EXPECT_NE(std::string(e.what()).find(also), std::string::npos) << e.what();
  }
}

TEST_P(ExpertsEdge, ZeroTokensGiveAnEmptyResultAndWriteNothing) {
  std::mt19937_64 rng(fresh_seed());
  StandardOptions o;
  o.m = 0;
  for (bool reduce : {true, false}) {
    const StandardCase c = make_standard(rng, Activation::silu, o);
    const auto experts = make({ActivationFormat::standard, reduce});
    const Shape want = reduce ? Shape{0, o.h} : Shape{0, o.k, o.h};
    EXPECT_EQ(experts->output_shape(c.inputs()), want);
    const Tensor out = experts->apply(c.inputs());
    EXPECT_EQ(out.shape(), want);
    EXPECT_EQ(out.numel(), 0);
  }
  // Batched: every count zero -> the output is not touched at all.
  const BatchedCase b = make_batched(rng, Activation::gelu, {0, 0, 0}, 8, 64, 32);
  const auto experts = make({ActivationFormat::batched_experts});
  Tensor out = poisoned_bf16(Shape{3, 8, 64});
  experts->apply(b.inputs(), out);
  for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(is_poison(out.ptr<bf16_t>()[i])) << i;
  // max_tokens == 0 is an empty batch too.
  const BatchedCase b0 = make_batched(rng, Activation::gelu, {0, 0}, 0, 64, 32);
  EXPECT_EQ(experts->apply(b0.inputs()).numel(), 0);
}

TEST_P(ExpertsEdge, TokensWithNoLocalExpertGiveZeroRows) {
  std::mt19937_64 rng(fresh_seed());
  StandardOptions o;
  o.e_global = 16;
  o.e_local = 2;
  StandardCase c = make_standard(rng, Activation::silu, o);
  for (int g = 0; g < 16; ++g) c.expert_map.ptr<std::int32_t>()[g] = -1;  // nothing is local
  Tensor out = poisoned_bf16(Shape{o.m, o.h});
  make()->apply(c.inputs(), out);
  for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.ptr<bf16_t>()[i].bits, 0) << i;
}

TEST_P(ExpertsEdge, StandardArgumentErrorsNameTheArgument) {
  std::mt19937_64 rng(fresh_seed());
  StandardOptions o;
  o.m = 4;
  o.k = 2;
  o.e_local = 4;
  o.h = 64;
  o.n = 32;
  const StandardCase c = make_standard(rng, Activation::silu, o);
  const auto experts = make();
  auto run = [&](const ExpertsInputs& in) { return [&experts, in] { experts->output_shape(in); }; };
  ExpertsInputs in;

  const Tensor f32_w1 = Tensor::zeros(DType::fp32, {4, 64, 64});
  in = c.inputs(); in.w1 = f32_w1; expect_arg_error(run(in), "w1", "bfloat16");
  // Non-gated activation with gated weights: w1 has 2N rows where N are expected.
  in = c.inputs(); in.activation = Activation::relu2_no_mul; expect_arg_error(run(in), "w1", "non-gated");
  const Tensor w2_2d = Tensor::zeros(DType::bf16, {64, 32});
  in = c.inputs(); in.w2 = w2_2d; expect_arg_error(run(in), "w2");
  const Tensor w2_other_e = Tensor::zeros(DType::bf16, {3, 64, 32});
  in = c.inputs(); in.w2 = w2_other_e; expect_arg_error(run(in), "w1");
  in = c.inputs(); in.w1 = TensorView{}; expect_arg_error(run(in), "w1", "None");
  const Tensor x_wrong_h = Tensor::zeros(DType::bf16, {4, 32});
  in = c.inputs(); in.hidden = x_wrong_h; expect_arg_error(run(in), "hidden", "H=64");
  const Tensor x_int = Tensor::zeros(DType::int32, {4, 64});
  in = c.inputs(); in.hidden = x_int; expect_arg_error(run(in), "hidden", "int32");
  TensorView x_cuda = c.x.view();
  x_cuda.device = Device::cuda(0);
  in = c.inputs(); in.hidden = x_cuda; expect_arg_error(run(in), "hidden", "CPU");
  TensorView x_strided = c.x.view();
  x_strided.shape = Shape{2, 64};
  x_strided.strides = Shape{128, 1};  // every other row
  in = c.inputs(); in.hidden = x_strided; expect_arg_error(run(in), "hidden", "contiguous");
  const Tensor idx_f = Tensor::zeros(DType::fp32, {4, 2});
  in = c.inputs(); in.topk_idx = idx_f; expect_arg_error(run(in), "topk_idx", "int64 or int32");
  const Tensor idx_rows = Tensor::zeros(DType::int64, {5, 2});
  in = c.inputs(); in.topk_idx = idx_rows; expect_arg_error(run(in), "topk_idx", "M=4");
  const Tensor wts_shape = Tensor::zeros(DType::fp32, {4, 3});
  in = c.inputs(); in.topk_weights = wts_shape; expect_arg_error(run(in), "topk_weights", "[4, 3]");
  const Tensor wts_bf16 = Tensor::zeros(DType::bf16, {4, 2});
  in = c.inputs(); in.topk_weights = wts_bf16; expect_arg_error(run(in), "topk_weights", "float32");
  in = c.inputs(); in.topk_weights = TensorView{}; expect_arg_error(run(in), "topk_weights", "None");

  // Ids out of range: local ids must be < E_local, and >= -1.
  Tensor idx_bad = Tensor::empty(DType::int64, {4, 2});
  for (int i = 0; i < 8; ++i) idx_bad.ptr<std::int64_t>()[i] = 0;
  idx_bad.ptr<std::int64_t>()[5] = 4;
  in = c.inputs(); in.topk_idx = idx_bad; expect_arg_error(run(in), "topk_idx", "4 at [2, 1]");
  idx_bad.ptr<std::int64_t>()[5] = -2;
  in = c.inputs(); in.topk_idx = idx_bad; expect_arg_error(run(in), "topk_idx", "-2");

  // With an expert map: ids are global, < E; the map's entries < E_local; E must agree.
  Tensor map = Tensor::empty(DType::int32, {8});
  for (int g = 0; g < 8; ++g) map.ptr<std::int32_t>()[g] = g < 4 ? g : -1;
  idx_bad.ptr<std::int64_t>()[5] = 7;
  in = c.inputs(); in.topk_idx = idx_bad; in.expert_map = map;
  EXPECT_NO_THROW(experts->output_shape(in));  // 7 < E = 8 is fine, and maps to -1
  idx_bad.ptr<std::int64_t>()[5] = 8;
  in = c.inputs(); in.topk_idx = idx_bad; in.expert_map = map; expect_arg_error(run(in), "topk_idx", "[-1, 8)");
  in = c.inputs(); in.expert_map = map; in.global_num_experts = 16; expect_arg_error(run(in), "global_num_experts");
  map.ptr<std::int32_t>()[6] = 4;
  in = c.inputs(); in.expert_map = map; expect_arg_error(run(in), "expert_map", "4 at 6");
  const Tensor map64 = Tensor::zeros(DType::int64, {8});
  in = c.inputs(); in.expert_map = map64; expect_arg_error(run(in), "expert_map", "int32");

  in = c.inputs(); in.apply_router_weight_on_input = true;
  expect_arg_error(run(in), "apply_router_weight_on_input", "K = 2");
  in = c.inputs(); in.activation = static_cast<Activation>(42); expect_arg_error(run(in), "activation");

  // The output of apply.
  const Tensor out_shape = Tensor::zeros(DType::bf16, {4, 32});
  expect_arg_error([&] { experts->apply(c.inputs(), out_shape); }, "out", "[4, 64]");
  const Tensor out_f32 = Tensor::zeros(DType::fp32, {4, 64});
  expect_arg_error([&] { experts->apply(c.inputs(), out_f32); }, "out", "float32");
  const Tensor out_unreduced = Tensor::zeros(DType::bf16, {4, 2, 64});
  expect_arg_error([&] { experts->apply(c.inputs(), out_unreduced); }, "out");  // reduce -> [M, H]
  EXPECT_NO_THROW(make({ActivationFormat::standard, false})->apply(c.inputs(), out_unreduced));
}

TEST_P(ExpertsEdge, BatchedArgumentErrorsNameTheArgument) {
  std::mt19937_64 rng(fresh_seed());
  const BatchedCase b = make_batched(rng, Activation::silu, {2, 0, 3}, 4, 64, 32);
  const auto experts = make({ActivationFormat::batched_experts});
  auto run = [&](const ExpertsInputs& in) { return [&experts, in] { experts->output_shape(in); }; };
  ExpertsInputs in;
  EXPECT_EQ(experts->output_shape(b.inputs()), (Shape{3, 4, 64}));

  in = b.inputs(); in.expert_num_tokens = TensorView{}; expect_arg_error(run(in), "expert_num_tokens", "None");
  Tensor counts = Tensor::empty(DType::int32, {3});
  counts.ptr<std::int32_t>()[0] = 1;
  counts.ptr<std::int32_t>()[1] = 5;  // > max_tokens
  counts.ptr<std::int32_t>()[2] = 0;
  in = b.inputs(); in.expert_num_tokens = counts; expect_arg_error(run(in), "expert_num_tokens", "5 at expert 1");
  counts.ptr<std::int32_t>()[1] = -1;
  in = b.inputs(); in.expert_num_tokens = counts; expect_arg_error(run(in), "expert_num_tokens", "-1");
  const Tensor counts2 = Tensor::zeros(DType::int32, {2});
  in = b.inputs(); in.expert_num_tokens = counts2; expect_arg_error(run(in), "expert_num_tokens", "[3]");
  const Tensor counts64 = Tensor::zeros(DType::int64, {3});
  in = b.inputs(); in.expert_num_tokens = counts64; expect_arg_error(run(in), "expert_num_tokens", "int32");
  const Tensor x2d = Tensor::zeros(DType::bf16, {12, 64});
  in = b.inputs(); in.hidden = x2d; expect_arg_error(run(in), "hidden", "max_tokens");
  const Tensor x_e = Tensor::zeros(DType::bf16, {2, 4, 64});
  in = b.inputs(); in.hidden = x_e; expect_arg_error(run(in), "hidden", "E_local=3");
  const Tensor map = Tensor::zeros(DType::int32, {3});
  in = b.inputs(); in.expert_map = map; expect_arg_error(run(in), "expert_map", "batched");
  in = b.inputs(); in.apply_router_weight_on_input = true; expect_arg_error(run(in), "apply_router_weight_on_input");
  const Tensor out = Tensor::zeros(DType::bf16, {3, 5, 64});
  expect_arg_error([&] { experts->apply(b.inputs(), out); }, "out", "[3, 4, 64]");
}

INSTANTIATE_TEST_SUITE_P(Impl, ExpertsEdge, ::testing::Values(&make_reference_experts, &make_blas_experts),
                         [](const auto& info) { return info.param == &make_reference_experts ? "reference" : "blas"; });

}  // namespace
}  // namespace epmoe
