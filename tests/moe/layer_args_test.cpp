// MoELayer::forward's argument checks (every argument before any communication, the message naming the
// right one) and the layer's state after a failed call, on CPU thread ranks.
#include <epmoe/moe.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

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

}  // namespace
}  // namespace epmoe
