// The MoE layer's low-latency path on GPU ranks (SPEC 5, 8, 13): make_low_latency_prepare_finalize over a
// cuda_ipc Buffer (its GPU low-latency mode) with the CUDA experts in the batched_experts format, R = min(2,
// visible GPUs) thread ranks (rank r on cuda:r; R = 1 sends to itself), against
//   - the independent float64 layer reference (tests/support/moe_reference) of the values the experts saw (the
//     fp8 round trip of the tokens with an fp8 wire): relative L2 <= 1e-2 (SPEC 13), and
//   - the same layer on CPU ranks (threads backend, BLAS experts) on the same inputs: relative L2 <= 1e-2. Both
//     paths carry the same wire bits (the transports are bit-identical, the CUDA and CPU fp8 quantizers too) and
//     sum over k the same way; they differ only in the experts' GEMMs (cuBLAS vs OpenBLAS accumulation order, each
//     rounding the [rows, 2N] and [rows, N] intermediates to bf16: ~2^-9 relative per element), so the two
//     outputs sit within a few 1e-3 of each other, well inside 1e-2.
// Fresh random inputs per call (seed logged), outputs poisoned (0xff) first. Covered: bf16 and fp8 (float32 and
// UE8M0 scales) wires, H in {2048, 2880, 7168}, three forwards through one layer (both halves of the buffer, the
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
#include <epmoe/quant.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
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

using gputest::gpu_count;
using gputest::borrow;
using gputest::cuda_ok;
using gputest::to_gpu;
using gputest::to_cpu;
constexpr auto poison_gpu = gputest::poison;  // 0xff bytes (NaN in bf16 and fp32)
// One rank per GPU: ranks as threads on one GPU starve each other's spinning kernels.
/// Thread ranks, rank r on cuda:r: every visible GPU up to 8 (EPMOE_TEST_RANKS caps it); a case's per-rank token
/// counts repeat over the ranks (tokens_of).
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

void log_error(const std::string& what, double err) { std::printf("[ rel_l2   ] %-70s %.3e\n", what.c_str(), err); }

struct Case {
  std::vector<std::int64_t> T = {24, 9};  // per rank (rank r uses T[r])
  std::int64_t H = 2048, N = 128;
  int K = 4, E = 16, tmax = 32;
  bool fp8 = false, ue8m0 = false, weight_on_input = false, int32_idx = false;
  double p_minus_one = 0.1;
  int forwards = 3;
  std::string name() const {
    return "T=[" + std::to_string(T[0]) + "," + std::to_string(T[1]) + "] H=" + std::to_string(H) +
           " K=" + std::to_string(K) + " E=" + std::to_string(E) + (fp8 ? (ue8m0 ? " fp8/ue8m0" : " fp8/f32") : " bf16") +
           (weight_on_input ? " weight-on-input" : "") + (int32_idx ? " int32 ids" : "");
  }
  PrepareFinalizeOptions options() const {
    PrepareFinalizeOptions o;
    o.dispatch_dtype = fp8 ? DispatchDtype::fp8 : DispatchDtype::bf16;
    o.round_scale = ue8m0;
    o.use_ue8m0 = ue8m0;
    return o;
  }
};

/// Rank r's token count: the case's per-rank counts repeat over the ranks.
std::int64_t tokens_of(const Case& c, int r) { return c.T[static_cast<std::size_t>(r) % c.T.size()]; }

struct Model {
  Tensor w1, w2;  // host, all E experts: [E, 2N, H], [E, H, N] (gated silu)
};
Model make_model(std::mt19937_64& rng, const Case& c) {
  Tensor a = test::random_bf16(rng, c.E * 2 * c.N, c.H, 1.0f / std::sqrt(static_cast<float>(c.H)));
  Tensor b = test::random_bf16(rng, c.E * c.H, c.N, 1.0f / std::sqrt(static_cast<float>(c.N)));
  return {Tensor::wrap(TensorView(a.data(), DType::bf16, {c.E, 2 * c.N, c.H}), std::make_shared<Tensor>(a)),
          Tensor::wrap(TensorView(b.data(), DType::bf16, {c.E, c.H, c.N}), std::make_shared<Tensor>(b))};
}

struct CallIn {
  Tensor x, idx, w;  // host; idx int64 (int32 copy made when the case asks)
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
      ci.idx = test::random_topk_idx(rng, T, c.K, c.E, ro);
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

// The values the experts see after the wire (the CPU quantizer is bit-identical to the CUDA one), with the
// router weight on the input applied first as prepare does (x * w rounded to bf16).
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

using Outs = std::vector<std::vector<Tensor>>;  // [rank][forward] host bf16 [T, H]

// Runs the case's forwards on R thread ranks: GPU ranks (cuda_ipc, CUDA experts) or CPU ranks (threads, BLAS).
Outs run_layer(const Case& c, const Model& m, const Ins& in, int R, bool gpu) {
  Outs outs(static_cast<std::size_t>(R));
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
      a.global_num_experts = c.E;
      a.apply_router_weight_on_input = c.weight_on_input;
      Tensor out;
      if (f != 1) {  // forward 1: the layer allocates the output
        out = gpu ? Tensor::empty(DType::bf16, {ci.x.size(0), c.H}, Device::cuda(r))
                  : Tensor::empty(DType::bf16, {ci.x.size(0), c.H});
        if (gpu) poison_gpu(out);
        else if (out.nbytes()) std::memset(out.data(), 0xff, out.nbytes());
        a.output = out;
      }
      const MoEForwardResult res = layer.forward(a);
      EXPECT_EQ(res.output.shape(), (Shape{ci.x.size(0), c.H})) << c.name() << " rank " << r;
      EXPECT_EQ(res.output.device().is_cuda(), gpu) << c.name() << " rank " << r;
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
  const Model m = make_model(rng, c);
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
      // seen_by_experts has the router weight applied already (on the token side, before the wire), so the
      // reference takes weights of 1 then (and applies none on either side).
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
  c.K = 1;
  c.weight_on_input = true;
  c.int32_idx = true;
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
    const Ins in = make_inputs(rng, c, R);
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
        const CallIn& ci = in[static_cast<std::size_t>(r)][0];
        auto put = [&](const Tensor& t) { return gpu ? to_gpu(t.view(), r) : t; };
        const Tensor x = put(ci.x), idx = put(ci.idx), w = put(ci.w);
        PrepareInputs pin;
        pin.hidden = x;
        pin.topk_idx = idx;
        pin.topk_weights = w;
        pin.global_num_experts = c.E;
        pf->dispatch_a(pin);
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
  const Model m = make_model(rng, c);
  const Ins in = make_inputs(rng, c, 1);
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
      a.global_num_experts = c.E;
      return a;
    };
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
    const MoEForwardResult r = layer.forward(args());
    const double err = test::relative_l2(to_cpu(r.output), test::moe_layer_reference(ci.x, m.w1, m.w2, ci.idx, ci.w,
                                                                                     "silu"));
    log_error("after the refused calls", err);
    EXPECT_LE(err, kTolerance) << "seed " << seed;
  });
}

}  // namespace
}  // namespace epmoe
