// cuda_ipc low-latency mode against the threads backend, bit for bit (semantics §5, 13): the same fresh random inputs go
// through a threads Buffer on CPU ranks and a cuda_ipc Buffer on R = min(2, visible GPUs) GPUs (thread rank r on
// cuda:r; R = 1 sends to itself). Compared: packed_recv_x and its scales (valid rows), packed_recv_count, the
// handle's src_info (valid rows) and layout_range, cumulative stats, combined_x. Window outputs of a call are
// poisoned on the GPU once read, so a later call that used the same half must have rewritten them. Covers bf16 and
// fp8 (float32, round_scale, UE8M0; quantized in the send kernel or beforehand) and nvfp4, T = 0 on a rank, all ids -1, one
// expert taking every token, T = Tmax, K = 1, 8 and 16, H in {2048, 2880, 4096, 7168}, hooks (also two dispatches in
// flight, hooks called out of order), async_finish, repeated calls, a CUDA graph of dispatch + combine replayed with
// new inputs, and the errors (T > Tmax, K > 16, bad ids eagerly and on the device, the two-buffer rule, a hook called
// twice, a device timeout).
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <epmoe/nvfp4.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/stream.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/gpu_util.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

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


struct Case {
  std::vector<std::int64_t> T = {64, 37};  // per rank
  std::int64_t H = 2048;
  int K = 8, E = 32, tmax = 64;
  bool fp8 = false, round_scale = false, ue8m0 = false, int32_idx = false;
  double p_minus_one = 0.1;
  int only_expert = -1, all_minus_one_rank = -1;
  int calls = 2;  // dispatch + combine pairs
  bool hooks = false, async = false, stats = false, out_param = true;
  bool separate_quant = false;  // BufferOptions::low_latency_separate_quant of the cuda_ipc buffers
  bool nvfp4 = false;           // use_nvfp4 (use_fp8 off), with x_global_scale = global_scale
  float global_scale = 0.0f;    // 0: 448 * 6 / amax of each call's x on its rank (the producers' convention)
  bool device_scale = false;    // x_global_scale on the GPU (else a CPU tensor)
  bool wait_cost = false;       // dispatch_ / combine_wait_recv_cost_stats (int64 [R] from kWaitCostBase), checked apart
  bool zero_copy = false;       // each dispatch combined again (DeepEP's test): comb_x through the window's slab
  std::string name() const {
    std::ostringstream os;
    os << "T=[" << T[0] << "," << T[1] << "] H=" << H << " K=" << K << " E=" << E << " Tmax=" << tmax
       << (fp8 ? (ue8m0         ? " fp8/ue8m0"
                  : round_scale ? " fp8/round"
                                : " fp8/f32")
               : " bf16")
       << (int32_idx ? " int32 ids" : "") << " p(-1)=" << p_minus_one << " only_expert=" << only_expert
       << " all-1 rank=" << all_minus_one_rank << " calls=" << calls << (hooks ? " hooks" : "")
       << (async ? " async" : "") << (stats ? " stats" : "") << (separate_quant ? " separate quant" : "")
       << (nvfp4 ? (device_scale ? " nvfp4 (device global scale)" : " nvfp4") : "") << (wait_cost ? " wait cost" : "") << (zero_copy ? " zero-copy" : "");
    return os.str();
  }
};

/// Rank r's token count: the case's per-rank counts repeat over the ranks.
std::int64_t tokens_of(const Case& c, int r) { return c.T[static_cast<std::size_t>(r) % c.T.size()]; }

struct CallIn {
  Tensor x, idx, w, comb_x;  // host
};
using RankIns = std::vector<std::vector<CallIn>>;  // [rank][call]

RankIns make_inputs(const Case& c, int R, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  RankIns in(static_cast<std::size_t>(R));
  const int El = c.E / R;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < c.calls; ++i) {
      const std::int64_t T = tokens_of(c, r);
      CallIn ci;
      ci.x = test::random_bf16(rng, T, c.H, 3.0f);
      test::RoutingOptions ro;
      ro.p_minus_one = r == c.all_minus_one_rank ? 1.0 : c.p_minus_one;
      ro.only_expert = c.only_expert;
      Tensor idx = test::random_topk_idx(rng, T, c.K, c.E, ro);
      ci.w = test::random_topk_weights(rng, idx);
      if (c.int32_idx) {
        ci.idx = Tensor::empty(DType::int32, idx.shape());
        for (std::int64_t j = 0; j < idx.numel(); ++j)
          ci.idx.ptr<std::int32_t>()[j] = static_cast<std::int32_t>(idx.ptr<std::int64_t>()[j]);
      } else {
        ci.idx = idx;
      }
      ci.comb_x = Tensor::empty(DType::bf16, {El, static_cast<std::int64_t>(R) * c.tmax, c.H});
      gputest::fill_random(rng(), ci.comb_x, 2.0f);
      in[static_cast<std::size_t>(r)].push_back(std::move(ci));
    }
  return in;
}

using Outs = std::vector<std::map<std::string, Tensor>>;  // [rank] name -> host tensor

/// The valid part of a dispatch's outputs, on the host: rows [0, count[e]) of each expert, concatenated.
void keep_dispatch(std::map<std::string, Tensor>& o, const std::string& p, const LowLatencyDispatchResult& d) {
  const Tensor count = to_cpu(d.packed_recv_count);
  o[p + "packed_recv_count"] = count;
  o[p + "layout_range"] = to_cpu(d.handle.layout_range);
  const auto valid_rows = [&](const TensorView& v, const std::string& name) {
    if (!v.defined()) return;
    const Tensor all = to_cpu(v);
    const std::int64_t El = v.size(0), rows = v.size(1);
    const std::size_t row_bytes = static_cast<std::size_t>(v.ndim() == 3 ? v.size(2) : 1) * dtype_size(v.dtype);
    std::int64_t total = 0;
    for (std::int64_t e = 0; e < El; ++e) total += count.ptr<std::int32_t>()[e];
    Tensor out = Tensor::empty(DType::int8, {total * static_cast<std::int64_t>(row_bytes)});
    std::int64_t at = 0;
    for (std::int64_t e = 0; e < El; ++e) {
      const std::int64_t n = count.ptr<std::int32_t>()[e];
      ASSERT_TRUE(n >= 0 && n <= rows) << name << " count " << n;
      std::memcpy(static_cast<char*>(out.data()) + at, static_cast<const char*>(all.data()) + e * rows * row_bytes,
                  static_cast<std::size_t>(n) * row_bytes);
      at += n * static_cast<std::int64_t>(row_bytes);
    }
    o[p + name] = out;
  };
  valid_rows(d.packed_recv_x, "packed_recv_x");
  if (d.packed_recv_x.dtype == DType::uint8) {
    // nvfp4: each valid row's H / 16 block scales, read from its expert's swizzled matrix.
    const Tensor all = to_cpu(d.packed_recv_x_scales);
    const std::int64_t El = d.packed_recv_x.size(0), H = 2 * d.packed_recv_x.size(2), B = H / 16;
    const std::int64_t slab = d.packed_recv_x_scales.size(1) * d.packed_recv_x_scales.size(2);
    std::vector<std::uint8_t> out;
    for (std::int64_t e = 0; e < El; ++e)
      for (std::int64_t j = 0; j < count.ptr<std::int32_t>()[e]; ++j)
        for (std::int64_t b = 0; b < B; ++b)
          out.push_back(static_cast<const std::uint8_t*>(all.data())[e * slab + nvfp4_swizzled_offset(j, b, B / 4)]);
    Tensor t = Tensor::empty(DType::uint8, {static_cast<std::int64_t>(out.size())});
    if (!out.empty()) std::memcpy(t.data(), out.data(), out.size());
    o[p + "packed_recv_x_scales"] = t;
  } else {
    valid_rows(d.packed_recv_x_scales, "packed_recv_x_scales");
    if (d.packed_recv_x_scales.defined()) {
      // DeepEP's layout: a transposed [E_local, C, M] allocation, M = R*Tmax rounded up to a multiple of 4.
      const std::int64_t rows = d.packed_recv_x_scales.size(1), C = d.packed_recv_x_scales.size(2);
      const std::int64_t m = (rows + 3) / 4 * 4;
      EXPECT_EQ(d.packed_recv_x_scales.strides, (Shape{C * m, 1, m})) << p << to_string(d.packed_recv_x_scales.strides);
    }
  }
  valid_rows(d.handle.src_info, "src_info");
}

void poison_dispatch(const LowLatencyDispatchResult& d) {
  poison_gpu(d.packed_recv_x);
  poison_gpu(d.packed_recv_x_scales);
  poison_gpu(d.packed_recv_count);
  poison_gpu(d.handle.src_info);
  poison_gpu(d.handle.layout_range);
}

BufferOptions gpu_options(int r, int R, const Case& c) {
  cuda_ok(cudaSetDevice(r), "cudaSetDevice");
  BufferOptions o;
  o.backend = Backend::cuda_ipc;
  o.device = r;
  o.low_latency_mode = true;  // num_nvl_bytes 0: a low-latency-only buffer, as DeepEP's decode buffers
  o.low_latency_separate_quant = c.separate_quant;
  return o;
}

/// A dispatch of the case's Tmax and E: x, topk_idx, topk_weights (optional) and use_fp8; the other settings are
/// the defaults.
LowLatencyDispatchArgs dispatch_args(const Case& c, const TensorView& x, const TensorView& idx, const TensorView& w,
                                     bool fp8) {
  LowLatencyDispatchArgs a;
  a.x = x;
  a.topk_idx = idx;
  a.topk_weights = w;
  a.num_max_dispatch_tokens_per_rank = c.tmax;
  a.num_experts = c.E;
  a.use_fp8 = fp8;
  return a;
}

/// Rank r's buffer options: cuda_ipc on cuda:r (made current) when `gpu`, else the threads backend (the reference).
BufferOptions rank_options(bool gpu, int r, int R, const Case& c) {
  if (gpu) return gpu_options(r, R, c);
  BufferOptions o;
  o.backend = Backend::threads;
  return o;
}

/// Runs the case's calls on R ranks through the threads backend (gpu = false) or cuda_ipc.
constexpr std::int64_t kWaitCostBase = 1000;

// The wait-cost statistics after the calls: each entry at least the caller's value and below a minute of waiting
// (time, so apart from the bit-for-bit comparison).
void expect_wait_costs(const Tensor& stats, int R, const std::string& what) {
  ASSERT_EQ(stats.shape(), (Shape{R})) << what;
  for (int s = 0; s < R; ++s) {
    EXPECT_GE(stats.ptr<std::int64_t>()[s], kWaitCostBase) << what << " source " << s;
    EXPECT_LT(stats.ptr<std::int64_t>()[s], kWaitCostBase + 60'000'000'000LL) << what << " source " << s;
  }
}

Outs run(const Case& c, const RankIns& in, int R, bool gpu, std::uint64_t seed) {
  Outs outs(static_cast<std::size_t>(R));
  const int El = c.E / R;
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    auto& o = outs[static_cast<std::size_t>(r)];
    Buffer buf(borrow(g), rank_options(gpu, r, R, c));
    auto put = [&](const Tensor& t) { return gpu ? to_gpu(t, r) : t; };
    std::mt19937_64 srng(seed + 17 + static_cast<std::uint64_t>(r));
    Tensor stats = Tensor::empty(DType::int32, {El});
    for (std::int64_t e = 0; e < El; ++e) stats.ptr<std::int32_t>()[e] = static_cast<std::int32_t>(srng() % 100);
    Tensor stats_d = put(stats);
    Tensor wait_cost = Tensor::empty(DType::int64, {R});
    for (int s = 0; s < R; ++s) wait_cost.ptr<std::int64_t>()[s] = kWaitCostBase;
    const Tensor dispatch_cost = put(wait_cost), combine_cost = put(wait_cost);
    for (int i = 0; i < c.calls; ++i) {
      const CallIn& ci = in[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)];
      const std::string p = "call" + std::to_string(i) + ".";
      const Tensor x = put(ci.x), idx = put(ci.idx), w = put(ci.w), cx = put(ci.comb_x);
      LowLatencyDispatchArgs a = dispatch_args(c, x, idx, w, c.fp8);
      Tensor gs;
      if (c.nvfp4) {
        float amax = 0.0f;
        for (std::int64_t j = 0; j < ci.x.numel(); ++j) amax = std::max(amax, std::fabs(bf16_to_float(ci.x.ptr<bf16_t>()[j])));
        gs = Tensor::empty(DType::fp32, Shape{});
        *gs.ptr<float>() = c.global_scale > 0.0f ? c.global_scale : (amax > 0.0f ? 448.0f * 6.0f / amax : 1.0f);
        if (c.device_scale) gs = put(gs);
        a.use_nvfp4 = true;
        a.x_global_scale = gs;
      }
      a.round_scale = c.round_scale;
      a.use_ue8m0 = c.ue8m0;
      a.async_finish = c.async;
      a.return_recv_hook = c.hooks;
      if (c.stats) a.cumulative_local_expert_recv_stats = stats_d;
      if (c.wait_cost) a.dispatch_wait_recv_cost_stats = dispatch_cost;
      const LowLatencyDispatchResult d = buf.low_latency_dispatch(a);
      if (c.hooks) d.hook();
      if (c.async) d.event.current_stream_wait();
      keep_dispatch(o, p, d);
      LowLatencyCombineArgs ca;
      ca.x = cx;
      ca.topk_idx = idx;
      ca.topk_weights = w;
      ca.handle = &d.handle;
      ca.async_finish = c.async;
      ca.return_recv_hook = c.hooks;
      if (c.wait_cost) ca.combine_wait_recv_cost_stats = combine_cost;
      Tensor out;
      if (c.out_param && i % 2 == 1) {
        out = put(Tensor::empty(DType::bf16, {tokens_of(c, r), c.H}));
        if (gpu) poison_gpu(out);
        ca.out = out;
      }
      const LowLatencyCombineResult cr = buf.low_latency_combine(ca);
      if (c.hooks) cr.hook();
      if (c.async) cr.event.current_stream_wait();
      o[p + "combined_x"] = to_cpu(cr.combined_x);
      if (c.zero_copy) {
        // The same dispatch combined again from the next call's slab (a view into the window), x a poisoned decoy.
        const TensorView slab = buf.get_next_low_latency_combine_buffer(d.handle);
        EXPECT_EQ(slab.device, cx.device());
        EXPECT_EQ(slab.shape, cx.shape());
        if (gpu) {
          cuda_ok(cudaMemcpy(slab.data, cx.data(), cx.nbytes(), cudaMemcpyDeviceToDevice), "slab copy");
        } else {
          std::memcpy(slab.data, cx.data(), cx.nbytes());
        }
        Tensor decoy = put(Tensor::empty(DType::bf16, cx.shape()));
        if (gpu) poison_gpu(decoy);
        LowLatencyCombineArgs za = ca;
        za.x = decoy;
        za.zero_copy = true;
        za.out = TensorView{};
        const LowLatencyCombineResult zr = buf.low_latency_combine(za);
        if (c.hooks) zr.hook();
        if (c.async) zr.event.current_stream_wait();
        o[p + "combined_x zero-copy"] = to_cpu(zr.combined_x);
      }
      if (gpu) poison_dispatch(d);
    }
    if (c.stats) o["stats"] = to_cpu(stats_d);
    if (gpu) cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (c.wait_cost) {
      const std::string where = std::string(gpu ? "cuda_ipc" : "threads") + " rank " + std::to_string(r);
      expect_wait_costs(gpu ? to_cpu(dispatch_cost) : dispatch_cost, R, where + " dispatch_wait_recv_cost_stats");
      expect_wait_costs(gpu ? to_cpu(combine_cost) : combine_cost, R, where + " combine_wait_recv_cost_stats");
    }
  });
  return outs;
}

void compare(const Outs& want, const Outs& got) {
  ASSERT_EQ(want.size(), got.size());
  for (std::size_t r = 0; r < want.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    for (const auto& [name, t] : want[r]) {
      const auto it = got[r].find(name);
      ASSERT_TRUE(it != got[r].end()) << name << " missing from the cuda_ipc results";
      EXPECT_TRUE(gputest::same_bits(t, it->second)) << name;
    }
  }
}

void check_case(Case c) {
  const int R = num_ranks();
  if (R == 0) GTEST_SKIP() << "no GPU";
  c.T.resize(2, c.T.back());
  for (auto& t : c.T) t = std::min<std::int64_t>(t, c.tmax);
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(c.name() + " R=" + std::to_string(R) + " seed " + std::to_string(seed));
  const RankIns in = make_inputs(c, R, seed);
  const Outs cpu = run(c, in, R, false, seed);
  const Outs gpu = run(c, in, R, true, seed);
  compare(cpu, gpu);
}

TEST(GpuCudaIpcLowLatency, Bf16DispatchCombineMatchThreadsBackend) {
  check_case({.calls = 3});
  check_case({.int32_idx = true, .calls = 1});
}

// Both quantization paths: inside the send kernel (the default) and the library's quantizer first
// (BufferOptions::low_latency_separate_quant).
TEST(GpuCudaIpcLowLatency, Fp8FloatRoundScaleAndUe8m0Match) {
  for (bool separate : {false, true})
    for (std::int64_t H : {std::int64_t{2880}, std::int64_t{7168}})
      for (int mode = 0; mode < 3; ++mode)
        check_case({.H = H,
                    .fp8 = true,
                    .round_scale = mode >= 1,
                    .ue8m0 = mode == 2,
                    .calls = 2,
                    .separate_quant = separate});
}

// NVFP4: quantized by the library's quantizer into the records, scales swizzled by the receive kernel; a CPU or a
// device global scale (the producers' 448 * 6 / amax, and a fixed one), T = 0 on a rank, hooks.
TEST(GpuCudaIpcLowLatency, Nvfp4MatchesThreadsBackend) {
  for (std::int64_t H : {std::int64_t{2048}, std::int64_t{2880}, std::int64_t{7168}})
    for (bool device : {false, true}) check_case({.H = H, .calls = 2, .nvfp4 = true, .device_scale = device});
  check_case({.T = {0, 23}, .nvfp4 = true, .global_scale = 0.5f});
  check_case({.T = {64, 64}, .calls = 3, .hooks = true, .nvfp4 = true, .device_scale = true});
  check_case({.K = 16, .E = 32, .nvfp4 = true, .global_scale = 37.0f});
}

TEST(GpuCudaIpcLowLatency, HiddenSizes) {
  for (std::int64_t H : {std::int64_t{2048}, std::int64_t{2880}, std::int64_t{4096}, std::int64_t{7168}})
    for (bool fp8 : {false, true}) check_case({.T = {32, 19}, .H = H, .E = 16, .tmax = 32, .fp8 = fp8, .calls = 1});
}

TEST(GpuCudaIpcLowLatency, ZeroTokensAllMinusOneOneExpertAndTmax) {
  check_case({.T = {0, 23}});
  check_case({.T = {0, 0}});
  check_case({.all_minus_one_rank = 0});
  check_case({.p_minus_one = 0.0, .only_expert = 31});  // every token to one expert, on the last rank
  check_case({.T = {64, 64}, .fp8 = true});
}

// R*Tmax not a multiple of 4 (odd Tmax): the scales' columns are padded to 4 rows (DeepGEMM's TMA alignment), the
// strides checked in keep_dispatch, the values against the threads backend.
TEST(GpuCudaIpcLowLatency, Fp8ScalesColumnMajorWithPaddedColumns) {
  for (int mode = 0; mode < 3; ++mode)
    check_case({.T = {5, 3}, .H = 2880, .E = 16, .tmax = 5, .fp8 = true, .round_scale = mode >= 1, .ue8m0 = mode == 2,
                .calls = 2});
}

// Large Tmax with E = 256 and T past 256: the dispatch send's and receive's block scans take the tokens in several
// rounds; at T = 600 with rows of two combine chunks (H = 7168, or 4224 in quick runs) the combine receive's 1200
// items outnumber the co-resident grid of a launch with both phases, so blocks take several items (the next token's
// ids behind a barrier); with hooks the receive-only launch stops at its most blocks and loops past them.
TEST(GpuCudaIpcLowLatency, LargeTmaxAndMoreItemsThanBlocks) {
  for (bool fp8 : {false, true})
    check_case({.T = {300, 77}, .H = 1024, .E = 256, .tmax = 512, .fp8 = fp8, .round_scale = fp8, .ue8m0 = fp8,
                .calls = 2});
  for (bool hooks : {false, true})
    check_case({.T = {600, 77}, .H = gputest::quick() ? 4224 : 7168, .E = 256, .tmax = 1024, .calls = 2,
                .hooks = hooks});
}

TEST(GpuCudaIpcLowLatency, TopK1And8And16) {
  for (int K : {1, 8, 16}) check_case({.K = K, .E = K == 16 ? 32 : 16, .calls = 2});
}

TEST(GpuCudaIpcLowLatency, HooksAndAsyncFinish) {
  check_case({.fp8 = true, .calls = 3, .hooks = true});
  check_case({.calls = 3, .async = true});
}

// DeepEP V1's wait-cost statistics written by the receive kernels (nanoseconds per source, semantics §5): the
// results bit for bit as the threads backend's, the entries grown from the caller's value, with and without hooks.
TEST(GpuCudaIpcLowLatency, ZeroCopyCombineSendsTheWindowSlab) {
  check_case({.calls = 2, .zero_copy = true});
  check_case({.calls = 2, .hooks = true, .zero_copy = true});
}

TEST(GpuCudaIpcLowLatency, WaitCostStatsAccumulateAndChangeNoResult) {
  check_case({.calls = 3, .wait_cost = true});
  check_case({.fp8 = true, .calls = 2, .hooks = true, .wait_cost = true});
}

TEST(GpuCudaIpcLowLatency, CumulativeStatsOverManyCalls) {
  check_case({.T = {16, 9}, .H = 1024, .tmax = 16, .fp8 = true, .calls = 24, .stats = true});
}

// Two dispatches in flight with hooks (DeepEP's two micro-batches): dispatch A and B send, then B's hook and A's
// hook receive (out of order), then B is combined. Every output against the threads backend doing the same.
TEST(GpuCudaIpcLowLatency, TwoDispatchesInFlightHooksCalledOutOfOrder) {
  const int R = num_ranks();
  if (R == 0) GTEST_SKIP() << "no GPU";
  Case c;
  c.calls = 2;
  c.fp8 = true;
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(c.name() + " seed " + std::to_string(seed));
  const RankIns in = make_inputs(c, R, seed);
  const auto body = [&](bool gpu) {
    Outs outs(static_cast<std::size_t>(R));
    run_thread_ranks(R, [&](Group& g) {
      const int r = g.rank();
      Buffer buf(borrow(g), rank_options(gpu, r, R, c));
      auto put = [&](const Tensor& t) { return gpu ? to_gpu(t, r) : t; };
      std::vector<Tensor> keep;
      std::vector<LowLatencyDispatchResult> ds;
      for (int i = 0; i < 2; ++i) {
        const CallIn& ci = in[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)];
        keep.push_back(put(ci.x));
        keep.push_back(put(ci.idx));
        LowLatencyDispatchArgs a = dispatch_args(c, keep[keep.size() - 2], keep.back(), {}, true);
        a.return_recv_hook = true;
        ds.push_back(buf.low_latency_dispatch(a));
      }
      ds[1].hook();
      ds[0].hook();
      auto& o = outs[static_cast<std::size_t>(r)];
      keep_dispatch(o, "A.", ds[0]);
      keep_dispatch(o, "B.", ds[1]);
      const CallIn& cb = in[static_cast<std::size_t>(r)][1];
      const Tensor cx = put(cb.comb_x), w = put(cb.w);
      LowLatencyCombineArgs ca;
      ca.x = cx;
      ca.topk_idx = keep[3];
      ca.topk_weights = w;
      ca.handle = &ds[1].handle;
      o["combined_x"] = to_cpu(buf.low_latency_combine(ca).combined_x);
    });
    return outs;
  };
  const Outs want = body(false);
  const Outs got = body(true);
  compare(want, got);
}

struct Failure {
  bool thrown = false;
  ErrorCode code = ErrorCode::internal;
  std::string what;
};
Failure failure(const std::function<void()>& fn) {
  Failure f;
  try {
    fn();
  } catch (const Error& e) {
    f.thrown = true;
    f.code = e.code();
    f.what = e.what();
  }
  return f;
}

// Every low-latency argument error (semantics §11), raised on every rank before any communication (T > Tmax, K > 16, bad ids with
// debug_validate; the two-buffer rule; a hook called twice; an nvfp4 global scale that is not finite), or on the
// device and raised by the next call (bad ids, a device global scale, without debug_validate); the buffer stays usable
// after each.
TEST(GpuCudaIpcLowLatency, ErrorsBeforeCommunicationAndOnTheDevice) {
  const int R = num_ranks();
  if (R == 0) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  Case c;
  c.calls = 1;
  const RankIns in = make_inputs(c, R, seed);
  for (bool eager : {true, false}) {
    run_thread_ranks(R, [&](Group& g) {
      const int r = g.rank();
      BufferOptions opts = gpu_options(r, R, c);
      opts.debug_validate = eager;
      Buffer buf(borrow(g), opts);
      const CallIn& ci = in[static_cast<std::size_t>(r)][0];
      Tensor x = to_gpu(ci.x, r), idx = to_gpu(ci.idx, r), w = to_gpu(ci.w, r), cx = to_gpu(ci.comb_x, r);
      auto args = [&] { return dispatch_args(c, x, idx, w, false); };
      // A normal-mode call on the low-latency-only buffer, and such a buffer without low_latency_mode.
      if (eager) {
        DispatchArgs normal;
        normal.x = x;
        const Failure f = failure([&] { buf.dispatch(normal); });
        EXPECT_EQ(f.code, ErrorCode::invalid_argument) << f.what;
        EXPECT_NE(f.what.find("options.num_nvl_bytes"), std::string::npos) << f.what;
        BufferOptions no_mode = gpu_options(r, R, c);
        no_mode.low_latency_mode = false;
        const Failure g0 = failure([&] { Buffer unusable(borrow(g), no_mode); });
        EXPECT_EQ(g0.code, ErrorCode::invalid_argument) << g0.what;
        EXPECT_NE(g0.what.find("low_latency_mode"), std::string::npos) << g0.what;
      }
      // T > Tmax: names both.
      LowLatencyDispatchArgs big = args();
      big.num_max_dispatch_tokens_per_rank = static_cast<int>(std::max<std::int64_t>(1, x.shape()[0] - 1));
      if (x.shape()[0] > 1) {
        const Failure f = failure([&] { buf.low_latency_dispatch(big); });
        EXPECT_EQ(f.code, ErrorCode::invalid_argument) << f.what;
        EXPECT_NE(f.what.find("num_max_dispatch_tokens_per_rank"), std::string::npos) << f.what;
      }
      // K = 17.
      Tensor idx17 = to_gpu(Tensor::empty(DType::int64, {x.shape()[0], 17}), r);
      LowLatencyDispatchArgs k17 = args();
      k17.topk_idx = idx17;
      k17.topk_weights = {};
      EXPECT_EQ(failure([&] { buf.low_latency_dispatch(k17); }).code, ErrorCode::invalid_argument);
      // A bad id (E) in every rank's first token.
      Tensor bad_host = Tensor::empty(DType::int64, ci.idx.shape());
      std::memcpy(bad_host.data(), ci.idx.data(), ci.idx.nbytes());
      if (bad_host.numel() > 0) bad_host.ptr<std::int64_t>()[0] = c.E;
      Tensor bad = to_gpu(bad_host, r);
      LowLatencyDispatchArgs b = args();
      b.topk_idx = bad;
      if (bad_host.numel() > 0) {
        if (eager) {
          const Failure f = failure([&] { buf.low_latency_dispatch(b); });
          EXPECT_EQ(f.code, ErrorCode::invalid_argument) << f.what;
        } else {
          // The device skips the id and records it; the next call raises it (on every rank: all sent one).
          const LowLatencyDispatchResult d = buf.low_latency_dispatch(b);
          cuda_ok(cudaDeviceSynchronize(), "sync");
          const Failure f = failure([&] { buf.low_latency_dispatch(args()); });
          EXPECT_EQ(f.code, ErrorCode::invalid_argument) << f.what;
          EXPECT_NE(f.what.find("topk_idx"), std::string::npos) << f.what;
        }
      }
      // nvfp4 with a NaN global scale: on the CPU refused before any communication; on the device refused so with
      // debug_validate, else found by the send kernel and raised by the next call; each naming x_global_scale.
      {
        Tensor nan_host = Tensor::empty(DType::fp32, Shape{});
        *nan_host.ptr<float>() = std::nanf("");
        const Tensor nan_dev = to_gpu(nan_host, r);
        LowLatencyDispatchArgs n = args();
        n.use_nvfp4 = true;
        n.x_global_scale = nan_host;
        Failure f = failure([&] { buf.low_latency_dispatch(n); });
        EXPECT_EQ(f.code, ErrorCode::invalid_argument) << f.what;
        EXPECT_NE(f.what.find("'x_global_scale'"), std::string::npos) << f.what;
        n.x_global_scale = nan_dev;
        if (eager) {
          f = failure([&] { buf.low_latency_dispatch(n); });
        } else {
          buf.low_latency_dispatch(n);
          cuda_ok(cudaDeviceSynchronize(), "sync");
          f = failure([&] { buf.low_latency_dispatch(args()); });
        }
        EXPECT_EQ(f.code, ErrorCode::invalid_argument) << f.what;
        EXPECT_NE(f.what.find("'x_global_scale'"), std::string::npos) << f.what;
      }
      // Usable afterwards; the two-buffer rule; a hook called twice.
      const LowLatencyDispatchResult d1 = buf.low_latency_dispatch(args());
      LowLatencyDispatchArgs hooked = args();
      hooked.return_recv_hook = true;
      const LowLatencyDispatchResult d2 = buf.low_latency_dispatch(hooked);
      d2.hook();
      EXPECT_EQ(failure([&] { d2.hook(); }).code, ErrorCode::stale_handle);
      buf.low_latency_dispatch(args());  // reuses d1's half: d1's routing is gone
      LowLatencyCombineArgs ca;
      ca.x = cx;
      ca.topk_idx = idx;
      ca.topk_weights = w;
      ca.handle = &d1.handle;
      EXPECT_EQ(failure([&] { buf.low_latency_combine(ca); }).code, ErrorCode::stale_handle);
      ca.handle = &d2.handle;
      const LowLatencyCombineResult cr = buf.low_latency_combine(ca);
      cuda_ok(cudaDeviceSynchronize(), "sync");
      EXPECT_FALSE(failure([&] { buf.low_latency_dispatch(args()); }).thrown);
      cuda_ok(cudaDeviceSynchronize(), "sync");
    });
  }
}

// One CUDA graph per rank holds a dispatch (fp8) and its combine; it is replayed with new inputs and routing
// written into the captured tensors, and every replay matches the threads backend bit for bit (the call index lives
// on the device, so replays do not reuse the captured one).
TEST(GpuCudaIpcLowLatency, DispatchCombineCapturedOnceAndReplayed) {
  const int R = num_ranks();
  if (R == 0) GTEST_SKIP() << "no GPU";
  Case c;
  c.fp8 = true;
  c.round_scale = true;
  c.calls = 1;
  c.T = {48, 48};           // fixed shapes: the graph's
  constexpr int kSets = 4;  // set 0: the eager warm-up; sets 1..3: one replay each
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(c.name() + " seed " + std::to_string(seed));
  std::mt19937_64 seeds(seed);
  std::vector<RankIns> ins;
  std::vector<Outs> want;
  for (int k = 0; k < kSets; ++k) {
    const std::uint64_t s = seeds();
    ins.push_back(make_inputs(c, R, s));
    want.push_back(run(c, ins.back(), R, false, s));
  }
  std::vector<Outs> got(kSets, Outs(static_cast<std::size_t>(R)));
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    const auto ru = static_cast<std::size_t>(r);
    BufferOptions opts = gpu_options(r, R, c);
    Buffer buf(borrow(g), opts);
    const CallIn& first = ins[0][ru][0];
    Tensor x = to_gpu(first.x, r), idx = to_gpu(first.idx, r), w = to_gpu(first.w, r), cx = to_gpu(first.comb_x, r);
    Tensor out = to_gpu(Tensor::empty(DType::bf16, {tokens_of(c, static_cast<int>(ru)), c.H}), r);
    cudaStream_t st = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    StreamGuard on(Stream{st});
    auto call = [&](LowLatencyDispatchResult* keep) {
      LowLatencyDispatchArgs a = dispatch_args(c, x, idx, w, true);
      a.round_scale = true;
      *keep = buf.low_latency_dispatch(a);
      LowLatencyCombineArgs ca;
      ca.x = cx;
      ca.topk_idx = idx;
      ca.topk_weights = w;
      ca.handle = &keep->handle;
      ca.out = out;
      buf.low_latency_combine(ca);
    };
    auto keep_all = [&](int k, const LowLatencyDispatchResult& d) {
      cuda_ok(cudaStreamSynchronize(st), "sync");
      auto& o = got[static_cast<std::size_t>(k)][ru];
      keep_dispatch(o, "call0.", d);
      o["call0.combined_x"] = to_cpu(out);
      poison_dispatch(d);
      poison_gpu(out);
      cuda_ok(cudaDeviceSynchronize(), "sync");
    };
    LowLatencyDispatchResult eager;
    call(&eager);  // configures the window; set 0
    keep_all(0, eager);
    LowLatencyDispatchResult captured;
    cudaGraph_t graph = nullptr;
    cuda_ok(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
    std::string why;
    try {
      call(&captured);
    } catch (const std::exception& e) {
      why = e.what();
    }
    const cudaError_t end = cudaStreamEndCapture(st, &graph);
    ASSERT_TRUE(why.empty()) << why;
    ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
    // One kernel per op (its phases one launch, as DeepEP's): the graph holds exactly two kernels, one whose
    // name holds "dispatch" and one holding "combine" (what DeepEP's bench_kineto asserts), and nothing else.
    std::size_t num_nodes = 0;
    cuda_ok(cudaGraphGetNodes(graph, nullptr, &num_nodes), "graph nodes");
    std::vector<cudaGraphNode_t> nodes(num_nodes);
    cuda_ok(cudaGraphGetNodes(graph, nodes.data(), &num_nodes), "graph nodes");
    std::vector<std::string> kernels;
    for (cudaGraphNode_t n : nodes) {
      cudaGraphNodeType type{};
      cuda_ok(cudaGraphNodeGetType(n, &type), "node type");
      ASSERT_EQ(type, cudaGraphNodeTypeKernel) << "a captured dispatch + combine holds only kernels";
      cudaKernelNodeParams kp{};
      cuda_ok(cudaGraphKernelNodeGetParams(n, &kp), "kernel node");
      const char* name = nullptr;
      cuda_ok(cudaFuncGetName(&name, kp.func), "kernel name");
      kernels.emplace_back(name);
    }
    ASSERT_EQ(kernels.size(), 2u);
    const auto holding = [&](const char* word) {
      return std::count_if(kernels.begin(), kernels.end(),
                           [&](const std::string& k) { return k.find(word) != std::string::npos; });
    };
    EXPECT_EQ(holding("dispatch"), 1) << kernels[0] << " / " << kernels[1];
    EXPECT_EQ(holding("combine"), 1) << kernels[0] << " / " << kernels[1];
    cudaGraphExec_t exec = nullptr;
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    for (int k = 1; k < kSets; ++k) {
      const CallIn& ci = ins[static_cast<std::size_t>(k)][ru][0];
      const std::pair<Tensor*, const Tensor*> pairs[] = {{&x, &ci.x}, {&idx, &ci.idx}, {&w, &ci.w}, {&cx, &ci.comb_x}};
      for (auto [dev, host] : pairs)
        cuda_ok(cudaMemcpy(dev->data(), host->data(), host->nbytes(), cudaMemcpyHostToDevice), "refill");
      cuda_ok(cudaGraphLaunch(exec, st), "replay");
      keep_all(k, captured);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cuda_ok(cudaStreamSynchronize(st), "sync");
    cudaStreamDestroy(st);
  });
  for (int k = 0; k < kSets; ++k) {
    SCOPED_TRACE("set " + std::to_string(k));
    compare(want[static_cast<std::size_t>(k)], got[static_cast<std::size_t>(k)]);
  }
}

}  // namespace
}  // namespace epmoe

namespace epmoe {
namespace {

// A rank that does not make a call: the other rank's receive kernel times out on the device (group timeout 1 s),
// returns, and its next call raises timeout naming rank, peer and phase; every call after that raises unusable.
TEST(GpuCudaIpcLowLatency, DeviceTimeoutIsRaisedByTheNextCallThenUnusable) {
  if (num_ranks() < 2) GTEST_SKIP() << "needs 2 GPUs (a peer that stays away)";
  const int R = 2;
  Case c;
  c.calls = 1;
  const std::uint64_t seed = test::fresh_seed();
  const RankIns in = make_inputs(c, R, seed);
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    BufferOptions opts = gpu_options(r, R, c);
    Buffer buf(borrow(g), opts);
    const CallIn& ci = in[static_cast<std::size_t>(r)][0];
    Tensor x = to_gpu(ci.x, r), idx = to_gpu(ci.idx, r);
    const LowLatencyDispatchArgs a = dispatch_args(c, x, idx, {}, false);
    g.barrier("test: inputs ready");
    g.set_timeout_s(1.0);  // read by the low-latency mode at its first call (device spins)
    buf.low_latency_dispatch(a);  // together: configures the window
    cuda_ok(cudaDeviceSynchronize(), "sync");
    g.barrier("test: warm-up done");
    g.set_timeout_s(60.0);  // the host waits below; the buffer keeps the 1 s it read at its first call
    if (r == 0) {
      buf.low_latency_dispatch(a);  // rank 1 stays away: the receive times out on the device
      cuda_ok(cudaDeviceSynchronize(), "sync");
      const Failure f = failure([&] { buf.low_latency_dispatch(a); });
      EXPECT_EQ(f.code, ErrorCode::timeout) << f.what;
      EXPECT_NE(f.what.find("peer 1"), std::string::npos) << f.what;
      EXPECT_NE(f.what.find("low_latency_dispatch receive"), std::string::npos) << f.what;
      EXPECT_EQ(failure([&] { buf.low_latency_dispatch(a); }).code, ErrorCode::unusable);
    }
    g.barrier("test: done");
  });
}

}  // namespace
}  // namespace epmoe
