// Overlapped low-latency combine on GPU ranks (docs/semantics.md "Overlapped low-latency combine"), R = thread_ranks()
// (rank r on cuda:r; R = 1 sends to itself):
//  - the cuda_ipc combine with comp_signal (per block) or src_signals (per expert), the expert outputs copied into a
//    NaN-filled x on another stream after a host delay and each block signalled after its rows: combined_x bit for
//    bit the independent reference's (tests/support/low_latency_reference) of the real outputs;
//  - a block never signalled: the next call raises timeout naming the rank, the expert, the block and the phase;
//  - the MoE layer with MoELayerOptions::overlap (CUDA experts signalling after each expert's down GEMM, the send on
//    the layer's side stream): bit-identical to the same layer without overlap, and within semantics §13 of the
//    float64 reference and of the CPU ranks.
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/stream.hpp>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/gpu_util.hpp"
#include "gpu/moe_layer_test_util.hpp"
#include "support/low_latency_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::borrow;
using gputest::cuda_ok;
using gputest::to_cpu;
using gputest::to_gpu;

int num_ranks() { return gputest::thread_ranks(); }

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

void CUDART_CB sleep_host(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<std::intptr_t>(ms)));
}

struct Inputs {
  std::vector<test::LowLatencyRankInput> in;
  std::vector<Tensor> y;  // host bf16 [E_local, R * Tmax, H] per rank: the experts' outputs
  std::vector<Tensor> want;
};

constexpr int kTmax = 32, kBlockM = 8, kBlockN = 512;
constexpr std::int64_t kH = 2048;

Inputs make_inputs(int R, int E, int K, std::uint64_t seed, const test::RoutingOptions& routing = {}) {
  std::mt19937_64 rng(seed);
  Inputs s;
  for (int r = 0; r < R; ++r) {
    const std::int64_t T = r == 1 ? 0 : kTmax - 3 * r;  // rank 1 sends nothing
    test::LowLatencyRankInput i;
    i.x = test::random_bf16(rng, T, kH, 3.0f);
    i.topk_idx = test::random_topk_idx(rng, T, K, E, routing);
    i.topk_weights = test::random_topk_weights(rng, i.topk_idx);
    s.in.push_back(i);
    Tensor flat = test::random_bf16(rng, (E / R) * R * kTmax, kH, 2.0f);
    s.y.push_back(flat);
  }
  const auto layout = test::reference_low_latency_dispatch(s.in, E);
  std::vector<Tensor> y3;
  for (const Tensor& f : s.y)
    y3.push_back(Tensor::wrap(TensorView(f.data(), DType::bf16, {E / R, R * kTmax, kH}), nullptr));
  s.want = test::reference_low_latency_combine(s.in, layout, y3, E);
  return s;
}

// One rank's overlapped combine: x starts as NaN; on a producer stream, after `delay_ms` on the host, each expert's
// rows are copied in and then its blocks' signals set (`skip_expert` >= 0: that expert's block 0 never is).
Tensor overlapped_combine(Buffer& buf, const Inputs& s, int r, int E, bool per_expert, int delay_ms,
                          int skip_expert = -1) {
  const int R = buf.num_ranks(), El = E / R;
  const std::int64_t rows = static_cast<std::int64_t>(R) * kTmax, bpe = ceil_div(rows, kBlockM);
  const test::LowLatencyRankInput& in = s.in[static_cast<std::size_t>(r)];
  const Tensor x = to_gpu(in.x, r), idx = to_gpu(in.topk_idx, r), w = to_gpu(in.topk_weights, r);
  LowLatencyDispatchArgs da;
  da.x = x;
  da.topk_idx = idx;
  da.topk_weights = w;
  da.num_max_dispatch_tokens_per_rank = kTmax;
  da.num_experts = E;
  da.use_fp8 = false;
  const LowLatencyDispatchResult d = buf.low_latency_dispatch(da);
  const Tensor y = to_gpu(s.y[static_cast<std::size_t>(r)], r);
  Tensor xin = Tensor::empty(DType::bf16, {El, rows, kH}, Device::cuda(r));
  cuda_ok(cudaMemset(xin.data(), 0xff, xin.nbytes()), "NaN fill");
  Tensor sig = per_expert ? Tensor::empty(DType::uint32, {El}, Device::cuda(r))
                          : Tensor::empty(DType::int32, {El * bpe}, Device::cuda(r));
  cuda_ok(cudaMemset(sig.data(), 0, sig.nbytes()), "zero signals");
  cuda_ok(cudaDeviceSynchronize(), "sync");
  LowLatencyCombineArgs ca;
  ca.x = xin;
  ca.topk_idx = idx;
  ca.topk_weights = w;
  ca.handle = &d.handle;
  ca.overlap = true;
  if (per_expert) {
    ca.src_signals = sig;
    ca.src_signal_expect_value = 1;
  } else {
    ca.comp_signal = sig;
    ca.packed_recv_count = d.packed_recv_count;
    ca.block_m = kBlockM;
    ca.threshold = static_cast<int>(ceil_div(kH, kBlockN));
    ca.num_sms = 2;
  }
  const LowLatencyCombineResult res = buf.low_latency_combine(ca);  // the send now spins on the device
  cudaStream_t producer;
  cuda_ok(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), "stream");
  cuda_ok(cudaLaunchHostFunc(producer, sleep_host, reinterpret_cast<void*>(static_cast<std::intptr_t>(delay_ms))),
          "delay");
  std::vector<std::int32_t> done(static_cast<std::size_t>(El * bpe), ca.threshold);
  std::vector<std::uint32_t> one(static_cast<std::size_t>(El), 1u);
  for (int e = 0; e < El; ++e) {
    const std::size_t slab = static_cast<std::size_t>(rows * kH) * 2;
    cuda_ok(cudaMemcpyAsync(static_cast<char*>(xin.data()) + e * slab, static_cast<const char*>(y.data()) + e * slab,
                            slab, cudaMemcpyDeviceToDevice, producer),
            "rows");
    if (per_expert) {
      if (e != skip_expert)
        cuda_ok(cudaMemcpyAsync(sig.ptr<std::uint32_t>() + e, &one[static_cast<std::size_t>(e)], 4,
                                cudaMemcpyHostToDevice, producer),
                "signal");
    } else {
      const std::int64_t first = e == skip_expert ? 1 : 0;
      cuda_ok(cudaMemcpyAsync(sig.ptr<std::int32_t>() + e * bpe + first, done.data(), (bpe - first) * 4,
                              cudaMemcpyHostToDevice, producer),
              "signals");
    }
  }
  cuda_ok(cudaStreamSynchronize(producer), "producer");
  cuda_ok(cudaDeviceSynchronize(), "combine");
  cuda_ok(cudaStreamDestroy(producer), "stream");
  return to_cpu(res.combined_x);
}

TEST(GpuLowLatencyOverlap, CombineWaitingOnDeviceSignalsMatchesTheReferenceBitForBit) {
  const int R = num_ranks();
  if (R == 0) GTEST_SKIP() << "no GPU";
  const int E = 4 * R;
  for (bool per_expert : {false, true}) {
    for (int K : {1, 4}) {
      const std::uint64_t seed = test::fresh_seed();
      const Inputs s = make_inputs(R, E, K, seed);
      std::vector<Tensor> got(static_cast<std::size_t>(R));
      run_thread_ranks(R, [&](Group& g) {
        const int r = g.rank();
        cuda_ok(cudaSetDevice(r), "cudaSetDevice");
        BufferOptions bo;
        bo.backend = Backend::cuda_ipc;
        bo.device = r;
        bo.low_latency_mode = true;
        Buffer buf(borrow(g), bo);
        got[static_cast<std::size_t>(r)] = overlapped_combine(buf, s, r, E, per_expert, 20);
      });
      for (int r = 0; r < R; ++r) {
        const Tensor& a = got[static_cast<std::size_t>(r)];
        const Tensor& b = s.want[static_cast<std::size_t>(r)];
        ASSERT_EQ(a.shape(), b.shape());
        EXPECT_EQ(gputest::first_difference(a.data(), b.data(), a.nbytes()), -1)
            << "rank " << r << (per_expert ? " src_signals" : " comp_signal") << " K=" << K << " seed " << seed;
      }
    }
  }
}

TEST(GpuLowLatencyOverlap, SignalThatNeverArrivesIsATimeoutNamingExpertBlockAndPhase) {
  const int R = num_ranks();
  if (R == 0) GTEST_SKIP() << "no GPU";
  const int E = 4 * R;
  for (bool per_expert : {false, true}) {
    test::RoutingOptions to_zero;
    to_zero.only_expert = 0;  // every token's first choice: rank 0's local expert 0 holds rows
    const Inputs s = make_inputs(R, E, 4, test::fresh_seed(), to_zero);
    run_thread_ranks(R, [&](Group& g) {
      const int r = g.rank();
      cuda_ok(cudaSetDevice(r), "cudaSetDevice");
      g.set_timeout_s(1.0);  // read by the low-latency mode at its first call
      BufferOptions bo;
      bo.backend = Backend::cuda_ipc;
      bo.device = r;
      bo.low_latency_mode = true;
      Buffer buf(borrow(g), bo);
      (void)overlapped_combine(buf, s, r, E, per_expert, 0, r == 0 ? 0 : -1);
      g.set_timeout_s(60.0);
      std::string what;
      ErrorCode code = ErrorCode::internal;
      try {
        buf.clean_low_latency_buffer(kTmax, kH, E);
      } catch (const Error& e) {
        what = e.what();
        code = e.code();
      }
      if (r == 0) {
        EXPECT_EQ(code, ErrorCode::timeout) << what;
        EXPECT_NE(what.find("overlap signal"), std::string::npos) << what;
        EXPECT_NE(what.find("local expert 0"), std::string::npos) << what;
        if (!per_expert) EXPECT_NE(what.find("block 0"), std::string::npos) << what;
      } else {  // the peers' receives saw rank 0's marked header
        EXPECT_EQ(code, ErrorCode::timeout) << what;
        EXPECT_NE(what.find("rank 0 timed out"), std::string::npos) << what;
      }
    });
  }
}

// The layer with and without MoELayerOptions::overlap on the GPU ranks, and on the CPU ranks (BLAS) for check_layer_case.
struct Case : gputest::LayerCase {
  int E = 16, tmax = 32;
  bool overlap = true;
  Case() {
    K = 4;
    forwards = 3;
  }
  std::string name() const {
    return "T=[" + std::to_string(T[0]) + "," + std::to_string(T[1]) + "] H=" + std::to_string(H) +
           " K=" + std::to_string(K) + (overlap ? " overlap" : " plain");
  }
};

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
      bo.low_latency_mode = true;
    }
    auto buffer = std::make_shared<Buffer>(borrow(g), bo);
    ExpertsConfig ec;
    ec.format = ActivationFormat::batched_experts;
    std::shared_ptr<Experts> experts(gpu ? make_cuda_experts(ec) : make_blas_experts(ec));
    MoELayerOptions lo;
    lo.overlap = c.overlap;
    lo.overlap_num_sms = 4;
    MoELayer layer(make_low_latency_prepare_finalize(buffer, c.tmax, c.options()), experts, {}, lo);
    const gputest::ExpertWeights w = gputest::rank_weights(m, r, El, gpu);
    for (int f = 0; f < c.forwards; ++f)
      outs[ru].push_back(gputest::forward_checked(layer, c, c.name(), in[ru][static_cast<std::size_t>(f)], w, c.E, r,
                                                  gpu, /*give_output=*/f != 1));
    if (gpu) cuda_ok(cudaDeviceSynchronize(), "sync");
  });
  return outs;
}

TEST(GpuLowLatencyOverlap, LayerWithOverlapIsBitIdenticalToWithoutAndMatchesFloat64) {
  const int R = num_ranks();
  if (R == 0) GTEST_SKIP() << "no GPU";
  for (std::int64_t H : {std::int64_t{2048}, std::int64_t{7168}}) {
    Case c;
    c.H = H;
    c.T = {24, 0};
    const std::uint64_t seed = test::fresh_seed();
    const auto run = [&](const gputest::ExpertWeights& m, const gputest::Ins& in, int n, bool gpu) {
      return run_layer(c, m, in, n, gpu);
    };
    gputest::check_layer_case(c, c.name(), seed, [&](int) { return c.E; }, run, 50);
    // The same inputs with and without overlap on the GPU ranks: the same bits.
    std::mt19937_64 rng(seed);
    const gputest::ExpertWeights m = gputest::make_expert_weights(rng, c.E, c.H, c.N);
    const gputest::Ins in = gputest::make_inputs(rng, c, R, c.E);
    const gputest::Outs with = run_layer(c, m, in, R, true);
    Case plain = c;
    plain.overlap = false;
    const gputest::Outs without = run_layer(plain, m, in, R, true);
    for (int r = 0; r < R; ++r)
      for (int f = 0; f < c.forwards; ++f) {
        const Tensor& a = with[static_cast<std::size_t>(r)][static_cast<std::size_t>(f)];
        const Tensor& b = without[static_cast<std::size_t>(r)][static_cast<std::size_t>(f)];
        EXPECT_EQ(gputest::first_difference(a.data(), b.data(), a.nbytes()), -1)
            << "H=" << H << " rank " << r << " forward " << f << " seed " << seed;
      }
  }
}

}  // namespace
}  // namespace epmoe
