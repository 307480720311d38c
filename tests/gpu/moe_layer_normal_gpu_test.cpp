// The MoE layer's normal mode on GPU ranks (SPEC 4, 6, 8, 13): make_normal_prepare_finalize over a cuda_ipc Buffer
// with the CUDA experts in the standard format, R = gputest::thread_ranks() thread ranks (rank r on cuda:r; R = 1
// sends to itself), each rank on a stream of its own (the layer must run on the current stream), against
//   - the independent float64 layer reference (tests/support/moe_reference) of the values the experts saw (the fp8
//     round trip of the tokens with an fp8 wire): relative L2 <= 1e-2 (SPEC 13), and
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
#include <epmoe/quant.hpp>
#include <epmoe/stream.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/gpu_util.hpp"
#include "support/moe_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

constexpr double kTolerance = 1e-2;  // SPEC 13

using gputest::borrow;
using gputest::cuda_ok;
using gputest::to_cpu;
using gputest::to_gpu;

int num_ranks() { return gputest::thread_ranks(); }

double relative_l2(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double g = bf16_to_float(got.ptr<bf16_t>()[i]), w = bf16_to_float(want.ptr<bf16_t>()[i]);
    num += (g - w) * (g - w);
    den += w * w;
  }
  if (std::isnan(num) || std::isnan(den)) return std::nan("");
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
}

void log_error(const std::string& what, double err) { std::printf("[ rel_l2   ] %-80s %.3e\n", what.c_str(), err); }

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

struct Case {
  std::vector<std::int64_t> T = {24, 9};  // per rank, repeated over the ranks
  std::int64_t H = 2048, N = 128;
  int K = 8;
  bool fp8 = false, ue8m0 = false, weight_on_input = false, int32_idx = false;
  bool reduce = true;          // the experts' output: [M, H] reduced, or [M, K, H] (GPU weight-and-reduce)
  std::int64_t chunk_size = 0;
  double p_minus_one = 0.1;
  int forwards = 2;
  int experts(int R) const { return R * ((8 + R - 1) / R); }  // at least K = 8, a multiple of R (small weights)
  std::string name() const {
    std::string t = "T=[";
    for (std::size_t i = 0; i < T.size(); ++i) t += (i ? "," : "") + std::to_string(T[i]);
    return t + "] H=" + std::to_string(H) + " K=" + std::to_string(K) +
           (fp8 ? (ue8m0 ? " fp8/ue8m0" : " fp8/f32") : " bf16") + (reduce ? " reduced" : " contiguous") +
           (chunk_size ? " chunk=" + std::to_string(chunk_size) : "") + (weight_on_input ? " weight-on-input" : "") +
           (int32_idx ? " int32 ids" : "");
  }
  PrepareFinalizeOptions options() const {
    PrepareFinalizeOptions o;
    o.dispatch_dtype = fp8 ? DispatchDtype::fp8 : DispatchDtype::bf16;
    o.round_scale = ue8m0;
    o.use_ue8m0 = ue8m0;
    return o;
  }
};

std::int64_t tokens_of(const Case& c, int r) { return c.T[static_cast<std::size_t>(r) % c.T.size()]; }

struct Model {
  Tensor w1, w2;  // host, all E experts: [E, 2N, H], [E, H, N] (gated silu)
};
Model make_model(std::mt19937_64& rng, const Case& c, int E) {
  Tensor a = test::random_bf16(rng, E * 2 * c.N, c.H, 1.0f / std::sqrt(static_cast<float>(c.H)));
  Tensor b = test::random_bf16(rng, E * c.H, c.N, 1.0f / std::sqrt(static_cast<float>(c.N)));
  return {Tensor::wrap(TensorView(a.data(), DType::bf16, {E, 2 * c.N, c.H}), std::make_shared<Tensor>(a)),
          Tensor::wrap(TensorView(b.data(), DType::bf16, {E, c.H, c.N}), std::make_shared<Tensor>(b))};
}

struct CallIn {
  Tensor x, idx, w;  // host; idx int64
};
using Ins = std::vector<std::vector<CallIn>>;  // [rank][forward]

Ins make_inputs(std::mt19937_64& rng, const Case& c, int R) {
  Ins in(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < c.forwards; ++f) {
      const std::int64_t T = tokens_of(c, r);
      CallIn ci;
      ci.x = test::random_bf16(rng, T, c.H, 2.0f);
      test::RoutingOptions ro;
      ro.p_minus_one = c.p_minus_one;
      ci.idx = test::random_topk_idx(rng, T, c.K, c.experts(R), ro);
      ci.w = test::random_topk_weights(rng, ci.idx);
      in[static_cast<std::size_t>(r)].push_back(std::move(ci));
    }
  return in;
}

Tensor ids_as(const Tensor& idx64, bool int32) {
  if (!int32) return idx64;
  Tensor out = Tensor::empty(DType::int32, idx64.shape());
  for (std::int64_t i = 0; i < idx64.numel(); ++i)
    out.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(idx64.ptr<std::int64_t>()[i]);
  return out;
}

// The values the experts see after the wire (the CPU quantizer is bit-identical to the CUDA one), with the router
// weight on the input applied first as prepare does (x * w rounded to bf16).
Tensor seen_by_experts(const Case& c, const CallIn& ci) {
  Tensor x = ci.x;
  if (c.weight_on_input) {
    x = Tensor::empty(DType::bf16, ci.x.shape());
    for (std::int64_t t = 0; t < x.size(0); ++t)
      for (std::int64_t h = 0; h < c.H; ++h)
        x.ptr<bf16_t>()[t * c.H + h] =
            float_to_bf16(ci.w.ptr<float>()[t] * bf16_to_float(ci.x.ptr<bf16_t>()[t * c.H + h]));
  }
  if (!c.fp8 || x.numel() == 0) return x;
  const Fp8Tensor q = quantize_fp8(x, {c.ue8m0, c.ue8m0});
  return dequantize_fp8(q.data, q.scales, DType::bf16);
}

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

using Outs = std::vector<std::vector<Tensor>>;  // [rank][forward] host bf16 [T, H]

// Runs the case's forwards on R thread ranks: GPU ranks (cuda_ipc, CUDA experts, each on its own stream) or CPU
// ranks (threads, BLAS experts).
Outs run_layer(const Case& c, const Model& m, const Ins& in, int R, bool gpu) {
  Outs outs(static_cast<std::size_t>(R));
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
    auto put = [&](const TensorView& t) { return gpu ? to_gpu(t, r) : Tensor::wrap(t, nullptr); };
    const Tensor w1 = put(m.w1.view().slice_rows(r * El, (r + 1) * El));
    const Tensor w2 = put(m.w2.view().slice_rows(r * El, (r + 1) * El));
    for (int f = 0; f < c.forwards; ++f) {
      const CallIn& ci = in[ru][static_cast<std::size_t>(f)];
      const Tensor ids = ids_as(ci.idx, c.int32_idx);  // alive for the call: the CPU path wraps it
      const Tensor x = put(ci.x), idx = put(ids), w = put(ci.w);
      MoEForwardArgs a;
      a.hidden = x;
      a.w1 = w1;
      a.w2 = w2;
      a.topk_idx = idx;
      a.topk_weights = w;
      a.global_num_experts = c.experts(R);
      a.apply_router_weight_on_input = c.weight_on_input;
      Tensor out;
      if (f == 0) {  // forward 0 writes into a given (poisoned) output; forward 1 lets the layer allocate
        out = gpu ? Tensor::empty(DType::bf16, {ci.x.size(0), c.H}, Device::cuda(r))
                  : Tensor::empty(DType::bf16, {ci.x.size(0), c.H});
        if (gpu) gputest::poison(out);
        else if (out.nbytes()) std::memset(out.data(), 0xff, out.nbytes());
        a.output = out;
      }
      const MoEForwardResult res = layer.forward(a);
      EXPECT_EQ(res.output.shape(), (Shape{ci.x.size(0), c.H})) << c.name() << " rank " << r;
      EXPECT_EQ(res.output.device().is_cuda(), gpu) << c.name() << " rank " << r;
      EXPECT_EQ(layer.prepare_finalize().stage(), Stage::initial);
      if (out.defined()) EXPECT_EQ(res.output.data(), out.data()) << c.name() << ": not written into the output";
      outs[ru].push_back(to_cpu(res.output));
    }
    if (gpu) cuda_ok(cudaDeviceSynchronize(), "sync");
  });
  return outs;
}

void check_case(const Case& c, std::uint64_t seed) {
  const int R = num_ranks();
  if (R < 1) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(seed);
  const Model m = make_model(rng, c, c.experts(R));
  const Ins in = make_inputs(rng, c, R);
  const Outs got = run_layer(c, m, in, R, /*gpu=*/true);
  const Outs cpu = run_layer(c, m, in, R, /*gpu=*/false);
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < c.forwards; ++f) {
      const auto ru = static_cast<std::size_t>(r), fu = static_cast<std::size_t>(f);
      const CallIn& ci = in[ru][fu];
      const std::string what = c.name() + " R=" + std::to_string(R) + " rank " + std::to_string(r) + " forward " +
                               std::to_string(f);
      ASSERT_EQ(got[ru].size(), static_cast<std::size_t>(c.forwards)) << what;
      if (ci.x.size(0) == 0) {
        EXPECT_EQ(got[ru][fu].numel(), 0) << what;
        continue;
      }
      // seen_by_experts has the router weight applied already, so the reference then takes weights of 1.
      Tensor ones;
      if (c.weight_on_input) {
        ones = Tensor::empty(DType::fp32, ci.w.shape());
        for (std::int64_t i = 0; i < ones.numel(); ++i) ones.ptr<float>()[i] = 1.0f;
      }
      const std::vector<double> ref = test::moe_layer_reference(seen_by_experts(c, ci), m.w1, m.w2, ci.idx,
                                                                c.weight_on_input ? ones : ci.w, "silu", false);
      const double err = test::relative_l2(got[ru][fu], ref);
      log_error(what + " vs float64", err);
      EXPECT_LE(err, kTolerance) << what << " (seed " << seed << "): GPU vs float64";  // also fails on NaN / poison
      const double cpu_err = test::relative_l2(cpu[ru][fu], ref);
      EXPECT_LE(cpu_err, kTolerance) << what << " (seed " << seed << "): CPU ranks vs float64";
      const double diff = relative_l2(got[ru][fu], cpu[ru][fu]);
      log_error(what + " vs CPU ranks", diff);
      EXPECT_LE(diff, kTolerance) << what << " (seed " << seed << "): GPU vs CPU ranks";
    }
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
  c.K = 1;
  c.weight_on_input = true;
  c.int32_idx = true;
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
        const Ins in = make_inputs(rng, c, R);
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
            const CallIn& ci = in[static_cast<std::size_t>(r)][0];
            auto put = [&](const Tensor& t) { return gpu ? to_gpu(t.view(), r) : t; };
            const Tensor x = put(ci.x), idx = put(ci.idx), w = put(ci.w);
            PrepareInputs pin;
            pin.hidden = x;
            pin.topk_idx = idx;
            pin.topk_weights = w;
            pin.global_num_experts = c.experts(R);
            pf->dispatch_a(pin);
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
  const Model m = make_model(rng, c, c.experts(1));
  const Ins in = make_inputs(rng, c, 1);
  run_thread_ranks(1, [&](Group& g) {
    cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    auto buffer = std::make_shared<Buffer>(borrow(g), buffer_options(c, 1, 0, true));
    MoELayer layer(make_normal_prepare_finalize(buffer, c.options()), make_cuda_experts(), {}, {});
    const CallIn& ci = in[0][0];
    const Tensor x = to_gpu(ci.x.view(), 0), idx = to_gpu(ci.idx.view(), 0), w = to_gpu(ci.w.view(), 0);
    const Tensor w1 = to_gpu(m.w1.view(), 0), w2 = to_gpu(m.w2.view(), 0);
    auto args = [&] {
      MoEForwardArgs a;
      a.hidden = x;
      a.w1 = w1;
      a.w2 = w2;
      a.topk_idx = idx;
      a.topk_weights = w;
      a.global_num_experts = c.experts(1);
      return a;
    };
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
    const MoEForwardResult r = layer.forward(args());
    const double err = test::relative_l2(to_cpu(r.output), test::moe_layer_reference(ci.x, m.w1, m.w2, ci.idx, ci.w,
                                                                                     "silu"));
    log_error("normal layer after the refused calls", err);
    EXPECT_LE(err, kTolerance) << "seed " << seed;
  });
}

}  // namespace
}  // namespace epmoe
