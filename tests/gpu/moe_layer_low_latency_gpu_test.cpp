// The MoE layer's low-latency path on GPU ranks (semantics §5, 8, 13): make_low_latency_prepare_finalize over a
// cuda_ipc Buffer (its GPU low-latency mode) with the CUDA experts in the batched_experts format, R = min(2,
// visible GPUs) thread ranks (rank r on cuda:r; R = 1 sends to itself), against
//   - the independent float64 layer reference (tests/support/moe_reference) of the values the experts saw (the
//     fp8 round trip of the tokens with an fp8 wire): relative L2 <= 1e-2 (semantics §13), and
//   - the same layer on CPU ranks (threads backend, BLAS experts) on the same inputs: relative L2 <= 1e-2. Both
//     paths carry the same wire bits (the transports are bit-identical, the CUDA and CPU fp8 quantizers too) and
//     sum over k the same way; they differ only in the experts' GEMMs (cuBLAS vs OpenBLAS accumulation order, each
//     rounding the [rows, 2N] and [rows, N] intermediates to bf16: ~2^-9 relative per element), so the two
//     outputs sit within a few 1e-3 of each other, well inside 1e-2.
// Fresh random inputs per call (seed logged), outputs poisoned (0xff) first. Covered: bf16, fp8 (float32 and
// UE8M0 scales) and nvfp4 wires, H in {2048, 2880, 7168}, three forwards through one layer (both halves of the buffer, the
// third reusing the first's), an output given or allocated by the layer, ranks with different T (one with T = 0),
// -1 ids, K = 1 with the router weight on the input and int32 ids; the prepare stage on its own (counts bit for bit
// against the CPU ranks', the valid rows of the slabs the experts read bit for bit against the CPU's dequantized
// rows); bad arguments named before any communication.
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/gpu_util.hpp"
#include "gpu/moe_layer_test_util.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

constexpr double kTolerance = gputest::kLayerTolerance;  // semantics §13

using gputest::gpu_count;
using gputest::borrow;
using gputest::cuda_ok;
using gputest::to_cpu;
// One rank per GPU: ranks as threads on one GPU starve each other's spinning kernels.
/// Thread ranks, rank r on cuda:r: every visible GPU up to 8 (EPMOE_TEST_RANKS caps it); a case's per-rank token
/// counts repeat over the ranks (tokens_of).
int num_ranks() { return gputest::thread_ranks(); }

void log_error(const std::string& what, double err) { gputest::log_relative_l2(what, err, 70); }

// T = {24, 9} per rank (repeated over the ranks: LayerCase::tokens_of), H = 2048, N = 128 (gputest::LayerCase);
// K = 4 and three forwards here.
struct Case : gputest::LayerCase {
  int E = 16, tmax = 32;
  Case() {
    K = 4;
    forwards = 3;
  }
  std::string name() const {
    return "T=[" + std::to_string(T[0]) + "," + std::to_string(T[1]) + "] H=" + std::to_string(H) +
           " K=" + std::to_string(K) + " E=" + std::to_string(E) + (nvfp4 ? " nvfp4" : fp8 ? (ue8m0 ? " fp8/ue8m0" : " fp8/f32") : " bf16") +
           (weight_on_input ? " weight-on-input" : "") + (int32_idx ? " int32 ids" : "");
  }
};

// Runs the case's forwards on R thread ranks: GPU ranks (cuda_ipc, CUDA experts) or CPU ranks (threads, BLAS).
gputest::Outs run_layer(const Case& c, const gputest::ExpertWeights& m, const gputest::Ins& in, int R, bool gpu) {
  gputest::Outs outs(static_cast<std::size_t>(R));
  const int El = c.E / R;
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    const auto ru = static_cast<std::size_t>(r);
    BufferOptions bo;
    if (gpu) {
      cuda_ok(cudaSetDevice(r), "cudaSetDevice");
      bo.backend = Backend::cuda_ipc;
      bo.device = r;
      bo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(1, c.H, R, 1);  // normal mode unused here
    } else {
      bo.backend = Backend::threads;
    }
    auto buffer = std::make_shared<Buffer>(borrow(g), bo);
    ExpertsConfig ec;
    ec.format = ActivationFormat::batched_experts;
    std::shared_ptr<Experts> experts(gpu ? make_cuda_experts(ec) : make_blas_experts(ec));
    MoELayer layer(make_low_latency_prepare_finalize(buffer, c.tmax, c.options()), experts, {}, {});
    const gputest::ExpertWeights w = gputest::rank_weights(m, r, El, gpu);
    for (int f = 0; f < c.forwards; ++f)  // forward 1: the layer allocates the output
      outs[ru].push_back(gputest::forward_checked(layer, c, c.name(), in[ru][static_cast<std::size_t>(f)], w, c.E, r,
                                                  gpu, /*give_output=*/f != 1));
    if (gpu) cuda_ok(cudaDeviceSynchronize(), "sync");
  });
  return outs;
}

void check_case(const Case& c, std::uint64_t seed) {
  const auto run = [&](const gputest::ExpertWeights& m, const gputest::Ins& in, int R, bool gpu) {
    return run_layer(c, m, in, R, gpu);
  };
  gputest::check_layer_case(c, c.name(), seed, [&](int) { return c.E; }, run, 70);
}

TEST(GpuMoELayerLowLatency, Bf16AndFp8MatchFloat64AndTheCpuRanksAtEveryHiddenSize) {
  const std::uint64_t seed = test::fresh_seed();
  std::uint64_t i = 0;
  for (std::int64_t H : gputest::hidden_sizes())  // 7168 left out with EPMOE_GPU_TEST_QUICK (sanitizer runs)
    for (int wire = 0; wire < 3; ++wire) {
      Case c;
      c.H = H;
      c.fp8 = wire > 0;
      c.ue8m0 = wire == 2;
      check_case(c, seed + i++);
    }
}

// The nvfp4 wire: quantized by the CUDA quantizer, dequantized on the device in dispatch_b (the CPU's bits).
TEST(GpuMoELayerLowLatency, Nvfp4MatchesFloat64AndTheCpuRanks) {
  const std::uint64_t seed = test::fresh_seed();
  std::uint64_t i = 0;
  for (std::int64_t H : gputest::hidden_sizes()) {
    Case c;
    c.H = H;
    c.nvfp4 = true;
    check_case(c, seed + i++);
  }
  Case c;
  c.T = {32, 0};
  c.nvfp4 = true;
  c.nvfp4_global_scale = 3.0f;
  check_case(c, seed + i);
}

TEST(GpuMoELayerLowLatency, ZeroTokensOnARankAndTEqualsTmax) {
  const std::uint64_t seed = test::fresh_seed();
  Case c;
  c.T = {32, 0};  // rank 0 at Tmax, rank 1 (when there are 2) sends nothing
  c.p_minus_one = 0.0;
  check_case(c, seed);
  c.fp8 = true;
  check_case(c, seed + 1);
}

TEST(GpuMoELayerLowLatency, KEqualsOneWithTheWeightOnTheInputAndInt32Ids) {
  const std::uint64_t seed = test::fresh_seed();
  Case c;
  c.set_k_one_weight_on_input_int32_ids();
  check_case(c, seed);
  c.fp8 = true;
  check_case(c, seed + 1);
}

// The prepare stage alone: the counts and the valid rows of the slabs the experts read, bit for bit against the
// CPU ranks' (the transports are bit-identical, and the CUDA fp8 dequantization gives the CPU's bits).
TEST(GpuMoELayerLowLatency, PreparedSlabsAndCountsEqualTheCpuRanksBitForBit) {
  const int R = num_ranks();
  if (R < 1) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  for (int wire = 0; wire < 3; ++wire) {
    Case c;
    c.H = 2880;
    c.fp8 = wire > 0;
    c.ue8m0 = wire == 2;
    c.forwards = 1;
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(wire));
    const gputest::Ins in = gputest::make_inputs(rng, c, R, c.E);
    std::vector<std::vector<Tensor>> counts(2, std::vector<Tensor>(static_cast<std::size_t>(R))),
        slabs(2, std::vector<Tensor>(static_cast<std::size_t>(R)));
    for (int gpu = 0; gpu < 2; ++gpu)
      run_thread_ranks(R, [&](Group& g) {
        const int r = g.rank();
        BufferOptions bo;
        if (gpu) {
          cuda_ok(cudaSetDevice(r), "cudaSetDevice");
          bo.backend = Backend::cuda_ipc;
          bo.device = r;
          bo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(1, c.H, R, 1);
        } else {
          bo.backend = Backend::threads;
        }
        auto buffer = std::make_shared<Buffer>(borrow(g), bo);
        auto pf = make_low_latency_prepare_finalize(buffer, c.tmax, c.options());
        const gputest::CallIn d = gputest::put_call(in[static_cast<std::size_t>(r)][0], r, gpu == 1);
        pf->dispatch_a(gputest::prepare_inputs(d.x, d.idx, d.w, c.E));
        const PrepareOutput p = pf->dispatch_b();
        EXPECT_EQ(p.format, ActivationFormat::batched_experts);
        EXPECT_EQ(p.hidden.device().is_cuda(), gpu == 1);
        EXPECT_EQ(p.hidden.dtype(), DType::bf16);
        counts[static_cast<std::size_t>(gpu)][static_cast<std::size_t>(r)] = to_cpu(p.expert_num_tokens);
        slabs[static_cast<std::size_t>(gpu)][static_cast<std::size_t>(r)] = to_cpu(p.hidden);
        // Finish the call (the combine of the experts' input as their output: any bf16 slab will do).
        pf->combine_a(p.hidden, WeightAndReduce::delegate);
        (void)to_cpu(pf->combine_b());
      });
    for (int r = 0; r < R; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      const Tensor& cg = counts[1][ru];
      const Tensor& cc = counts[0][ru];
      ASSERT_EQ(cg.numel(), cc.numel());
      std::int64_t total = 0;
      for (std::int64_t e = 0; e < cg.numel(); ++e) {
        const std::int32_t n = cc.ptr<std::int32_t>()[e];
        ASSERT_EQ(cg.ptr<std::int32_t>()[e], n) << c.name() << " rank " << r << " expert " << e << " seed " << seed;
        total += n;
        const std::int64_t rows = slabs[0][ru].size(1);
        const std::size_t bytes = static_cast<std::size_t>(n * c.H) * sizeof(bf16_t);
        const auto* a = slabs[1][ru].ptr<bf16_t>() + e * rows * c.H;
        const auto* b = slabs[0][ru].ptr<bf16_t>() + e * rows * c.H;
        EXPECT_EQ(std::memcmp(a, b, bytes), 0) << c.name() << " rank " << r << " expert " << e << " seed " << seed;
      }
      EXPECT_GT(total, 0) << c.name() << " rank " << r;  // the routing reached this rank's experts
    }
  }
}

TEST(GpuMoELayerLowLatency, BadArgumentsNameTheArgumentBeforeAnyCommunication) {
  if (num_ranks() < 1) GTEST_SKIP() << "no GPU";
  // One rank (R = 1): a refused call never reaches the buffer, so a good call afterwards still works.
  const std::uint64_t seed = test::fresh_seed();
  Case c;
  c.T = {8, 0};
  c.forwards = 1;
  std::mt19937_64 rng(seed);
  const gputest::ExpertWeights m = gputest::make_expert_weights(rng, c.E, c.H, c.N);
  const gputest::Ins in = gputest::make_inputs(rng, c, 1, c.E);
  run_thread_ranks(1, [&](Group& g) {
    cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    BufferOptions bo;
    bo.backend = Backend::cuda_ipc;
    bo.device = 0;
    bo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(1, c.H, 1, 1);
    auto buffer = std::make_shared<Buffer>(borrow(g), bo);
    ExpertsConfig ec;
    ec.format = ActivationFormat::batched_experts;
    MoELayer layer(make_low_latency_prepare_finalize(buffer, c.tmax, c.options()), make_cuda_experts(ec), {}, {});
    const gputest::CallIn& ci = in[0][0];
    const gputest::CallIn d = gputest::put_call(ci, 0, true);
    const gputest::ExpertWeights dw = gputest::rank_weights(m, 0, c.E, true);  // the one rank's: all E experts
    auto args = [&] { return gputest::forward_args(d.x, dw.w1, dw.w2, d.idx, d.w, c.E); };
    auto expect_error = [&](MoEForwardArgs a, const char* name) {
      try {
        layer.forward(a);
        ADD_FAILURE() << "no error for a bad '" << name << "'";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
        EXPECT_NE(std::string(e.what()).find(std::string("'") + name + "'"), std::string::npos) << e.what();
      }
    };
    MoEForwardArgs a = args();
    a.topk_weights = ci.w;  // on the CPU
    expect_error(a, "topk_weights");
    a = args();
    a.topk_idx = ci.idx;  // on the CPU
    expect_error(a, "topk_idx");
    a = args();
    const Tensor out_cpu = Tensor::empty(DType::bf16, {ci.x.size(0), c.H});
    a.output = out_cpu;
    expect_error(a, "output");
    a = args();
    a.apply_router_weight_on_input = true;  // K = 4
    expect_error(a, "apply_router_weight_on_input");
    // Still usable: a good forward matches float64.
    gputest::expect_forward_matches_float64(layer, args(), ci, m, seed, "after the refused calls", 70);
  });
}

}  // namespace
}  // namespace epmoe
