// The expert load recorder on a GPU (semantics §9): its state on the device, one kernel per record, the ring slot
// chosen on the device. Checked against the host recorder fed the same counts and against counts made by hand from
// topk_idx: direct records (int32 and int64, strided, partial ranges, E above one block's 1024 threads), records
// captured in a CUDA graph and replayed (each replay records into the next slot), a no-EP batched layer captured and
// replayed with new routing, and the DeepEP-mode layer on GPU thread ranks alternating normal and low-latency
// (automatic), each rank's record summed with global_loads.
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/eplb.hpp>
#include <epmoe/error.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>

#include <algorithm>
#include <cmath>
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

using i64 = std::int64_t;
using V = std::vector<i64>;
using gputest::to_device;
using gputest::to_host;

bool have_gpu() { return gputest::gpu_count() > 0; }

// A blocking stream of its own made current for the scope (gpu_util's copies on the legacy stream stay ordered).
struct ScopedStream {
  cudaStream_t s = nullptr;
  std::unique_ptr<StreamGuard> guard;
  ScopedStream() {
    EXPECT_EQ(cudaStreamCreate(&s), cudaSuccess);
    guard = std::make_unique<StreamGuard>(Stream{s});
  }
  ~ScopedStream() {
    guard.reset();
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  void sync() { ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess); }
};

Tensor random_counts(std::mt19937_64& rng, i64 n, DType dtype) {
  Tensor t = Tensor::empty(dtype, {n});
  std::uniform_int_distribution<int> d(0, 1000);
  for (i64 i = 0; i < n; ++i) {
    if (dtype == DType::int32)
      t.ptr<std::int32_t>()[i] = d(rng);
    else
      t.ptr<i64>()[i] = d(rng);
  }
  return t;
}

V device_view_to_host(const TensorView& v) {
  V out(static_cast<size_t>(v.numel()));
  EXPECT_EQ(cudaMemcpy(out.data(), v.data, v.nbytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

TEST(GpuExpertLoadRecorder, DeviceRecordsEqualTheHostRecorders) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  ScopedStream stream;
  for (i64 E : {40, 1500}) {  // 1500: one block's threads loop over the experts
    const i64 L = 3, R = E == 40 ? 4 : 20, W = 3;
    ExpertLoadRecorder dev(L, E, R, W, gputest::gpu()), host(L, E, R, W);
    EXPECT_TRUE(dev.device().is_cuda());
    EXPECT_EQ(dev.loads(), V(L * E, 0));  // zeroed at construction
    for (int step = 0; step < 12; ++step) {
      const i64 layer = static_cast<i64>(rng() % L);
      const DType dtype = step % 2 ? DType::int64 : DType::int32;
      const std::string what = "E " + std::to_string(E) + " step " + std::to_string(step) + " seed " +
                               std::to_string(seed);
      if (step % 3 == 0) {  // a whole record
        const Tensor c = random_counts(rng, E, dtype);
        const Tensor d = to_device(c);
        dev.record(layer, d);
        host.record(layer, c);
      } else if (step % 3 == 1) {  // one rank's experts
        const i64 el = E / R, r = static_cast<i64>(rng() % R);
        const Tensor c = random_counts(rng, el, dtype);
        const Tensor d = to_device(c);
        dev.record_local(layer, d, r * el);
        host.record_local(layer, c, r * el);
      } else {  // a strided view (every other count of 2n), at a random offset
        const i64 n = 1 + static_cast<i64>(rng() % (E / 2)), off = static_cast<i64>(rng() % (E - n + 1));
        const Tensor c = random_counts(rng, 2 * n, dtype);
        const Tensor d = to_device(c);
        TensorView hv = c.view(), dv = d.view();
        hv.shape = dv.shape = Shape{n};
        hv.strides[0] = dv.strides[0] = 2;
        dev.record_local(layer, dv, off);
        host.record_local(layer, hv, off);
      }
      EXPECT_EQ(dev.loads(), host.loads()) << what;
      EXPECT_EQ(dev.num_records(), host.num_records()) << what;
      stream.sync();
      EXPECT_EQ(device_view_to_host(dev.loads_view()), host.loads()) << what;
    }
    EXPECT_EQ(dev.balancedness(), host.balancedness());
    EXPECT_EQ(dev.to_json(), host.to_json());
    dev.reset();
    EXPECT_EQ(dev.loads(), V(L * E, 0));
    EXPECT_EQ(dev.num_records(), V(L, 0));
  }
  // A count on another device than the recorder's is refused, naming the argument.
  ExpertLoadRecorder dev(1, 8, 1, 1, gputest::gpu());
  const Tensor host_counts = random_counts(rng, 8, DType::int32);
  try {
    dev.record(0, host_counts);
    ADD_FAILURE() << "host counts accepted by a GPU recorder";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'num_tokens_per_expert'"), std::string::npos) << e.what();
  }
}

// Two records (layer 0 local, layer 1 whole) captured once; every replay, with new counts copied in place first,
// records into the next ring slot: after each replay the device recorder equals a host one fed every replay's counts.
TEST(GpuExpertLoadRecorder, GraphReplaysRecordIntoTheNextSlot) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  constexpr i64 L = 2, E = 16, R = 4, W = 4, El = E / R;
  ScopedStream stream;
  ExpertLoadRecorder dev(L, E, R, W, gputest::gpu()), host(L, E, R, W);
  Tensor a = Tensor::empty(DType::int32, {El}, gputest::gpu());
  Tensor b = Tensor::empty(DType::int64, {E}, gputest::gpu());
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string error;
  try {
    dev.record_local(0, a, 2 * El);
    dev.record(1, b);
  } catch (const std::exception& e) {
    error = e.what();
  }
  ASSERT_EQ(cudaStreamEndCapture(stream.s, &graph), cudaSuccess);
  ASSERT_EQ(error, "");
  EXPECT_EQ(dev.num_records(), V(L, 0)) << "the capture recorded";
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 7; ++replay) {  // 7 > W: the window wraps
    const Tensor ca = random_counts(rng, El, DType::int32), cb = random_counts(rng, E, DType::int64);
    ASSERT_EQ(cudaMemcpyAsync(a.data(), ca.data(), ca.nbytes(), cudaMemcpyHostToDevice, stream.s), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(b.data(), cb.data(), cb.nbytes(), cudaMemcpyHostToDevice, stream.s), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream.s), cudaSuccess);
    host.record_local(0, ca, 2 * El);
    host.record(1, cb);
    EXPECT_EQ(dev.loads(), host.loads()) << "replay " << replay << " seed " << seed;
    EXPECT_EQ(dev.num_records(), host.num_records()) << "replay " << replay;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

V hand_count(const Tensor& topk_idx, int E) {
  V c(static_cast<size_t>(E), 0);
  for (i64 i = 0; i < topk_idx.numel(); ++i)
    if (const i64 e = topk_idx.ptr<i64>()[i]; e >= 0) ++c[static_cast<size_t>(e)];
  return c;
}

// The no-EP batched layer on cuda:0 with a recorder: one eager forward, then the forward captured and replayed with
// new routing copied into topk_idx in place; after each call the loads are the hand count of the last W calls.
TEST(GpuMoELayerLoadRecorder, NoEpBatchedLayerRecordsUnderGraphReplays) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  constexpr int E = 16, K = 4;
  constexpr i64 T = 48, H = 2048, N = 128, W = 3;
  const gputest::ExpertWeights m = gputest::make_expert_weights(rng, E, H, N);
  const gputest::ExpertWeights w = gputest::rank_weights(m, 0, E, true);
  ScopedStream stream;
  auto workspaces = std::make_shared<WorkspaceCache>();
  NoEpOptions no;
  no.format = ActivationFormat::batched_experts;
  no.workspaces = workspaces;
  ExpertsConfig ec;
  ec.format = ActivationFormat::batched_experts;
  MoELayerOptions lo;
  lo.workspaces = workspaces;
  MoELayer layer(make_no_ep_prepare_finalize({}, no), std::shared_ptr<Experts>(make_cuda_experts(ec)), {}, lo);
  auto recorder = std::make_shared<ExpertLoadRecorder>(2, E, 1, W, gputest::gpu());
  layer.set_load_recorder(recorder, 1);

  test::RoutingOptions ro;
  ro.p_minus_one = 0.2;
  const auto new_routing = [&] { return test::random_topk_idx(rng, T, K, E, ro); };
  Tensor host_idx = new_routing();
  Tensor x = to_device(test::random_bf16(rng, T, H));
  Tensor idx = to_device(host_idx);
  Tensor tw = to_device(test::random_topk_weights(rng, host_idx));
  Tensor out = Tensor::empty(DType::bf16, {T, H}, gputest::gpu());
  MoEForwardArgs a = gputest::forward_args(x, w.w1, w.w2, idx, tw, E);
  a.output = out;
  std::vector<V> calls;
  const auto expect_window = [&](const std::string& what) {
    V want(2 * E, 0);
    for (size_t c = calls.size() > W ? calls.size() - W : 0; c < calls.size(); ++c)
      for (int e = 0; e < E; ++e) want[E + e] += calls[c][e];
    EXPECT_EQ(recorder->loads(), want) << what << " seed " << seed;
  };
  layer.forward(a);  // eager: workspaces, cuBLAS handle
  calls.push_back(hand_count(host_idx, E));
  expect_window("eager");

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string error;
  try {
    layer.forward(a);
  } catch (const std::exception& e) {
    error = e.what();
  }
  ASSERT_EQ(cudaStreamEndCapture(stream.s, &graph), cudaSuccess);
  ASSERT_EQ(error, "");
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 5; ++replay) {
    host_idx = new_routing();
    ASSERT_EQ(cudaMemcpyAsync(idx.data(), host_idx.data(), host_idx.nbytes(), cudaMemcpyHostToDevice, stream.s),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream.s), cudaSuccess);
    calls.push_back(hand_count(host_idx, E));
    expect_window("replay " + std::to_string(replay));
  }
  EXPECT_EQ(recorder->num_records(), (V{0, W}));
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_FALSE(cuda::peek_moe_faults().invalid_id);
}

// The DeepEP-mode layer (automatic: normal on even steps, low-latency on odd ones) on R GPU thread ranks, rank r on
// cuda:r with a recorder there: after every step, the sum over ranks (global_loads) is the hand count of every
// rank's topk_idx over the window, and each rank's own record holds its experts only.
TEST(GpuMoELayerLoadRecorder, AutomaticModeOnGpuRanksRecordsBothHalves) {
  const int R = gputest::thread_ranks();
  if (R < 1) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  gputest::LayerCase c;
  c.T = {24, 9, 0, 17};  // a rank with no tokens when R >= 3
  c.K = 4;
  c.forwards = 6;
  const int E = 4 * R, El = 4, tmax = 32;
  constexpr i64 W = 3;
  const gputest::ExpertWeights m = gputest::make_expert_weights(rng, E, c.H, c.N);
  const gputest::Ins in = gputest::make_inputs(rng, c, R, E);
  V want(static_cast<size_t>(E), 0);
  for (int f = c.forwards - static_cast<int>(W); f < c.forwards; ++f)
    for (int r = 0; r < R; ++r) {
      const V h = hand_count(in[r][f].idx, E);
      for (int e = 0; e < E; ++e) want[e] += h[e];
    }
  std::vector<V> global(R), own(R);
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    gputest::cuda_ok(cudaSetDevice(r), "cudaSetDevice");
    BufferOptions bo;
    bo.backend = Backend::cuda_ipc;
    bo.device = r;
    bo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(tmax, c.H, R, c.K);
    bo.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(tmax, c.H, R, E);
    bo.low_latency_mode = true;
    auto buffer = std::make_shared<Buffer>(gputest::borrow(g), bo);
    ExpertsConfig standard, batched;
    batched.format = ActivationFormat::batched_experts;
    MoELayer layer(buffer, DispatchMode::automatic, tmax, std::shared_ptr<Experts>(make_cuda_experts(standard)),
                   std::shared_ptr<Experts>(make_cuda_experts(batched)));
    auto recorder = std::make_shared<ExpertLoadRecorder>(1, E, R, W, Device::cuda(r));
    layer.set_load_recorder(recorder, 0);
    const gputest::ExpertWeights w = gputest::rank_weights(m, r, El, true);
    for (int f = 0; f < c.forwards; ++f) {
      const gputest::CallIn d = gputest::put_call(in[r][f], r, true);
      MoEForwardArgs a = gputest::forward_args(d.x, w.w1, w.w2, d.idx, d.w, E);
      a.is_extend_in_batch = f % 2 == 0;
      layer.forward(a);
    }
    global[r] = recorder->global_loads(g);
    own[r] = recorder->loads();
    gputest::cuda_ok(cudaDeviceSynchronize(), "sync");
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(global[r], want) << "rank " << r << " seed " << seed;
    V slice(static_cast<size_t>(E), 0);
    for (int e = r * El; e < (r + 1) * El; ++e) slice[e] = want[e];
    EXPECT_EQ(own[r], slice) << "rank " << r << " seed " << seed;
  }
}

}  // namespace
}  // namespace epmoe
