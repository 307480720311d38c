// The MoE layer's normal mode on GPU ranks (semantics §4, 6, 8, 13): make_normal_prepare_finalize over a cuda_ipc Buffer
// with the CUDA experts in the standard format, R = gputest::thread_ranks() thread ranks (rank r on cuda:r; R = 1
// sends to itself), each rank on a stream of its own (the layer must run on the current stream), against
//   - the independent float64 layer reference (tests/support/moe_reference) of the values the experts saw (the fp8
//     round trip of the tokens with an fp8 wire): relative L2 <= 1e-2 (semantics §13), and
//   - the same layer on CPU ranks (threads backend, BLAS experts) on the same inputs: relative L2 <= 1e-2 (the two
//     differ only in the experts' GEMMs: cuBLAS vs OpenBLAS accumulation order);
// and the prepare stage bit for bit against the CPU ranks' (the received rows after the fp8 round trip, their local
// ids and weights, the per-expert counts), then the finalize (the CUDA weight-and-reduce and the combine) of the same
// made-up expert output bit for bit too. Fresh random inputs per case (seed logged), outputs poisoned (0xff) first.
// Covered: bf16 and fp8 (float32 and UE8M0 scales) wires, K = 1 and 8, H = 2048 and 7168, experts reducing
// (WeightAndReduce::none) or not (contiguous: the GPU weight-and-reduce), chunked experts, two forwards through one
// layer (an output given, then allocated by the layer), a rank with zero tokens (R > 1), -1 ids, K = 1 with the
// router weight on the input and int32 ids; bad arguments (CPU tensors among CUDA ones, a CPU hidden for the CUDA
// experts) named before any communication, the layer usable afterwards.
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/stream.hpp>

#include <memory>
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

using gputest::borrow;
using gputest::cuda_ok;
using gputest::to_cpu;
using gputest::to_gpu;

int num_ranks() { return gputest::thread_ranks(); }

void log_error(const std::string& what, double err) { gputest::log_relative_l2(what, err, 80); }

// A blocking stream of the rank made current for the scope (blocking: gpu_util's cudaMemcpy / cudaMemset on the
// legacy stream stay ordered with it).
struct RankStream {
  cudaStream_t s = nullptr;
  std::unique_ptr<StreamGuard> guard;
  RankStream() {
    cuda_ok(cudaStreamCreate(&s), "cudaStreamCreate");
    guard = std::make_unique<StreamGuard>(Stream{s});
  }
  ~RankStream() {
    guard.reset();
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
};

// T = {24, 9} per rank (repeated over the ranks), H = 2048, N = 128, K = 8, two forwards (gputest::LayerCase).
struct Case : gputest::LayerCase {
  bool reduce = true;          // the experts' output: [M, H] reduced, or [M, K, H] (GPU weight-and-reduce)
  std::int64_t chunk_size = 0;
  int experts(int R) const { return R * ((8 + R - 1) / R); }  // at least K = 8, a multiple of R (small weights)
  std::string name() const {
    std::string t = "T=[";
    for (std::size_t i = 0; i < T.size(); ++i) t += (i ? "," : "") + std::to_string(T[i]);
    return t + "] H=" + std::to_string(H) + " K=" + std::to_string(K) +
           (fp8 ? (ue8m0 ? " fp8/ue8m0" : " fp8/f32") : " bf16") + (reduce ? " reduced" : " contiguous") +
           (chunk_size ? " chunk=" + std::to_string(chunk_size) : "") + (weight_on_input ? " weight-on-input" : "") +
           (int32_idx ? " int32 ids" : "");
  }
};

BufferOptions buffer_options(const Case& c, int R, int r, bool gpu) {
  BufferOptions bo;
  if (!gpu) {
    bo.backend = Backend::threads;
    return bo;
  }
  bo.backend = Backend::cuda_ipc;
  bo.device = r;
  std::int64_t t_max = 1;
  for (const std::int64_t t : c.T) t_max = std::max(t_max, t);
  bo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(t_max, c.H, R, c.K);
  return bo;
}

// Runs the case's forwards on R thread ranks: GPU ranks (cuda_ipc, CUDA experts, each on its own stream) or CPU
// ranks (threads, BLAS experts).
gputest::Outs run_layer(const Case& c, const gputest::ExpertWeights& m, const gputest::Ins& in, int R, bool gpu) {
  gputest::Outs outs(static_cast<std::size_t>(R));
  const int El = c.experts(R) / R;
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    const auto ru = static_cast<std::size_t>(r);
    if (gpu) cuda_ok(cudaSetDevice(r), "cudaSetDevice");
    std::unique_ptr<RankStream> stream;
    if (gpu) stream = std::make_unique<RankStream>();
    auto buffer = std::make_shared<Buffer>(borrow(g), buffer_options(c, R, r, gpu));
    ExpertsConfig ec;
    ec.format = ActivationFormat::standard;
    ec.reduce = c.reduce;
    std::shared_ptr<Experts> experts(gpu ? make_cuda_experts(ec) : make_blas_experts(ec));
    MoELayerOptions lo;
    lo.chunk_size = c.chunk_size;
    MoELayer layer(make_normal_prepare_finalize(buffer, c.options()), experts, {}, lo);
    const gputest::ExpertWeights w = gputest::rank_weights(m, r, El, gpu);
    for (int f = 0; f < c.forwards; ++f) {
      // forward 0 writes into a given (poisoned) output; forward 1 lets the layer allocate
      outs[ru].push_back(gputest::forward_checked(layer, c, c.name(), in[ru][static_cast<std::size_t>(f)], w,
                                                  c.experts(R), r, gpu, /*give_output=*/f == 0));
      EXPECT_EQ(layer.prepare_finalize().stage(), Stage::initial);
    }
    if (gpu) cuda_ok(cudaDeviceSynchronize(), "sync");
  });
  return outs;
}

void check_case(const Case& c, std::uint64_t seed) {
  const auto run = [&](const gputest::ExpertWeights& m, const gputest::Ins& in, int R, bool gpu) {
    return run_layer(c, m, in, R, gpu);
  };
  gputest::check_layer_case(c, c.name(), seed, [&](int R) { return c.experts(R); }, run, 80);
}

TEST(GpuMoELayerNormal, Bf16AndFp8WithKOneAndEightMatchFloat64AndTheCpuRanks) {
  const std::uint64_t seed = test::fresh_seed();
  std::uint64_t i = 0;
  for (const std::int64_t H : {std::int64_t{2048}, std::int64_t{7168}})
    for (const int K : {1, 8})
      for (int wire = 0; wire < 3; ++wire) {
        if (H == 7168 && gputest::quick()) continue;  // EPMOE_GPU_TEST_QUICK (sanitizer runs): the small size only
        Case c;
        c.H = H;
        c.K = K;
        c.fp8 = wire > 0;
        c.ue8m0 = wire == 2;
        c.reduce = (i % 2) == 0;  // both finalize paths at every size
        check_case(c, seed + i++);
      }
}

TEST(GpuMoELayerNormal, ZeroTokensOnARankAndChunkedExperts) {
  const std::uint64_t seed = test::fresh_seed();
  Case c;
  c.T = {40, 0};  // rank 1 (when there are 2 or more) sends nothing but still receives
  c.chunk_size = 16;
  for (int wire = 0; wire < 2; ++wire) {
    c.fp8 = wire == 1;
    c.reduce = wire == 0;
    check_case(c, seed + static_cast<std::uint64_t>(wire));
  }
}

TEST(GpuMoELayerNormal, KEqualsOneWithTheWeightOnTheInputAndInt32Ids) {
  const std::uint64_t seed = test::fresh_seed();
  Case c;
  c.set_k_one_weight_on_input_int32_ids();
  check_case(c, seed);
  c.fp8 = true;
  c.reduce = false;
  check_case(c, seed + 1);
}

// The prepare stage alone, bit for bit against the CPU ranks': the rows the experts read (after the fp8 round trip
// on the GPU), their local ids and weights, the per-expert counts. Then the finalize of one made-up expert output
// (the same bits on both: drawn from a per-rank seed once the row count is known), unreduced [M, K, H] through the
// weight-and-reduce (CUDA on the GPU ranks) and reduced [M, H], and the combined [T, H] bit for bit too.
TEST(GpuMoELayerNormal, PreparedRowsAndTheFinalizeEqualTheCpuRanksBitForBit) {
  const int R = num_ranks();
  if (R < 1) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  std::uint64_t i = 0;
  for (const int K : {1, 8})
    for (int wire = 0; wire < 3; ++wire)
      for (const bool reduce : {false, true}) {
        Case c;
        c.T = {37, 0, 5};
        c.H = 2048;
        c.K = K;
        c.fp8 = wire > 0;
        c.ue8m0 = wire == 2;
        c.reduce = reduce;
        c.forwards = 1;
        const std::uint64_t case_seed = seed + i++;
        std::mt19937_64 rng(case_seed);
        const gputest::Ins in = gputest::make_inputs(rng, c, R, c.experts(R));
        // [gpu][rank]: hidden, topk_idx, topk_weights, expert_num_tokens, combined
        std::vector<std::vector<std::vector<Tensor>>> got(2, std::vector<std::vector<Tensor>>(static_cast<std::size_t>(R)));
        for (int gpu = 0; gpu < 2; ++gpu)
          run_thread_ranks(R, [&](Group& g) {
            const int r = g.rank();
            if (gpu) cuda_ok(cudaSetDevice(r), "cudaSetDevice");
            std::unique_ptr<RankStream> stream;
            if (gpu) stream = std::make_unique<RankStream>();
            auto buffer = std::make_shared<Buffer>(borrow(g), buffer_options(c, R, r, gpu == 1));
            auto pf = make_normal_prepare_finalize(buffer, c.options());
            auto put = [&](const Tensor& t) { return gpu ? to_gpu(t.view(), r) : t; };
            const gputest::CallIn d = gputest::put_call(in[static_cast<std::size_t>(r)][0], r, gpu == 1);
            pf->dispatch_a(gputest::prepare_inputs(d.x, d.idx, d.w, c.experts(R)));
            const PrepareOutput p = pf->dispatch_b();
            EXPECT_EQ(p.format, ActivationFormat::standard);
            EXPECT_EQ(p.hidden.device().is_cuda(), gpu == 1);
            EXPECT_EQ(p.hidden.dtype(), DType::bf16);
            auto& mine = got[static_cast<std::size_t>(gpu)][static_cast<std::size_t>(r)];
            mine.push_back(to_cpu(p.hidden));
            mine.push_back(to_cpu(p.topk_idx));
            mine.push_back(to_cpu(p.topk_weights));
            mine.push_back(to_cpu(p.expert_num_tokens));
            const std::int64_t M = p.hidden.size(0);
            std::mt19937_64 out_rng(case_seed * 1000 + static_cast<std::uint64_t>(r));
            const Tensor fused_h = reduce ? test::random_bf16(out_rng, M, c.H, 1.0f)
                                          : test::random_bf16(out_rng, M * c.K, c.H, 1.0f);
            const Tensor fused_flat = put(fused_h);
            const TensorView fused = reduce ? fused_flat.view()
                                            : TensorView(fused_flat.data(), DType::bf16, {M, c.K, c.H},
                                                         fused_flat.device());
            pf->combine_a(fused, reduce ? WeightAndReduce::none : WeightAndReduce::delegate);
            mine.push_back(to_cpu(pf->combine_b()));
            EXPECT_EQ(pf->stage(), Stage::initial);
            if (gpu) cuda_ok(cudaDeviceSynchronize(), "sync");
          });
        const char* names[] = {"hidden", "topk_idx", "topk_weights", "expert_num_tokens", "combined"};
        for (int r = 0; r < R; ++r) {
          const auto ru = static_cast<std::size_t>(r);
          for (std::size_t j = 0; j < 5; ++j)
            EXPECT_TRUE(gputest::same_bits(got[0][ru][j], got[1][ru][j]))
                << c.name() << " R=" << R << " rank " << r << " " << names[j] << " (seed " << case_seed << ")";
          EXPECT_GT(got[0][ru][0].size(0), 0) << c.name() << " rank " << r << ": no rows received";
        }
      }
}

TEST(GpuMoELayerNormal, BadArgumentsNameTheArgumentBeforeAnyCommunication) {
  if (num_ranks() < 1) GTEST_SKIP() << "no GPU";
  // One rank (R = 1): a refused call never reaches the buffer, so a good call afterwards still works.
  const std::uint64_t seed = test::fresh_seed();
  Case c;
  c.T = {8};
  c.K = 4;
  c.forwards = 1;
  std::mt19937_64 rng(seed);
  const gputest::ExpertWeights m = gputest::make_expert_weights(rng, c.experts(1), c.H, c.N);
  const gputest::Ins in = gputest::make_inputs(rng, c, 1, c.experts(1));
  run_thread_ranks(1, [&](Group& g) {
    cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    auto buffer = std::make_shared<Buffer>(borrow(g), buffer_options(c, 1, 0, true));
    MoELayer layer(make_normal_prepare_finalize(buffer, c.options()), make_cuda_experts(), {}, {});
    const gputest::CallIn& ci = in[0][0];
    const gputest::CallIn d = gputest::put_call(ci, 0, true);
    const gputest::ExpertWeights dw = gputest::rank_weights(m, 0, c.experts(1), true);  // the one rank's: all experts
    auto args = [&] { return gputest::forward_args(d.x, dw.w1, dw.w2, d.idx, d.w, c.experts(1)); };
    auto expect_error = [&](MoEForwardArgs a, const char* name, const char* expected, const char* actual) {
      try {
        layer.forward(a);
        ADD_FAILURE() << "no error for a bad '" << name << "'";
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << msg;
        EXPECT_NE(msg.find(std::string("'") + name + "'"), std::string::npos) << msg;
        EXPECT_NE(msg.find(expected), std::string::npos) << "'" << expected << "' not in: " << msg;
        EXPECT_NE(msg.find(actual), std::string::npos) << "'" << actual << "' not in: " << msg;
      }
      EXPECT_EQ(layer.prepare_finalize().stage(), Stage::initial);
    };
    MoEForwardArgs a = args();
    a.topk_weights = ci.w;  // on the CPU
    expect_error(a, "topk_weights", "cuda:0", "cpu");
    a = args();
    a.topk_idx = ci.idx;  // on the CPU
    expect_error(a, "topk_idx", "cuda:0", "cpu");
    a = args();
    a.hidden = ci.x;  // on the CPU, with the CUDA experts
    expect_error(a, "hidden", "CUDA", "cpu");
    a = args();
    const Tensor out_cpu = Tensor::empty(DType::bf16, {ci.x.size(0), c.H});
    a.output = out_cpu;
    expect_error(a, "output", "cuda:0", "cpu");
    a = args();
    a.apply_router_weight_on_input = true;  // K = 4
    expect_error(a, "apply_router_weight_on_input", "K == 1", "K = 4");
    // Still usable: a good forward matches float64.
    gputest::expect_forward_matches_float64(layer, args(), ci, m, seed, "normal layer after the refused calls", 80);
  });
}

}  // namespace
}  // namespace epmoe
