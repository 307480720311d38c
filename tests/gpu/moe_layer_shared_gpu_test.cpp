// Shared experts on a GPU (semantics §8): MoELayer::forward runs them on its side stream, overlapped with the
// dispatch on the caller's stream, with events only. Shown with %globaltimer stamps (gpu/globaltimer.hpp): the
// shared experts stamp their start and end on the side stream (after a 3 ms spin, so a serial schedule cannot pass
// by accident), the prepare/finalize's before_dispatch / after_dispatch hooks stamp the dispatch on the caller's
// stream, and the caller's stream stamps once more after forward returned. Expected: the side stream is another
// stream; side start < dispatch end and dispatch start < side end (the intervals overlap: the dispatch did not
// wait for the shared experts); the stamp after forward >= side end (the caller's stream waited for the side
// stream); only the caller's stream is synchronised. For no-EP (standard and batched), normal and low-latency
// prepare/finalize (one-rank cuda_ipc Buffer). Outputs against float64: routed against the layer reference,
// shared against the dense MLP's (the same reference with one expert taking every token, weight 1). Also: the
// built-in shared experts captured with the batched layer in a CUDA graph and replayed with new tokens; an
// exception of the shared experts propagates after the routed forward, the layer staying usable.
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/stream.hpp>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu/globaltimer.hpp"
#include "gpu/gpu_util.hpp"
#include "support/moe_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::cuda_ok;
using gputest::to_device;
using gputest::to_host;

constexpr double kTolerance = 1e-2;  // semantics §13
constexpr std::uint64_t kSpinNs = 3'000'000;

// A blocking stream of its own, current for the scope (gpu_util's cudaMemcpy helpers stay ordered with it).
struct ScopedStream {
  cudaStream_t s = nullptr;
  std::unique_ptr<StreamGuard> guard;
  ScopedStream() {
    cuda_ok(cudaStreamCreate(&s), "cudaStreamCreate");
    guard = std::make_unique<StreamGuard>(Stream{s});
  }
  ~ScopedStream() {
    guard.reset();
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
};

Tensor as_one_expert(const Tensor& w) {  // [rows, cols] -> [1, rows, cols]
  return Tensor::wrap(TensorView(w.data(), w.dtype(), {1, w.size(0), w.size(1)}), std::make_shared<Tensor>(w));
}

// The dense MLP's float64 reference: the layer reference with one expert taking every token at weight 1.
std::vector<double> dense_reference(const Tensor& x, const Tensor& w1s, const Tensor& w2s) {
  const std::int64_t T = x.size(0);
  Tensor idx = Tensor::zeros(DType::int64, {T, 1});
  Tensor ones = Tensor::empty(DType::fp32, {T, 1});
  for (std::int64_t t = 0; t < T; ++t) ones.ptr<float>()[t] = 1.0f;
  return test::moe_layer_reference(x, as_one_expert(w1s), as_one_expert(w2s), idx, ones, "silu");
}

enum class Mode { no_ep_standard, no_ep_batched, normal, low_latency };
const char* mode_name(Mode m) {
  switch (m) {
    case Mode::no_ep_standard: return "no-EP standard";
    case Mode::no_ep_batched: return "no-EP batched";
    case Mode::normal: return "normal (one-rank cuda_ipc)";
    case Mode::low_latency: return "low-latency (one-rank cuda_ipc)";
  }
  return "?";
}

struct Problem {
  int E = 8, K = 4;
  std::int64_t T = 64, H = 2048, N = 128, Ns = 1024;
  Tensor w1, w2, w1s, w2s;  // host: routed [E, 2N, H], [E, H, N]; shared [2Ns, H], [H, Ns]
  Tensor x, idx, tw;        // host: [T, H], [T, K], [T, K]
};

Problem make_problem(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem p;
  const Tensor a = test::random_bf16(rng, p.E * 2 * p.N, p.H, 1.0f / std::sqrt(static_cast<float>(p.H)));
  const Tensor b = test::random_bf16(rng, p.E * p.H, p.N, 1.0f / std::sqrt(static_cast<float>(p.N)));
  p.w1 = Tensor::wrap(TensorView(a.data(), DType::bf16, {p.E, 2 * p.N, p.H}), std::make_shared<Tensor>(a));
  p.w2 = Tensor::wrap(TensorView(b.data(), DType::bf16, {p.E, p.H, p.N}), std::make_shared<Tensor>(b));
  p.w1s = test::random_bf16(rng, 2 * p.Ns, p.H, 1.0f / std::sqrt(static_cast<float>(p.H)));
  p.w2s = test::random_bf16(rng, p.H, p.Ns, 1.0f / std::sqrt(static_cast<float>(p.Ns)));
  p.x = test::random_bf16(rng, p.T, p.H);
  p.idx = test::random_topk_idx(rng, p.T, p.K, p.E);
  p.tw = test::random_topk_weights(rng, p.idx);
  return p;
}

// The layer of `mode` on this thread's GPU 0 (buffer: a one-rank cuda_ipc Buffer over g for normal / low-latency).
std::unique_ptr<MoELayer> make_layer(Mode mode, const Problem& p, Group& g, SharedExperts shared,
                                     std::shared_ptr<PrepareFinalize>& pf) {
  ExpertsConfig ec;
  const bool batched = mode == Mode::no_ep_batched || mode == Mode::low_latency;
  ec.format = batched ? ActivationFormat::batched_experts : ActivationFormat::standard;
  if (mode == Mode::no_ep_standard || mode == Mode::no_ep_batched) {
    NoEpOptions no;
    no.format = ec.format;
    pf = make_no_ep_prepare_finalize({}, no);
  } else {
    BufferOptions bo;
    bo.backend = Backend::cuda_ipc;
    bo.device = 0;
    bo.num_nvl_bytes = Buffer::get_normal_nvl_size_hint(p.T, p.H, 1, p.K);
    auto buffer = std::make_shared<Buffer>(gputest::borrow(g), bo);
    pf = mode == Mode::normal ? make_normal_prepare_finalize(buffer)
                              : make_low_latency_prepare_finalize(buffer, static_cast<int>(p.T));
  }
  return std::make_unique<MoELayer>(pf, std::shared_ptr<Experts>(make_cuda_experts(ec)), std::move(shared));
}

double check_routed(const Problem& p, const Tensor& got_host, const std::string& what) {
  const double err = test::relative_l2(got_host, test::moe_layer_reference(p.x, p.w1, p.w2, p.idx, p.tw, "silu"));
  std::printf("[ rel_l2   ] %-60s %.3e\n", (what + " routed").c_str(), err);
  EXPECT_LE(err, kTolerance) << what;
  return err;
}

double check_shared(const Problem& p, const Tensor& x_host, const Tensor& got_host, const std::string& what) {
  const double err = test::relative_l2(got_host, dense_reference(x_host, p.w1s, p.w2s));
  std::printf("[ rel_l2   ] %-60s %.3e\n", (what + " shared").c_str(), err);
  EXPECT_LE(err, kTolerance) << what;
  return err;
}

void check_overlap(Mode mode) {
  if (gputest::gpu_count() < 1) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  const Problem p = make_problem(seed);
  run_thread_ranks(1, [&](Group& g) {
    cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    ScopedStream main;
    // Slots: 0 side start, 1 side end, 2 dispatch start, 3 dispatch end, 4 the caller's stream after forward.
    Tensor stamps = Tensor::empty(DType::int64, {5}, gputest::gpu());
    auto* st = static_cast<std::uint64_t*>(stamps.data());
    const Tensor d_w1s = to_device(p.w1s), d_w2s = to_device(p.w2s);
    SharedExperts builtin = make_cuda_shared_experts(d_w1s, d_w2s);
    cudaStream_t side_seen = nullptr;
    SharedExperts stamped = [&](const TensorView& hidden) {
      const cudaStream_t s = static_cast<cudaStream_t>(current_stream().handle);
      side_seen = s;
      gputest::stamp_globaltimer(st + 0, s);
      gputest::spin_globaltimer(kSpinNs, s);
      Tensor out = builtin(hidden);
      gputest::stamp_globaltimer(st + 1, s);
      return out;
    };
    std::shared_ptr<PrepareFinalize> pf;
    auto layer = make_layer(mode, p, g, stamped, pf);
    const auto here = [] { return static_cast<cudaStream_t>(current_stream().handle); };
    pf->before_dispatch = [&] { gputest::stamp_globaltimer(st + 2, here()); };
    pf->after_dispatch = [&] { gputest::stamp_globaltimer(st + 3, here()); };
    const Tensor d_w1 = to_device(p.w1), d_w2 = to_device(p.w2);
    const Tensor d_x = to_device(p.x), d_idx = to_device(p.idx), d_tw = to_device(p.tw);
    for (int f = 0; f < 2; ++f) {  // the second forward reuses the side stream
      const std::string what = std::string(mode_name(mode)) + " forward " + std::to_string(f);
      cuda_ok(cudaMemsetAsync(stamps.data(), 0, stamps.nbytes(), main.s), "cudaMemsetAsync");
      MoEForwardArgs a;
      a.hidden = d_x;
      a.w1 = d_w1;
      a.w2 = d_w2;
      a.topk_idx = d_idx;
      a.topk_weights = d_tw;
      a.global_num_experts = p.E;
      const MoEForwardResult r = layer->forward(a);
      gputest::stamp_globaltimer(st + 4, main.s);
      // Only the caller's stream: what forward returned must be ready there.
      cuda_ok(cudaStreamSynchronize(main.s), "cudaStreamSynchronize");
      ASSERT_TRUE(r.shared_output.defined()) << what;
      const Tensor routed = to_host(r.output), shared = to_host(r.shared_output);
      std::vector<std::uint64_t> t(5);
      cuda_ok(cudaMemcpy(t.data(), stamps.data(), 5 * sizeof(std::uint64_t), cudaMemcpyDeviceToHost), "stamps");
      EXPECT_NE(side_seen, main.s) << what << ": the shared experts ran on the caller's stream";
      EXPECT_NE(side_seen, nullptr) << what;
      for (int i = 0; i < 5; ++i) ASSERT_NE(t[static_cast<std::size_t>(i)], 0u) << what << ": stamp " << i;
      const auto us = [&](int i) { return static_cast<double>(t[static_cast<std::size_t>(i)] - t[0]) * 1e-3; };
      std::printf("[ stamps   ] %-40s side [0, %.1f] us, dispatch [%.1f, %.1f] us, after forward %.1f us\n",
                  what.c_str(), us(1), us(2), us(3), us(4));
      EXPECT_LT(t[0], t[3]) << what << ": the shared experts started after the dispatch ended";
      // The first forward's first launches of some kernels load their modules (CUDA's lazy loading, the default
      // since 12.2), which waits for the running kernels, the side stream's among them: the overlap is asserted
      // from the second forward on (docs/semantics.md: one eager forward first).
      if (f > 0) EXPECT_LT(t[2], t[1]) << what << ": the dispatch waited for the shared experts";
      EXPECT_GE(t[4], t[1]) << what << ": the caller's stream did not wait for the side stream";
      check_routed(p, routed, what);
      check_shared(p, p.x, shared, what);
    }
  });
}

TEST(GpuMoELayerShared, NoEpStandardOverlapsTheDispatchAndMatchesFloat64) { check_overlap(Mode::no_ep_standard); }
TEST(GpuMoELayerShared, NoEpBatchedOverlapsTheDispatchAndMatchesFloat64) { check_overlap(Mode::no_ep_batched); }
TEST(GpuMoELayerShared, NormalOverlapsTheDispatchAndMatchesFloat64) { check_overlap(Mode::normal); }
TEST(GpuMoELayerShared, LowLatencyOverlapsTheDispatchAndMatchesFloat64) { check_overlap(Mode::low_latency); }

// The batched no-EP layer with the built-in shared experts, captured once in a CUDA graph (the side stream joins
// the capture) and replayed with new tokens and routing in place.
TEST(GpuMoELayerShared, BuiltinSharedExpertsCapturedWithTheLayerInACudaGraph) {
  if (gputest::gpu_count() < 1) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  Problem p = make_problem(seed);
  std::mt19937_64 rng(seed + 1);
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  ScopedStream main;
  const Tensor d_w1s = to_device(p.w1s), d_w2s = to_device(p.w2s);
  auto ws = std::make_shared<WorkspaceCache>();
  NoEpOptions no;
  no.format = ActivationFormat::batched_experts;
  no.workspaces = ws;
  ExpertsConfig ec;
  ec.format = ActivationFormat::batched_experts;
  MoELayerOptions lo;
  lo.workspaces = ws;
  MoELayer layer(make_no_ep_prepare_finalize({}, no), std::shared_ptr<Experts>(make_cuda_experts(ec)),
                 make_cuda_shared_experts(d_w1s, d_w2s), lo);
  const Tensor d_w1 = to_device(p.w1), d_w2 = to_device(p.w2);
  Tensor x = to_device(p.x), idx = to_device(p.idx), tw = to_device(p.tw);
  Tensor out = Tensor::empty(DType::bf16, {p.T, p.H}, gputest::gpu());
  MoEForwardArgs a;
  a.hidden = x;
  a.w1 = d_w1;
  a.w2 = d_w2;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.global_num_experts = p.E;
  a.output = out;
  MoEForwardResult eager = layer.forward(a);  // creates the side stream, cuBLAS handle, workspaces, buffers
  cuda_ok(cudaStreamSynchronize(main.s), "sync");
  check_routed(p, to_host(out), "graph warm-up (eager)");
  check_shared(p, p.x, to_host(eager.shared_output), "graph warm-up (eager)");

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(main.s, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string error;
  MoEForwardResult captured;
  try {
    captured = layer.forward(a);
  } catch (const std::exception& e) {
    error = e.what();
  }
  ASSERT_EQ(cudaStreamEndCapture(main.s, &graph), cudaSuccess);
  ASSERT_EQ(error, "");
  ASSERT_TRUE(captured.shared_output.defined());
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 3; ++replay) {
    p.x = test::random_bf16(rng, p.T, p.H);
    p.idx = test::random_topk_idx(rng, p.T, p.K, p.E);
    p.tw = test::random_topk_weights(rng, p.idx);
    for (auto [dst, src] : {std::pair{&x, &p.x}, std::pair{&idx, &p.idx}, std::pair{&tw, &p.tw}})
      ASSERT_EQ(cudaMemcpyAsync(dst->data(), src->data(), src->nbytes(), cudaMemcpyHostToDevice, main.s), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(out.data(), 0xff, out.nbytes(), main.s), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(captured.shared_output.data(), 0xff, captured.shared_output.nbytes(), main.s),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, main.s), cudaSuccess);
    cuda_ok(cudaStreamSynchronize(main.s), "sync");
    const std::string what = "graph replay " + std::to_string(replay);
    check_routed(p, to_host(out), what);
    check_shared(p, p.x, to_host(captured.shared_output), what);
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

// A shared-experts exception surfaces after the routed forward completed; the layer stays usable.
TEST(GpuMoELayerShared, AThrowingSharedExpertsPropagatesAfterTheRoutedForward) {
  if (gputest::gpu_count() < 1) GTEST_SKIP() << "no GPU";
  const Problem p = make_problem(test::fresh_seed());
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  ScopedStream main;
  const Tensor d_w1s = to_device(p.w1s), d_w2s = to_device(p.w2s);
  SharedExperts builtin = make_cuda_shared_experts(d_w1s, d_w2s);
  bool fail = true;
  SharedExperts flaky = [&](const TensorView& h) {
    if (fail) throw std::runtime_error("from the shared experts");
    return builtin(h);
  };
  MoELayer layer(make_no_ep_prepare_finalize(), std::shared_ptr<Experts>(make_cuda_experts()), flaky);
  const Tensor d_w1 = to_device(p.w1), d_w2 = to_device(p.w2);
  const Tensor d_x = to_device(p.x), d_idx = to_device(p.idx), d_tw = to_device(p.tw);
  Tensor out = Tensor::empty(DType::bf16, {p.T, p.H}, gputest::gpu());
  gputest::poison(out);
  MoEForwardArgs a;
  a.hidden = d_x;
  a.w1 = d_w1;
  a.w2 = d_w2;
  a.topk_idx = d_idx;
  a.topk_weights = d_tw;
  a.global_num_experts = p.E;
  a.output = out;
  try {
    layer.forward(a);
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "from the shared experts");
  }
  cuda_ok(cudaStreamSynchronize(main.s), "sync");
  EXPECT_EQ(layer.prepare_finalize().stage(), Stage::initial);
  check_routed(p, to_host(out), "routed output of the forward whose shared experts threw");
  fail = false;
  const MoEForwardResult r = layer.forward(a);
  cuda_ok(cudaStreamSynchronize(main.s), "sync");
  check_routed(p, to_host(r.output), "next forward");
  check_shared(p, p.x, to_host(r.shared_output), "next forward");
}

}  // namespace
}  // namespace epmoe
