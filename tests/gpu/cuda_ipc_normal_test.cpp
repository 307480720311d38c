// cuda_ipc normal mode against the threads backend, bit for bit (semantics §13): the same random inputs go
// through a threads Buffer on CPU ranks and through a cuda_ipc Buffer on every visible GPU, 2 to 8 (one
// process, thread rank r on cuda:r, peer access; EPMOE_TEST_RANKS caps the count); recv_x, scales, local
// ids, weights, the expert counts, every field of the handle, cached dispatch, combined_x and
// combined_topk_weights must be identical. Skipped with fewer than 2 GPUs. Covers T in {1, 128, 4096} (different T on each rank), H in {2048, 2880, 7168},
// bf16 and fp8 with float32 or UE8M0 scales (row- or column-major), int32 ids, a zero-token rank, all ids -1, one expert
// taking every token, num_worst_tokens, expert_alignment, async_finish, biases, bad arguments.
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>
#include <epmoe/layout.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/replay.hpp>

#include <algorithm>
#include <cstdlib>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
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

/// Thread ranks of these tests, rank r on cuda:r: every visible GPU, 2..8 (EPMOE_TEST_RANKS caps it).
int test_ranks() { return std::max(2, gputest::thread_ranks()); }

#define REQUIRE_TWO_GPUS() \
  if (gpu_count() < 2) GTEST_SKIP() << "cuda_ipc tests need 2 GPUs, found " << gpu_count()

/// Makes rank r's GPU (cuda:r) current and returns cuda_ipc options for rank r, sized for `max_tokens` tokens per
/// rank of `hidden` with `topk` (Buffer::get_normal_nvl_size_hint).
BufferOptions ipc_options(int r, std::int64_t max_tokens, std::int64_t hidden, int topk) {
  cuda_ok(cudaSetDevice(r), "cudaSetDevice");
  BufferOptions o;
  o.backend = Backend::cuda_ipc;
  o.device = r;
  o.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(max_tokens, hidden, test_ranks(), topk);
  return o;
}

/// Captures `body` on `st` into a graph (thread-local capture mode). The capture always ends, so a failure cannot
/// leave the stream capturing for the tests after it; returns null with `why` set on a failure.
cudaGraph_t capture(cudaStream_t st, const std::function<void()>& body, std::string* why) {
  cuda_ok(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  try {
    body();
  } catch (const std::exception& e) {
    *why = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t e = cudaStreamEndCapture(st, &graph);
  if (e != cudaSuccess || !why->empty()) {
    cudaGetLastError();
    if (why->empty()) *why = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(e);
    if (graph) cudaGraphDestroy(graph);
    return nullptr;
  }
  return graph;
}

/// Throws naming `after` when `st` is capturing and an earlier call invalidated the capture.
void expect_capture_alive(cudaStream_t st, const char* after) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cuda_ok(cudaStreamIsCapturing(st, &status), "cudaStreamIsCapturing");
  if (status == cudaStreamCaptureStatusInvalidated)
    throw std::runtime_error(std::string("the capture was invalidated by ") + after);
}

struct Case {
  std::vector<std::int64_t> T = {64, 48};
  std::int64_t H = 2048;
  int K = 8;
  int E = 256;
  bool fp8 = false;
  bool ue8m0 = false;
  bool int32_idx = false;
  double p_minus_one = 0.1;
  int only_expert = -1;
  int all_minus_one_rank = -1;
  int worst = 0;
  int alignment = 1;
  bool cached = false;
  bool bias = true;
  bool combine_weights = true;
  bool async = false;
  bool copy_engine = true;  ///< BufferOptions::use_copy_engine (false: SM stores only)
  int chunks = 0;           ///< BufferOptions::num_chunks (0: the default)
  std::int64_t ce_min_rows = 0;  ///< BufferOptions::copy_engine_min_rows (0: the copy-engine path at every size)
  bool olmoe = false;       ///< replay recorded OLMoE routing (semantics §14, layer 0, ids mapped to E) instead of random
  /// BufferOptions::num_recv_slots (> 0: dispatches without num_worst_tokens take the zero-copy path; 0: the
  /// copy-engine or SM-store path, as copy_engine and ce_min_rows say).
  int recv_slots = 2;
  bool combine_sm_push = false;  ///< BufferOptions::combine_sm_push (the copy-engine combine's pushes by SM stores)
  /// How the cuda_ipc run passes x_scales (the threads reference passes them row-major): column-major is
  /// DeepGEMM's TMA-aligned layout, read by the kernels through its strides.
  ScaleLayout scale_layout = ScaleLayout::row_major;
  std::string name() const {
    std::ostringstream os;
    os << "T=[" << T[0] << "," << T[1] << "] H=" << H << " K=" << K << " E=" << E
       << (fp8 ? ue8m0 ? " fp8/ue8m0" : " fp8/f32" : " bf16") << (int32_idx ? " int32 ids" : "")
       << " p(-1)=" << p_minus_one << " only_expert=" << only_expert << " all-1 rank=" << all_minus_one_rank
       << " worst=" << worst << " align=" << alignment << (cached ? " cached" : "") << (async ? " async" : "")
       << (copy_engine ? " copy-engine" : " sm-stores") << " chunks=" << chunks << " ce_min_rows=" << ce_min_rows
       << (olmoe ? " olmoe routing" : "") << " recv_slots=" << recv_slots
       << (combine_sm_push ? " combine sm push" : "") << " scales " << scale_layout_name(scale_layout);
    return os.str();
  }
};

struct RankIn {
  Tensor x, scales, idx, w, x2, scales2, b0, b1;  // host
  std::uint64_t seed = 0;
};

struct RankOut {
  std::map<std::string, Tensor> t;  // host tensors, compared by name
  std::vector<int> list;
  std::int64_t num_recv = 0, rows = 0;
  Tensor comb_x, comb_w;  // combine inputs, made by the CPU run (their rows come from its dispatch)
};

Tensor random_x(std::mt19937_64& rng, std::int64_t T, std::int64_t H, bool fp8) {
  Tensor x = Tensor::empty(fp8 ? DType::fp8_e4m3 : DType::bf16, {T, H});
  gputest::fill_random(rng(), x, 4.0f);
  return x;
}

Tensor random_scales(std::mt19937_64& rng, std::int64_t T, std::int64_t H, bool ue8m0) {
  const std::int64_t g = num_scale_groups(H);
  Tensor s = Tensor::empty(ue8m0 ? DType::int32 : DType::fp32, {T, ue8m0 ? (g + 3) / 4 : g});
  gputest::fill_random(rng(), s, 1.0f);
  return s;
}

std::vector<RankIn> make_inputs(const Case& c, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<RankIn> in(test_ranks());
  for (int r = 0; r < test_ranks(); ++r) {
    RankIn& i = in[static_cast<std::size_t>(r)];
    const std::int64_t T = c.T[static_cast<std::size_t>(r)];
    i.seed = rng();
    i.x = random_x(rng, T, c.H, c.fp8);
    if (c.fp8) i.scales = random_scales(rng, T, c.H, c.ue8m0);
    Tensor idx;
    if (c.olmoe) {
      static const RoutingTrace trace =
          load_routing_trace(std::string(EPMOE_TEST_DATA_DIR) + "/olmoe-routing", "general");
      const ReplayedRouting rr = replay_routing(trace, 0, 0, r, T, c.E);
      idx = rr.topk_idx;
      i.w = rr.topk_weights;
    } else {
      test::RoutingOptions ro;
      ro.p_minus_one = r == c.all_minus_one_rank ? 1.0 : c.p_minus_one;
      ro.only_expert = c.only_expert;
      idx = test::random_topk_idx(rng, T, c.K, c.E, ro);
      i.w = test::random_topk_weights(rng, idx);
    }
    if (c.int32_idx) {
      i.idx = Tensor::empty(DType::int32, idx.shape());
      for (std::int64_t j = 0; j < idx.numel(); ++j)
        i.idx.ptr<std::int32_t>()[j] = static_cast<std::int32_t>(idx.ptr<std::int64_t>()[j]);
    } else {
      i.idx = idx;
    }
    if (c.cached) {
      i.x2 = random_x(rng, T, c.H, c.fp8);
      if (c.fp8) i.scales2 = random_scales(rng, T, c.H, c.ue8m0);
    }
    if (c.bias) {
      i.b0 = test::random_bf16(rng, T, c.H, 2.0f);
      i.b1 = test::random_bf16(rng, T, c.H, 2.0f);
    }
  }
  return in;
}

void keep_dispatch(RankOut& o, const DispatchResult& d, bool on_gpu, const std::string& prefix) {
  auto host = [&](const Tensor& t) { return on_gpu ? to_cpu(t) : t; };
  o.t[prefix + "recv_x"] = host(d.recv_x);
  if (d.recv_x_scales.defined()) o.t[prefix + "recv_x_scales"] = host(d.recv_x_scales);
  if (d.recv_topk_idx.defined()) o.t[prefix + "recv_topk_idx"] = host(d.recv_topk_idx);
  if (d.recv_topk_weights.defined()) o.t[prefix + "recv_topk_weights"] = host(d.recv_topk_weights);
}

/// Runs the case on R ranks: through the threads backend (gpu = false) or cuda_ipc (gpu = true).
std::vector<RankOut> run(const Case& c, const std::vector<RankIn>& in, std::vector<RankOut>* cpu_out, bool gpu) {
  std::vector<RankOut> out(test_ranks());
  const std::int64_t max_t = *std::max_element(c.T.begin(), c.T.end());
  run_thread_ranks(test_ranks(), [&](Group& g) {
    const int r = g.rank();
    const RankIn& i = in[static_cast<std::size_t>(r)];
    RankOut& o = out[static_cast<std::size_t>(r)];
    BufferOptions opts;
    if (gpu) {
      opts = ipc_options(r, max_t, c.H, c.K);
      opts.use_copy_engine = c.copy_engine;
      opts.copy_engine_min_rows = c.ce_min_rows;
      opts.num_chunks = c.chunks;
      opts.num_recv_slots = c.recv_slots;
      opts.combine_sm_push = c.combine_sm_push;
    } else {
      opts.backend = Backend::threads;
    }
    Buffer buf(borrow(g), opts);
    auto put = [&](const Tensor& t) -> Tensor { return gpu && t.defined() ? to_gpu(t, r) : t; };
    // The cuda_ipc run's scales in the case's layout: the whole column-major storage (padding included) copied.
    auto put_scales = [&](const Tensor& t) -> Tensor {
      if (!gpu || !t.defined() || c.scale_layout == ScaleLayout::row_major) return put(t);
      const Tensor h = test::scales_in_layout(t, c.scale_layout);
      const Tensor d = empty_fp8_scales(t.dtype(), t.shape(), c.scale_layout, Device::cuda(r));
      const std::size_t span = static_cast<std::size_t>(t.size(1) * tma_aligned_scale_rows(t.size(0))) * 4;
      if (span > 0) cuda_ok(cudaMemcpy(d.data(), h.data(), span, cudaMemcpyHostToDevice), "H2D scales");
      return d;
    };
    const Tensor x = put(i.x), scales = put_scales(i.scales), idx = put(i.idx), w = put(i.w);
    const DispatchLayout layout = buf.get_dispatch_layout(idx, c.E);
    DispatchArgs a = make_dispatch_args(layout, x, idx, w);
    if (scales.defined()) a.x_scales = scales;
    a.expert_alignment = c.alignment;
    a.num_worst_tokens = c.worst;
    a.async_finish = c.async;
    DispatchResult d = buf.dispatch(a);
    if (c.async) d.event.current_stream_wait();
    keep_dispatch(o, d, gpu, "");
    const NormalHandle& h = d.handle;
    auto host = [&](const Tensor& t) { return gpu ? to_cpu(t) : t; };
    o.t["handle.rank_prefix_matrix"] = host(h.rank_prefix_matrix);
    o.t["handle.is_token_in_rank"] = host(h.is_token_in_rank);
    o.t["handle.send_pos"] = host(h.send_pos);
    o.t["handle.recv_src_idx"] = host(h.recv_src_idx);
    o.t["handle.num_recv_tokens_per_expert"] = host(h.num_recv_tokens_per_expert);
    o.list = d.num_recv_tokens_per_expert_list;
    o.num_recv = h.num_recv_tokens;
    o.rows = h.num_recv_rows;

    if (c.cached) {
      const Tensor x2 = put(i.x2), s2 = put_scales(i.scales2);
      DispatchArgs b;
      b.x = x2;
      if (s2.defined()) b.x_scales = s2;
      b.topk_idx = idx;
      b.topk_weights = w;
      b.handle = &h;
      const DispatchResult dc = buf.dispatch(b);
      keep_dispatch(o, dc, gpu, "cached.");
    }

    // Combine inputs: made on the CPU run (rows known there), reused by the GPU run.
    if (!gpu) {
      std::mt19937_64 rng(i.seed);
      o.comb_x = Tensor::empty(DType::bf16, {h.num_recv_rows, c.H});
      gputest::fill_random(rng(), o.comb_x, 3.0f);
      if (c.combine_weights) o.comb_w = test::random_f32(rng, h.num_recv_rows, c.K, 0.0f, 1.0f);
    }
    const RankOut& src = gpu ? (*cpu_out)[static_cast<std::size_t>(r)] : o;
    const Tensor cx = put(src.comb_x), cw = put(src.comb_w), b0 = put(i.b0), b1 = put(i.b1);
    CombineArgs ca;
    ca.x = cx;
    ca.handle = &h;
    if (cw.defined()) ca.topk_weights = cw;
    if (b0.defined()) ca.bias_0 = b0;
    if (b1.defined()) ca.bias_1 = b1;
    ca.async_finish = c.async;
    const CombineResult cr = buf.combine(ca);
    if (c.async) cr.event.current_stream_wait();
    o.t["combined_x"] = host(cr.combined_x);
    if (cr.combined_topk_weights.defined()) o.t["combined_topk_weights"] = host(cr.combined_topk_weights);
    if (gpu) cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  });
  return out;
}

void check_case(const Case& c) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(c.name() + " seed " + std::to_string(seed));
  const std::vector<RankIn> in = make_inputs(c, seed);
  std::vector<RankOut> cpu = run(c, in, nullptr, false);
  const std::vector<RankOut> gpu = run(c, in, &cpu, true);
  for (int r = 0; r < test_ranks(); ++r) {
    const RankOut& want = cpu[static_cast<std::size_t>(r)];
    const RankOut& got = gpu[static_cast<std::size_t>(r)];
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(want.rows, got.rows);
    EXPECT_EQ(want.list, got.list);
    if (c.worst == 0)
      EXPECT_EQ(want.num_recv, got.num_recv);
    else
      EXPECT_EQ(got.num_recv, -1);  // known on the device only
    for (const auto& [name, t] : want.t) {
      const auto it = got.t.find(name);
      ASSERT_TRUE(it != got.t.end()) << name << " missing from the cuda_ipc results";
      if (name == "handle.recv_src_idx" && c.worst > 0) {
        // cuda_ipc keeps num_worst_tokens rows, the padding -1.
        const Tensor& g = it->second;
        ASSERT_EQ(g.numel(), c.worst);
        const auto n = t.numel();
        EXPECT_EQ(std::memcmp(t.data(), g.data(), static_cast<std::size_t>(n) * 4), 0) << name;
        for (std::int64_t j = n; j < g.numel(); ++j) EXPECT_EQ(g.ptr<std::int32_t>()[j], -1) << name << " row " << j;
        continue;
      }
      EXPECT_TRUE(gputest::same_bits(t, it->second)) << name;
    }
  }
}

TEST(GpuCudaIpcNormal, Bf16MatchesThreadsBackendAcrossSizes) {
  REQUIRE_TWO_GPUS();
  const std::vector<std::int64_t> Ts =
      gputest::quick() ? std::vector<std::int64_t>{1, 128} : std::vector<std::int64_t>{1, 128, 4096};
  for (std::int64_t T : Ts)
    for (std::int64_t H : gputest::hidden_sizes()) {
      Case c;
      c.T = {T, std::max<std::int64_t>(1, T / 2 + 3)};
      c.H = H;
      check_case(c);
    }
}

TEST(GpuCudaIpcNormal, Fp8WithFloatAndUe8m0ScalesMatches) {
  REQUIRE_TWO_GPUS();
  for (bool ue8m0 : {false, true})
    for (std::int64_t H : {std::int64_t{2880}, std::int64_t{7168}}) {
      Case c;
      c.recv_slots = ue8m0 ? 2 : 0;  // zero-copy and copy engine
      c.fp8 = true;
      c.ue8m0 = ue8m0;
      c.H = H;
      c.T = {gputest::quick() ? 128 : 4096, 100};
      check_case(c);
    }
}

// x_scales column-major (DeepGEMM's TMA-aligned layout, T not a multiple of 4) on every send path: zero-copy
// slots, copy-engine gather, SM stores, num_worst_tokens, cached. Received row-major, the threads backend's bits for
// row-major scales.
TEST(GpuCudaIpcNormal, Fp8ColumnMajorScalesMatchRowMajor) {
  REQUIRE_TWO_GPUS();
  for (bool ue8m0 : {false, true})
    for (int path = 0; path < 4; ++path) {
      Case c;
      c.fp8 = true;
      c.ue8m0 = ue8m0;
      c.H = ue8m0 ? 7168 : 2880;
      c.T = {gputest::quick() ? 131 : 1027, 37};
      c.scale_layout = ScaleLayout::column_major;
      c.recv_slots = path == 0 ? 2 : 0;
      c.copy_engine = path != 2;
      c.worst = path == 3 ? static_cast<int>(c.T[0] + c.T[1] + 5) : 0;  // every row of both ranks fits
      c.cached = path == 1;
      check_case(c);
      if (HasFailure()) return;
    }
}

TEST(GpuCudaIpcNormal, ZeroTokenRankAllMinusOneAndOneExpert) {
  REQUIRE_TWO_GPUS();
  Case zero;
  zero.T = {128, 0};
  check_case(zero);
  Case none;
  none.all_minus_one_rank = 0;
  check_case(none);
  Case every;
  every.p_minus_one = 0.0;
  every.only_expert = 200;  // on rank 1
  every.T = {128, 77};
  check_case(every);
}

TEST(GpuCudaIpcNormal, NumWorstTokensPadsLikeThreadsBackend) {
  REQUIRE_TWO_GPUS();
  for (bool fp8 : {false, true}) {
    Case c;
    c.fp8 = fp8;
    c.T = {128, 90};
    c.worst = 128 + 90 + 5;
    check_case(c);
  }
}

// One CUDA graph per rank holds the layout, a num_worst_tokens dispatch and the combine; it is replayed with new
// inputs and new routing written into the captured input tensors, and every replay matches the threads backend bit
// for bit (the op sequence number lives on the device, so replays do not reuse the captured one).
TEST(GpuCudaIpcNormal, NumWorstTokensLayoutDispatchCombineCapturedOnceAndReplayed) {
  REQUIRE_TWO_GPUS();
  Case c;
  c.T = {96, 64};
  c.worst = 96 + 64 + 3;
  constexpr int kSets = 4;  // set 0: the eager warm-up and the capture; sets 1..3: one replay each
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(c.name() + " seed " + std::to_string(seed));
  std::mt19937_64 seeds(seed);
  std::vector<std::vector<RankIn>> ins;
  std::vector<std::vector<RankOut>> want;
  for (int k = 0; k < kSets; ++k) {
    ins.push_back(make_inputs(c, seeds()));
    want.push_back(run(c, ins.back(), nullptr, false));
  }
  std::vector<std::vector<RankOut>> got(kSets, std::vector<RankOut>(test_ranks()));
  run_thread_ranks(test_ranks(), [&](Group& g) {
    const int r = g.rank();
    const auto ru = static_cast<std::size_t>(r);
    BufferOptions opts = ipc_options(r, c.worst, c.H, c.K);
    Buffer buf(borrow(g), opts);
    // The graph's inputs: fixed addresses, refilled before every replay.
    const RankIn& first = ins[0][ru];
    Tensor x = to_gpu(first.x, r), idx = to_gpu(first.idx, r), w = to_gpu(first.w, r), b0 = to_gpu(first.b0, r),
           b1 = to_gpu(first.b1, r), cx = to_gpu(want[0][ru].comb_x, r), cw = to_gpu(want[0][ru].comb_w, r);
    const auto refill = [&](int k) {
      const RankIn& i = ins[static_cast<std::size_t>(k)][ru];
      const RankOut& o = want[static_cast<std::size_t>(k)][ru];
      const std::pair<Tensor*, const Tensor*> pairs[] = {{&x, &i.x},   {&idx, &i.idx},   {&w, &i.w},     {&b0, &i.b0},
                                                         {&b1, &i.b1}, {&cx, &o.comb_x}, {&cw, &o.comb_w}};
      for (auto [dev, host] : pairs)
        cuda_ok(cudaMemcpy(dev->data(), host->data(), host->nbytes(), cudaMemcpyHostToDevice), "refill");
    };
    cudaStream_t st = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
    struct Step {
      DispatchResult d;
      CombineResult cr;
    };
    const auto step = [&] {
      StreamGuard on(Stream{st});
      const DispatchLayout layout = buf.get_dispatch_layout(idx, c.E);
      expect_capture_alive(st, "get_dispatch_layout");
      DispatchArgs a = make_dispatch_args(layout, x, idx, w);
      a.num_worst_tokens = c.worst;
      Step out;
      out.d = buf.dispatch(a);
      expect_capture_alive(st, "dispatch");
      CombineArgs ca;
      ca.x = cx;
      ca.handle = &out.d.handle;
      ca.topk_weights = cw;
      ca.bias_0 = b0;
      ca.bias_1 = b1;
      out.cr = buf.combine(ca);
      expect_capture_alive(st, "combine");
      return out;
    };
    const auto keep = [&](const Step& s, RankOut& o) {
      keep_dispatch(o, s.d, true, "");
      o.t["handle.recv_src_idx"] = to_cpu(s.d.handle.recv_src_idx);
      o.t["handle.num_recv_tokens_per_expert"] = to_cpu(s.d.handle.num_recv_tokens_per_expert);
      o.t["combined_x"] = to_cpu(s.cr.combined_x);
      o.t["combined_topk_weights"] = to_cpu(s.cr.combined_topk_weights);
    };
    keep(step(), got[0][ru]);  // eager first: first-use allocations happen outside the capture
    Step captured;
    std::string why;
    cudaGraph_t graph = capture(st, [&] { captured = step(); }, &why);
    if (!graph) {
      ADD_FAILURE() << "rank " << r << ": capture failed: " << why;
      // The peer's graph would wait for this rank's handshake: its replays are skipped too (same failure).
      cuda_ok(cudaStreamDestroy(st), "cudaStreamDestroy");
      return;
    }
    cudaGraphExec_t exec = nullptr;
    // The outputs are the graph's own allocations, kept past each launch: each launch frees and re-allocates them
    // at the same addresses.
    cuda_ok(cudaGraphInstantiateWithFlags(&exec, graph, cudaGraphInstantiateFlagAutoFreeOnLaunch), "instantiate");
    for (int k = 1; k < kSets; ++k) {
      refill(k);
      cuda_ok(cudaGraphLaunch(exec, st), "cudaGraphLaunch");
      cuda_ok(cudaStreamSynchronize(st), "replay");
      keep(captured, got[static_cast<std::size_t>(k)][ru]);
      // Poisoned after reading: a replay that wrote nothing would fail the next comparison.
      gputest::poison(captured.d.recv_x);
      gputest::poison(captured.cr.combined_x);
      cuda_ok(cudaDeviceSynchronize(), "poison");
    }
    {
      StreamGuard on(Stream{st});  // the graph's allocations are returned on the stream that replayed it
      captured = Step{};
    }
    cuda_ok(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
    cuda_ok(cudaGraphDestroy(graph), "cudaGraphDestroy");
    cuda_ok(cudaStreamSynchronize(st), "sync");
    cuda_ok(cudaStreamDestroy(st), "cudaStreamDestroy");
  });
  for (int k = 0; k < kSets; ++k)
    for (int r = 0; r < test_ranks(); ++r) {
      SCOPED_TRACE("set " + std::to_string(k) + (k == 0 ? " (eager)" : " (graph replay)") + ", rank " +
                   std::to_string(r));
      const RankOut& w = want[static_cast<std::size_t>(k)][static_cast<std::size_t>(r)];
      const RankOut& g = got[static_cast<std::size_t>(k)][static_cast<std::size_t>(r)];
      for (const auto& [name, t] : g.t) {
        const auto it = w.t.find(name);
        ASSERT_TRUE(it != w.t.end()) << name;
        if (name == "handle.recv_src_idx") {  // num_worst_tokens rows here, the received ones in the threads run
          const auto n = it->second.numel();
          EXPECT_EQ(std::memcmp(it->second.data(), t.data(), static_cast<std::size_t>(n) * 4), 0) << name;
          for (std::int64_t j = n; j < t.numel(); ++j) EXPECT_EQ(t.ptr<std::int32_t>()[j], -1) << name << " row " << j;
          continue;
        }
        EXPECT_TRUE(gputest::same_bits(it->second, t)) << name;
      }
    }
}

// A dispatch without num_worst_tokens reads the counts on the host: refused while the stream captures a graph,
// before any communication (the buffer stays usable).
TEST(GpuCudaIpcNormal, DispatchWithoutNumWorstTokensIsRefusedUnderCapture) {
  REQUIRE_TWO_GPUS();
  run_thread_ranks(test_ranks(), [&](Group& g) {
    const int r = g.rank();
    BufferOptions opts = ipc_options(r, 64, 2048, 8);
    Buffer buf(borrow(g), opts);
    std::mt19937_64 rng(test::fresh_seed());
    cudaStream_t st = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
    {
      StreamGuard on(Stream{st});  // every tensor below is released before the stream is destroyed
      const Tensor idx = to_gpu(test::random_topk_idx(rng, 64, 8, 256, {}), r);
      const Tensor x = to_gpu(random_x(rng, 64, 2048, false), r);
      const DispatchLayout layout = buf.get_dispatch_layout(idx, 256);
      const DispatchArgs a = make_dispatch_args(layout, x, idx);
      std::string why;
      cudaGraph_t graph = capture(st, [&] { (void)buf.dispatch(a); }, &why);
      if (graph) {
        cudaGraphDestroy(graph);
        ADD_FAILURE() << "dispatch without num_worst_tokens was captured";
      }
      EXPECT_NE(why.find("num_worst_tokens"), std::string::npos) << why;
      (void)buf.dispatch(a);  // still usable, eagerly
      cuda_ok(cudaStreamSynchronize(st), "sync");
    }
    cuda_ok(cudaDeviceSynchronize(), "sync");
    cuda_ok(cudaStreamDestroy(st), "cudaStreamDestroy");
  });
}

// With the default copy_engine_min_rows (1024) a rank with fewer tokens enqueues its staging only after the count
// exchange chose the copy-engine path (the other rank stages before the host read); a small batch takes the
// SM-store path on every rank. Fresh and cached dispatch.
TEST(GpuCudaIpcNormal, StagingBeforeOrAfterTheHostReadAndTheDefaultPathChoice) {
  REQUIRE_TWO_GPUS();
  for (bool cached : {false, true}) {
    Case late;
    late.recv_slots = 0;
    late.ce_min_rows = 1024;
    late.T = {1100, 60};  // rank 0 sends rank 1 >= 1024 rows: the copy-engine path; rank 1 stages late
    late.cached = cached;
    check_case(late);
    Case small;
    small.recv_slots = 0;
    small.ce_min_rows = 1024;
    small.T = {300, 200};  // nobody moves 1024 rows: SM stores
    small.cached = cached;
    check_case(small);
    // Rank 0 has 1024 tokens, so it stages before the count exchange, but sends rank 1 only ~200 rows (most ids
    // -1): the exchange chooses SM stores, whose send kernels meet first (rank 0's staging wrote its region).
    Case staged_then_sm = small;
    staged_then_sm.T = {1100, 60};
    staged_then_sm.p_minus_one = 0.95;
    check_case(staged_then_sm);
    Case nothing_staged = small;  // ... or none at all: one rank-0 expert takes every token
    nothing_staged.T = {1100, 60};
    nothing_staged.only_expert = 3;
    check_case(nothing_staged);
  }
}

TEST(GpuCudaIpcNormal, CachedDispatchMovesNewRows) {
  REQUIRE_TWO_GPUS();
  for (bool fp8 : {false, true}) {
    Case c;
    c.fp8 = fp8;
    c.ue8m0 = fp8;
    c.cached = true;
    c.T = {200, 130};
    check_case(c);
  }
}

TEST(GpuCudaIpcNormal, Int32IdsAlignmentAsyncAndSmallK) {
  REQUIRE_TWO_GPUS();
  Case c;
  c.int32_idx = true;
  c.alignment = 16;
  c.async = true;
  c.T = {256, 300};
  check_case(c);
  Case k1;
  k1.K = 1;
  k1.E = 64;
  k1.bias = false;
  k1.combine_weights = false;
  check_case(k1);
  Case k32;
  k32.K = 32;
  k32.E = 64;
  k32.H = 2880;
  check_case(k32);
}

TEST(GpuCudaIpcNormal, CopyEngineAndSmStoreOpsInterleavedOnOneBuffer) {
  REQUIRE_TWO_GPUS();
  // Copy-engine dispatches stage into alternating halves of the region before their count exchange; SM-store ops
  // and combines use the whole region. Interleave them (two dispatches outstanding, combines in another order).
  const std::uint64_t seed = test::fresh_seed();
  // With one receive slot, zero-copy dispatches join the mix: a dispatch whose previous result still holds the
  // slot takes the copy-engine or SM-store path.
  Case big, small;
  big.T = {512, 384};  // >= copy_engine_min_rows: copy engine
  big.ce_min_rows = 300;
  small.T = {64, 48};  // SM stores
  small.ce_min_rows = 300;
  const std::vector<RankIn> in_big = make_inputs(big, seed), in_small = make_inputs(small, seed + 1);
  const std::vector<RankOut> ref_big = run(big, in_big, nullptr, false);
  const std::vector<RankOut> ref_small = run(small, in_small, nullptr, false);
  for (int slots : {0, 1}) {
    run_thread_ranks(test_ranks(), [&](Group& g) {
      const int r = g.rank();
      const std::size_t ur = static_cast<std::size_t>(r);
      BufferOptions o = ipc_options(r, 512, big.H, big.K);
      o.copy_engine_min_rows = 300;
      o.num_recv_slots = slots;
      Buffer buf(borrow(g), o);
      struct Op {
        Tensor x, idx, w, cx, cw, b0, b1;
        DispatchResult d;
      };
      const auto prepare = [&](const RankIn& i, const RankOut& ref) {
        Op op;
        op.x = to_gpu(i.x, r);
        op.idx = to_gpu(i.idx, r);
        op.w = to_gpu(i.w, r);
        op.cx = to_gpu(ref.comb_x, r);
        op.cw = to_gpu(ref.comb_w, r);
        op.b0 = to_gpu(i.b0, r);
        op.b1 = to_gpu(i.b1, r);
        return op;
      };
      const auto dispatch = [&](Op& op, int E) {
        const DispatchLayout layout = buf.get_dispatch_layout(op.idx, E);
        op.d = buf.dispatch(make_dispatch_args(layout, op.x, op.idx, op.w));
      };
      const auto combine = [&](const Op& op) {
        CombineArgs ca;
        ca.x = op.cx;
        ca.handle = &op.d.handle;
        ca.topk_weights = op.cw;
        ca.bias_0 = op.b0;
        ca.bias_1 = op.b1;
        return buf.combine(ca);
      };
      const auto expect = [&](const char* what, const Tensor& want, const Tensor& got, int round) {
        if (!gputest::same_bits(want, to_cpu(got)))
          throw std::runtime_error("rank " + std::to_string(r) + " slots " + std::to_string(slots) + " round " +
                                   std::to_string(round) + ": " + what +
                                   " differs (seed " + std::to_string(seed) + ")");
      };
      Op b = prepare(in_big[ur], ref_big[ur]), sm = prepare(in_small[ur], ref_small[ur]);
      for (int round = 0; round < 3; ++round) {
        dispatch(b, big.E);        // copy engine
        dispatch(sm, small.E);     // SM stores, the big dispatch's rows still in the region
        const CombineResult cb = combine(b);    // copy engine right after an SM-store op
        const CombineResult cs = combine(sm);   // SM stores after a copy-engine op
        expect("big recv_x", ref_big[ur].t.at("recv_x"), b.d.recv_x, round);
        expect("small recv_x", ref_small[ur].t.at("recv_x"), sm.d.recv_x, round);
        expect("big combined_x", ref_big[ur].t.at("combined_x"), cb.combined_x, round);
        expect("small combined_x", ref_small[ur].t.at("combined_x"), cs.combined_x, round);
        dispatch(b, big.E);                     // a copy-engine dispatch after a combine
        dispatch(b, big.E);                     // ... and right after another one: the other half
        const CombineResult cb2 = combine(b);
        expect("big recv_x (2)", ref_big[ur].t.at("recv_x"), b.d.recv_x, round);
        expect("big combined_x (2)", ref_big[ur].t.at("combined_x"), cb2.combined_x, round);
      }
    });
  }
}

TEST(GpuCudaIpcNormal, ZeroCopyOutputsLiveInReceiveSlotsUntilDropped) {
  REQUIRE_TWO_GPUS();
  // One receive slot per rank. The zero-copy dispatch's recv_x lives in the slot (the same address each time the
  // slot is free); a dispatch while some rank's slot is held falls back on every rank, and the outputs outlive the
  // buffer. Every result is compared with the threads backend.
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Case c;
  c.T = {300, 200};
  const std::vector<RankIn> in = make_inputs(c, seed);
  const std::vector<RankOut> cpu = run(c, in, nullptr, false);
  std::vector<Tensor> kept(test_ranks());
  run_thread_ranks(test_ranks(), [&](Group& g) {
    const int r = g.rank();
    const std::size_t ur = static_cast<std::size_t>(r);
    BufferOptions o = ipc_options(r, 300, c.H, c.K);
    o.num_recv_slots = 1;
    o.copy_engine_min_rows = 0;  // the fallback takes the copy-engine path
    Buffer buf(borrow(g), o);
    const RankIn& i = in[ur];
    const RankOut& ref = cpu[ur];
    const Tensor x = to_gpu(i.x, r), idx = to_gpu(i.idx, r), w = to_gpu(i.w, r), cx = to_gpu(ref.comb_x, r),
                 cw = to_gpu(ref.comb_w, r), b0 = to_gpu(i.b0, r), b1 = to_gpu(i.b1, r);
    const auto fail = [&](const std::string& what) {
      throw std::runtime_error("rank " + std::to_string(r) + ": " + what + " (seed " + std::to_string(seed) + ")");
    };
    const auto dispatch_and_check = [&](const char* what) {
      const DispatchLayout layout = buf.get_dispatch_layout(idx, c.E);
      DispatchResult d = buf.dispatch(make_dispatch_args(layout, x, idx, w));
      if (!gputest::same_bits(ref.t.at("recv_x"), to_cpu(d.recv_x)) ||
          !gputest::same_bits(ref.t.at("recv_topk_idx"), to_cpu(d.recv_topk_idx)) ||
          !gputest::same_bits(ref.t.at("recv_topk_weights"), to_cpu(d.recv_topk_weights)) ||
          !gputest::same_bits(ref.t.at("handle.recv_src_idx"), to_cpu(d.handle.recv_src_idx)))
        fail(std::string(what) + ": dispatch differs");
      CombineArgs ca;
      ca.x = cx;
      ca.handle = &d.handle;
      ca.topk_weights = cw;
      ca.bias_0 = b0;
      ca.bias_1 = b1;
      if (!gputest::same_bits(ref.t.at("combined_x"), to_cpu(buf.combine(ca).combined_x)))
        fail(std::string(what) + ": combine differs");
      return d;
    };
    DispatchResult first = dispatch_and_check("first (zero-copy)");
    void* const slot = first.recv_x.data();
    {
      const DispatchResult second = dispatch_and_check("second (slot held: fallback)");
      if (second.recv_x.data() == slot) fail("the second dispatch wrote into the held slot");
    }
    first = {};  // frees the slot
    DispatchResult third = dispatch_and_check("third (zero-copy again)");
    if (third.recv_x.data() != slot) fail("the third dispatch did not reuse the freed slot");
    if (r == 1) third = {};  // rank 0 keeps its slot: the next dispatch falls back on both ranks
    const DispatchResult fourth = dispatch_and_check("fourth (a peer's slot held: fallback)");
    if (fourth.recv_x.data() == slot) fail("the fourth dispatch took the zero-copy path without every rank's slot");
    kept[ur] = fourth.recv_x;
    if (r == 0) kept[ur] = third.recv_x;
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  });
  // The buffers are gone; rank 0's zero-copy recv_x still holds its slot's memory.
  for (int r = 0; r < test_ranks(); ++r)
    EXPECT_TRUE(gputest::same_bits(cpu[static_cast<std::size_t>(r)].t.at("recv_x"),
                                   to_cpu(kept[static_cast<std::size_t>(r)])))
        << "rank " << r;
  kept.clear();
}

TEST(GpuCudaIpcNormal, RepeatedCallsReuseTheBuffer) {
  REQUIRE_TWO_GPUS();
  // Several dispatch/combine rounds on one buffer: the handshake must keep the data region safe.
  const std::uint64_t seed = test::fresh_seed();
  Case c;
  c.T = {512, 384};
  const std::vector<RankIn> in = make_inputs(c, seed);
  std::vector<RankOut> cpu = run(c, in, nullptr, false);
  for (int slots : {0, 1}) {
    run_thread_ranks(test_ranks(), [&](Group& g) {
      const int r = g.rank();
      BufferOptions o = ipc_options(r, 512, c.H, c.K);
      o.num_sms = 4;
      o.num_recv_slots = slots;  // one slot: every round's zero-copy dispatch reuses the one the last round freed
      Buffer buf(borrow(g), o);
      const RankIn& i = in[static_cast<std::size_t>(r)];
      const Tensor x = to_gpu(i.x, r), idx = to_gpu(i.idx, r), w = to_gpu(i.w, r);
      const Tensor cx = to_gpu(cpu[static_cast<std::size_t>(r)].comb_x, r);
      const Tensor b0 = to_gpu(i.b0, r), b1 = to_gpu(i.b1, r), cw = to_gpu(cpu[static_cast<std::size_t>(r)].comb_w, r);
      for (int round = 0; round < 5; ++round) {
        const DispatchLayout layout = buf.get_dispatch_layout(idx, c.E);
        const DispatchResult d = buf.dispatch(make_dispatch_args(layout, x, idx, w));
        CombineArgs ca;
        ca.x = cx;
        ca.handle = &d.handle;
        ca.topk_weights = cw;
        ca.bias_0 = b0;
        ca.bias_1 = b1;
        const CombineResult cr = buf.combine(ca);
        const Tensor got_x = to_cpu(d.recv_x), got_c = to_cpu(cr.combined_x);
        const RankOut& ref = cpu[static_cast<std::size_t>(r)];
        if (!gputest::same_bits(ref.t.at("recv_x"), got_x) || !gputest::same_bits(ref.t.at("combined_x"), got_c))
          throw std::runtime_error("rank " + std::to_string(r) + " slots " + std::to_string(slots) + " round " +
                                   std::to_string(round) + " differs (seed " + std::to_string(seed) + ")");
      }
    });
  }
}

TEST(GpuCudaIpcNormal, RejectsHostTensorsBeforeAnyCommunication) {
  REQUIRE_TWO_GPUS();
  const auto errors = run_thread_ranks_collect(test_ranks(), [&](Group& g) {
    const int r = g.rank();
    BufferOptions o = ipc_options(r, 16, 128, 4);
    Buffer buf(borrow(g), o);
    std::mt19937_64 rng(test::fresh_seed());
    const Tensor x = test::random_bf16(rng, 16, 128);  // host memory: rejected
    const Tensor idx = test::random_topk_idx(rng, 16, 4, 16);
    const DispatchLayout layout = get_dispatch_layout(idx, 16, test_ranks());
    buf.dispatch(make_dispatch_args(layout, x, idx));
  });
  for (int r = 0; r < test_ranks(); ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)] != nullptr) << "rank " << r;
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find("x"), std::string::npos) << e.what();
    }
  }
}

TEST(GpuCudaIpcNormal, SmStorePathMatchesThreadsBackend) {
  REQUIRE_TWO_GPUS();
  // The path num_worst_tokens always takes, forced for the default (host-read) dispatch too.
  for (bool fp8 : {false, true})
    for (std::int64_t T : {std::int64_t{1}, std::int64_t{gputest::quick() ? 256 : 4096}}) {
      Case c;
      c.copy_engine = false;
      c.recv_slots = 0;
      c.fp8 = fp8;
      c.cached = true;
      c.T = {T, T / 3 + 1};
      c.H = 2880;
      check_case(c);
    }
}

TEST(GpuCudaIpcNormal, CopyEngineWithSkewedRoutingAndSmallK) {
  REQUIRE_TWO_GPUS();
  // K = 2 and one hot expert: few tokens go to both ranks, runs are ragged (a copy-everything design fails).
  for (int K : {1, 2}) {
    Case c;
    c.recv_slots = 0;
    c.K = K;
    c.T = {gputest::quick() ? 300 : 3000, 777};
    c.H = 4096;
    c.p_minus_one = 0.3;
    check_case(c);
  }
  Case hot;
  hot.recv_slots = 0;
  hot.only_expert = 200;  // every token to rank 1's expert: rank 0 receives nothing
  hot.T = {1000, 10};
  check_case(hot);
}

TEST(GpuCudaIpcNormal, CopyEngineCombineWithSmPushesMatches) {
  REQUIRE_TWO_GPUS();
  // The copy-engine combine's pushes by one SM-store kernel (per-stage counters) instead of cudaMemcpyAsync.
  for (int chunks : {1, 4}) {
    Case c;
    c.recv_slots = 0;
    c.combine_sm_push = true;
    c.chunks = chunks;
    c.T = {gputest::quick() ? 300 : 2000, 555};
    c.fp8 = chunks == 4;
    c.cached = chunks == 4;
    check_case(c);
  }
}

TEST(GpuCudaIpcNormal, CopyEngineStagesFromOneToSixteenIncludingEmptyOnes) {
  REQUIRE_TWO_GPUS();
  // Runs shorter than the stage count leave stages empty: their flags must still be published and awaited.
  for (int chunks : {1, 3, 16})
    for (std::int64_t T : {std::int64_t{5}, std::int64_t{700}}) {
      Case c;
      c.recv_slots = 0;
      c.chunks = chunks;
      c.T = {T, T + 2};
      c.fp8 = chunks == 3;
      c.cached = true;
      check_case(c);
    }
}

TEST(GpuCudaIpcNormal, RealOlmoeRoutingAndLargeBatchesMatch) {
  REQUIRE_TWO_GPUS();
  // Recorded OLMoE routing (skewed, semantics §14) on the three paths (zero-copy, copy engine, SM stores), then
  // T = 16384 per rank (quick mode: 2048).
  for (int path = 0; path < 3; ++path) {
    Case c;
    c.olmoe = true;
    c.K = 8;
    c.E = 256;
    c.T = {1024, 777};
    c.H = 4096;
    c.recv_slots = path == 0 ? 2 : 0;
    c.copy_engine = path != 2;
    c.cached = true;
    check_case(c);
  }
  for (int slots : {2, 0}) {
    Case big;
    const std::int64_t T = gputest::quick() ? 2048 : 16384;
    big.T = {T, T};
    big.H = 2048;
    big.bias = false;
    big.recv_slots = slots;
    check_case(big);
  }
}

TEST(GpuCudaIpcNormal, MismatchedHiddenIsReportedByEveryRank) {
  REQUIRE_TWO_GPUS();
  // Settings are compared in-band by the count exchange: every rank raises, naming the setting and both values,
  // and the buffer stays usable for a correct call.
  const auto errors = run_thread_ranks_collect(test_ranks(), [&](Group& g) {
    const int r = g.rank();
    BufferOptions o = ipc_options(r, 64, 4096, 4);
    Buffer buf(borrow(g), o);
    std::mt19937_64 rng(test::fresh_seed());
    const Tensor idx = to_gpu(test::random_topk_idx(rng, 64, 4, 16), r);
    const DispatchLayout layout = buf.get_dispatch_layout(idx, 16);
    DispatchArgs a = make_dispatch_args(layout, {}, idx);
    const Tensor bad = to_gpu(test::random_bf16(rng, 64, r == 0 ? 2048 : 4096), r);
    a.x = bad;
    std::string message;
    try {
      buf.dispatch(a);
    } catch (const Error& e) {
      message = e.what();
      if (e.code() != ErrorCode::invalid_argument) throw;
    }
    if (message.find("'hidden' differs across ranks") == std::string::npos ||
        message.find("2048") == std::string::npos || message.find("4096") == std::string::npos)
      throw std::runtime_error("rank " + std::to_string(r) + ": unexpected error message: '" + message + "'");
    const Tensor good = to_gpu(test::random_bf16(rng, 64, 4096), r);
    a.x = good;
    const DispatchResult d = buf.dispatch(a);
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (d.recv_x.size(1) != 4096) throw std::runtime_error("second dispatch failed");
  });
  for (int r = 0; r < test_ranks(); ++r) {
    if (!errors[static_cast<std::size_t>(r)]) continue;
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << ": " << e.what();
    }
  }
}

TEST(GpuCudaIpcNormal, DeviceTimeoutNamesRankPeerAndPhaseAndMarksTheBufferUnusable) {
  REQUIRE_TWO_GPUS();
  // Rank 1 never joins the dispatch: rank 0's count exchange spins until the group's timeout (1 s here), records
  // (rank, peer, phase) in host-mapped memory and exits; the host raises timeout, later calls raise unusable.
  // Rank 1 keeps its buffer (which rank 0 writes into) alive until rank 0 is done.
  std::atomic<bool> rank0_done{false};
  const auto errors = run_thread_ranks_collect(
      test_ranks(),
      [&](Group& g) {
        const int r = g.rank();
        BufferOptions o = ipc_options(r, 64, 2048, 4);
        Buffer buf(borrow(g), o);
        if (r == 1) {
          while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return;
        }
        struct Done {
          std::atomic<bool>& flag;
          ~Done() { flag.store(true); }
        } done{rank0_done};
        std::mt19937_64 rng(test::fresh_seed());
        const Tensor idx = to_gpu(test::random_topk_idx(rng, 64, 4, 16), r);
        const Tensor x = to_gpu(test::random_bf16(rng, 64, 2048), r);
        const DispatchLayout layout = buf.get_dispatch_layout(idx, 16);
        const DispatchArgs a = make_dispatch_args(layout, x, idx);
        std::string first, second;
        try {
          buf.dispatch(a);
        } catch (const Error& e) {
          if (e.code() != ErrorCode::timeout) throw;
          first = e.what();
        }
        try {
          buf.dispatch(a);
        } catch (const Error& e) {
          if (e.code() != ErrorCode::unusable) throw;
          second = e.what();
        }
        if (first.find("rank 1") == std::string::npos || first.find("dispatch count exchange") == std::string::npos)
          throw std::runtime_error("timeout message lacks peer or phase: '" + first + "'");
        if (second.empty()) throw std::runtime_error("the buffer stayed usable after a device timeout");
      },
      1.0);
  for (int r = 0; r < test_ranks(); ++r) {
    if (!errors[static_cast<std::size_t>(r)]) continue;
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << ": " << e.what();
    }
  }
}

TEST(GpuCudaIpcNormal, SizeHintCoversTheWorstCase) {
  // Hand-made: R * T rows of a bf16 dispatch row (2H + 12K + 4 bytes) plus 80 bytes of field alignment.
  // Every rank's rows (SM stores), or twice the rows staged for the peers (copy engine), whichever is more.
  EXPECT_EQ(Buffer::get_normal_nvl_size_hint(4096, 7168, 2, 8), 4096LL * 2 * (2 * 7168 + 12 * 8 + 4) + 192);
  EXPECT_EQ(Buffer::get_normal_nvl_size_hint(4096, 7168, 8, 8), 4096LL * 14 * (2 * 7168 + 12 * 8 + 4) + 192);
  EXPECT_EQ(Buffer::get_normal_nvl_size_hint(0, 7168, 2, 8), 192);
}

}  // namespace
}  // namespace epmoe
