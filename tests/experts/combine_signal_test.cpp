// The combine signal of the batched experts (ExpertsInputs::combine_signal; docs/semantics.md "Overlapped low-latency
// combine"): the reference experts add ceil(H / block_n) to each block holding rows (one per N-tile), 1 to every
// expert with the uint32 form, nothing elsewhere; the output is the one without a signal, bit for bit; bad signal
// arguments are refused by name; experts that do not write signals refuse one.
#include <gtest/gtest.h>

#include "experts/experts_test_util.hpp"

#include <cstring>
#include <functional>

namespace epmoe {
namespace {

using namespace epmoe::test;

void expect_arg_error(const std::function<void()>& f, const std::string& argument) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
  }
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

TEST(ExpertsCombineSignal, ReferenceAddsOnePerNTileOfEachBlockWithRows) {
  std::mt19937_64 rng(fresh_seed());
  const std::int64_t max_tokens = 12, H = 96, N = 32;
  const std::vector<std::int32_t> counts = {5, 0, 12, 1};
  const BatchedCase b = make_batched(rng, Activation::silu, counts, max_tokens, H, N);
  const auto experts = make_reference_experts({ActivationFormat::batched_experts});
  const Tensor plain = experts->apply(b.inputs());
  for (const auto& [block_m, block_n] : {std::pair{4, 32}, std::pair{5, 40}, std::pair{12, 96}, std::pair{1, 200}}) {
    SCOPED_TRACE("block_m " + std::to_string(block_m) + " block_n " + std::to_string(block_n));
    const std::int64_t blocks = ceil_div(max_tokens, block_m);
    const Tensor signal = Tensor::zeros(DType::int32, {4 * blocks + 2});
    signal.ptr<std::int32_t>()[4 * blocks + 1] = 7;  // an extra entry is not touched
    ExpertsInputs in = b.inputs();
    in.combine_signal = {signal, block_m, block_n};
    const Tensor out = Tensor::zeros(DType::bf16, {4, max_tokens, H});
    experts->apply(in, out.view());
    ASSERT_EQ(std::memcmp(out.data(), plain.data(), plain.nbytes()), 0) << "output differs with a signal";
    for (std::int64_t e = 0; e < 4; ++e)
      for (std::int64_t blk = 0; blk < blocks; ++blk) {
        const bool rows = blk * block_m < counts[static_cast<std::size_t>(e)];
        EXPECT_EQ(signal.ptr<std::int32_t>()[e * blocks + blk], rows ? ceil_div(H, block_n) : 0)
            << "expert " << e << " block " << blk;
      }
    EXPECT_EQ(signal.ptr<std::int32_t>()[4 * blocks], 0);
    EXPECT_EQ(signal.ptr<std::int32_t>()[4 * blocks + 1], 7);
  }
}

TEST(ExpertsCombineSignal, ReferenceAddsOneToEveryExpertWithTheUint32Form) {
  std::mt19937_64 rng(fresh_seed());
  const auto experts = make_reference_experts({ActivationFormat::batched_experts});
  for (const std::vector<std::int32_t>& counts : {std::vector<std::int32_t>{3, 0, 8}, {0, 0, 0}}) {
    const BatchedCase b = make_batched(rng, Activation::gelu, counts, 8, 64, 32);
    const Tensor plain = experts->apply(b.inputs());
    Tensor signal = Tensor::zeros(DType::uint32, {3});
    signal.ptr<std::uint32_t>()[1] = 5;  // adds, never stores: the caller resets it
    ExpertsInputs in = b.inputs();
    in.combine_signal.signal = signal;
    const Tensor out = Tensor::zeros(DType::bf16, {3, 8, 64});
    experts->apply(in, out.view());
    ASSERT_EQ(std::memcmp(out.data(), plain.data(), plain.nbytes()), 0);
    EXPECT_EQ(signal.ptr<std::uint32_t>()[0], 1u);
    EXPECT_EQ(signal.ptr<std::uint32_t>()[1], 6u);
    EXPECT_EQ(signal.ptr<std::uint32_t>()[2], 1u);
  }
}

TEST(ExpertsCombineSignal, BadSignalArgumentsAreNamed) {
  std::mt19937_64 rng(fresh_seed());
  const BatchedCase b = make_batched(rng, Activation::silu, {2, 3}, 8, 64, 32);
  const auto experts = make_reference_experts({ActivationFormat::batched_experts});
  const auto run = [&](const ExpertsInputs& in) { return [&experts, in] { (void)experts->apply(in); }; };
  const Tensor ok = Tensor::zeros(DType::int32, {4}), i64 = Tensor::zeros(DType::int64, {4});
  const Tensor short_sig = Tensor::zeros(DType::int32, {3}), u32_3 = Tensor::zeros(DType::uint32, {3});
  const Tensor u32 = Tensor::zeros(DType::uint32, {2});
  ExpertsInputs in = b.inputs();
  in.combine_signal = {ok, 0, 32};
  expect_arg_error(run(in), "block_m");
  in.combine_signal = {ok, 4, 0};
  expect_arg_error(run(in), "block_n");
  in.combine_signal = {i64, 4, 32};
  expect_arg_error(run(in), "combine_signal");
  in.combine_signal = {short_sig, 4, 32};  // 2 experts x ceil(8 / 4) blocks = 4 entries
  expect_arg_error(run(in), "combine_signal");
  in.combine_signal = {u32_3, 0, 0};
  expect_arg_error(run(in), "combine_signal");
  in.combine_signal = {u32, 4, 32};
  expect_arg_error(run(in), "block_m");
  in.combine_signal = {TensorView{}, 4, 32};
  expect_arg_error(run(in), "block_m");
  TensorView on_gpu = ok.view();
  on_gpu.device = Device::cuda(0);
  in.combine_signal = {on_gpu, 4, 32};
  expect_arg_error(run(in), "combine_signal");

  StandardOptions o;
  const StandardCase s = make_standard(rng, Activation::silu, o);
  ExpertsInputs st = s.inputs();
  st.combine_signal = {ok, 4, 32};
  const auto standard = make_reference_experts({ActivationFormat::standard});
  expect_arg_error([&] { (void)standard->apply(st); }, "combine_signal");
}

TEST(ExpertsCombineSignal, ExpertsThatDoNotWriteSignalsRefuseOne) {
  std::mt19937_64 rng(fresh_seed());
  const BatchedCase b = make_batched(rng, Activation::silu, {2, 3}, 8, 64, 32);
  const auto blas = make_blas_experts({ActivationFormat::batched_experts});
  const Tensor sig = Tensor::zeros(DType::uint32, {2});
  ExpertsInputs in = b.inputs();
  in.combine_signal.signal = sig;
  try {
    (void)blas->apply(in);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("combine_signal"), std::string::npos) << e.what();
  }
  EXPECT_EQ(sig.ptr<std::uint32_t>()[0], 0u);
}

}  // namespace
}  // namespace epmoe
