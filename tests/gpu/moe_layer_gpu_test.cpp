// The whole MoE layer on one GPU (semantics §8): CUDA router -> no-EP prepare -> CUDA experts -> finalize,
// against the independent float64 layer reference (tests/support/moe_reference) on fresh random inputs, with
// semantics §13's relative L2 <= 1e-2 and outputs poisoned (0xff) first. Covered: Standard and BatchedExperts
// formats, bf16 and fp8 dispatch (the reference then reads the fp8 round trip of the tokens), H in {2048,
// 2880, 7168}, zero tokens, one expert taking every token, K = 1 with the router weight on the input, int32
// ids; the batched path captured once in a CUDA graph (router included) and replayed with new tokens and new
// routing; semantics §11's host-mapped fault record (a bad id in a graph replay, an overflowing slab, a bad id on
// the Standard path); the CUDA TopKWeightAndReduce against a float64 sum and bit for bit against the CPU twin.
#include <gtest/gtest.h>

#include <epmoe/experts.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/permute.hpp>
#include <epmoe/quant.hpp>
#include <epmoe/router.hpp>
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
#include "moe/weight_and_reduce.hpp"
#include "router/router.hpp"
#include "support/moe_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::to_device;
using gputest::to_host;

constexpr double kTolerance = 1e-2;  // semantics §13

void log_error(const std::string& what, double err) { std::printf("[ rel_l2   ] %-60s %.3e\n", what.c_str(), err); }

// Clears what earlier tests may have left in the per-device id word and the fault record.
void clear_faults() {
  try {
    cuda::check_moe_faults();
  } catch (const Error&) {
  }
  try {
    cuda::check_invalid_ids();
  } catch (const Error&) {
  }
}

// A stream of its own made current for the scope. A blocking one: the helpers of gpu_util (cudaMemcpy,
// cudaMemset on the legacy default stream) then stay ordered with the work and the stream-ordered
// allocations made on it. Nothing touches the legacy stream while it is being captured.
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

// Host weights of E experts (gated silu) and their device copies.
struct Weights {
  Tensor w1, w2, d_w1, d_w2;
};
Weights make_weights(std::mt19937_64& rng, int E, std::int64_t H, std::int64_t N) {
  Weights w;
  Tensor a = test::random_bf16(rng, E * 2 * N, H, 1.0f / std::sqrt(static_cast<float>(H)));
  Tensor b = test::random_bf16(rng, E * H, N, 1.0f / std::sqrt(static_cast<float>(N)));
  w.w1 = Tensor::wrap(TensorView(a.data(), DType::bf16, {E, 2 * N, H}), std::make_shared<Tensor>(a));
  w.w2 = Tensor::wrap(TensorView(b.data(), DType::bf16, {E, H, N}), std::make_shared<Tensor>(b));
  w.d_w1 = to_device(w.w1);
  w.d_w2 = to_device(w.w2);
  return w;
}

// The values the experts see after an fp8 wire (the CPU quantizer is bit-identical to the CUDA one).
Tensor fp8_seen(const Tensor& x, const PrepareFinalizeOptions& o) {
  if (x.numel() == 0) return x;
  const Fp8Tensor q = quantize_fp8(x, {o.round_scale, o.use_ue8m0});
  return dequantize_fp8(q.data, q.scales, DType::bf16);
}

Tensor to_int64(const Tensor& idx) {
  if (idx.dtype() == DType::int64) return idx;
  Tensor out = Tensor::empty(DType::int64, idx.shape());
  for (std::int64_t i = 0; i < idx.numel(); ++i) out.ptr<std::int64_t>()[i] = idx.ptr<std::int32_t>()[i];
  return out;
}

struct LayerCase {
  ActivationFormat format = ActivationFormat::standard;
  DispatchDtype dtype = DispatchDtype::bf16;
  bool weight_on_input = false;
  bool give_output = true;
  std::int64_t max_tokens = 0;
};

std::unique_ptr<MoELayer> make_layer(const LayerCase& c, std::shared_ptr<WorkspaceCache> ws = nullptr) {
  PrepareFinalizeOptions po;
  po.dispatch_dtype = c.dtype;
  po.round_scale = c.dtype == DispatchDtype::fp8;
  NoEpOptions no;
  no.format = c.format;
  no.max_tokens_per_expert = c.max_tokens;
  no.workspaces = ws;
  ExpertsConfig ec;
  ec.format = c.format;
  MoELayerOptions lo;
  lo.workspaces = ws;
  return std::make_unique<MoELayer>(make_no_ep_prepare_finalize(po, no), make_cuda_experts(ec), SharedExperts{}, lo);
}

// Runs one forward on the current stream with host inputs x [T, H], topk (host, int64 or int32), and checks
// it against the float64 reference. Returns the relative error.
double run_and_check(MoELayer& layer, const LayerCase& c, const Weights& w, const Tensor& x, const Tensor& idx,
                     const Tensor& weights, int E, const std::string& what) {
  const std::int64_t T = x.size(0), H = x.size(1);
  Tensor d_x = to_device(x), d_idx = to_device(idx), d_w = to_device(weights);
  Tensor out;
  MoEForwardArgs a;
  a.hidden = d_x;
  a.w1 = w.d_w1;
  a.w2 = w.d_w2;
  a.topk_idx = d_idx;
  a.topk_weights = d_w;
  a.global_num_experts = E;
  a.apply_router_weight_on_input = c.weight_on_input;
  if (c.give_output) {
    out = Tensor::empty(DType::bf16, {T, H}, gputest::gpu());
    gputest::poison(out);
    a.output = out;
  }
  const MoEForwardResult r = layer.forward(a);
  EXPECT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(current_stream().handle)), cudaSuccess);
  EXPECT_EQ(r.output.shape(), (Shape{T, H})) << what;
  EXPECT_TRUE(r.output.device().is_cuda()) << what;
  if (c.give_output) EXPECT_EQ(r.output.data(), out.data()) << what << ": not written into the given output";
  const Tensor got = to_host(r.output);
  PrepareFinalizeOptions po;
  po.round_scale = true;
  const Tensor seen = c.dtype == DispatchDtype::fp8 ? fp8_seen(x, po) : x;
  const std::vector<double> ref =
      test::moe_layer_reference(seen, w.w1, w.w2, to_int64(idx), weights, "silu", c.weight_on_input);
  const double err = test::relative_l2(got, ref);
  log_error(what, err);
  EXPECT_LE(err, kTolerance) << what;  // also fails on NaN / poison
  return err;
}

std::string format_name(const LayerCase& c) {
  return std::string(activation_format_name(c.format)) + (c.dtype == DispatchDtype::fp8 ? " fp8" : " bf16");
}

// Routing on the GPU (CUDA topk softmax) from random logits; returns host copies.
TopkResult route_on_gpu(std::mt19937_64& rng, std::int64_t T, int E, int K) {
  const Tensor logits = test::random_f32(rng, T, E, -3.0f, 3.0f);
  const Tensor d_logits = to_device(logits);
  const TopkResult r = topk_softmax(d_logits, K, true, current_stream());
  return {to_host(r.topk_weights), to_host(r.topk_idx)};
}

// ---- eager layer -----------------------------------------------------------------------------------

TEST(GpuMoELayer, RouterPrepareExpertsFinalizeMatchFloat64AtEveryHiddenSize) {
  std::mt19937_64 rng(test::fresh_seed());
  ScopedStream stream;
  constexpr int E = 8, K = 4;
  constexpr std::int64_t T = 24, N = 128;
  for (std::int64_t H : gputest::hidden_sizes()) {
    const Weights w = make_weights(rng, E, H, N);
    for (ActivationFormat f : {ActivationFormat::standard, ActivationFormat::batched_experts})
      for (DispatchDtype dt : {DispatchDtype::bf16, DispatchDtype::fp8}) {
        LayerCase c;
        c.format = f;
        c.dtype = dt;
        auto layer = make_layer(c);
        const TopkResult r = route_on_gpu(rng, T, E, K);
        const Tensor x = test::random_bf16(rng, T, H);
        run_and_check(*layer, c, w, x, r.topk_idx, r.topk_weights, E, format_name(c) + " H=" + std::to_string(H));
        // A second call through the same layer and workspaces, fresh inputs, without an output buffer.
        c.give_output = false;
        const TopkResult r2 = route_on_gpu(rng, T, E, K);
        run_and_check(*layer, c, w, test::random_bf16(rng, T, H), r2.topk_idx, r2.topk_weights, E,
                      format_name(c) + " H=" + std::to_string(H) + " again, layer-allocated output");
      }
  }
  EXPECT_FALSE(cuda::peek_moe_faults().invalid_id);
  EXPECT_FALSE(cuda::peek_moe_faults().overflow);
}

TEST(GpuMoELayer, ZeroTokensGiveAnEmptyResultInBothFormats) {
  std::mt19937_64 rng(test::fresh_seed());
  ScopedStream stream;
  constexpr int E = 4, K = 2;
  constexpr std::int64_t H = 2048, N = 64;
  const Weights w = make_weights(rng, E, H, N);
  for (ActivationFormat f : {ActivationFormat::standard, ActivationFormat::batched_experts})
    for (bool give_output : {true, false}) {
      LayerCase c;
      c.format = f;
      c.give_output = give_output;
      auto layer = make_layer(c);
      MoEForwardArgs a;
      const Tensor x = Tensor::empty(DType::bf16, {0, H}, gputest::gpu());
      const Tensor idx = Tensor::empty(DType::int64, {0, K}, gputest::gpu());
      const Tensor tw = Tensor::empty(DType::fp32, {0, K}, gputest::gpu());
      const Tensor out = Tensor::empty(DType::bf16, {0, H}, gputest::gpu());
      a.hidden = x;
      a.w1 = w.d_w1;
      a.w2 = w.d_w2;
      a.topk_idx = idx;
      a.topk_weights = tw;
      a.global_num_experts = E;
      if (give_output) a.output = out;
      MoEForwardResult r;
      ASSERT_NO_THROW(r = layer->forward(a)) << activation_format_name(f);
      stream.sync();
      EXPECT_EQ(r.output.shape(), (Shape{0, H}));
      EXPECT_EQ(layer->prepare_finalize().stage(), Stage::initial);
    }
}

TEST(GpuMoELayer, OneExpertTakesEveryTokenInBothFormats) {
  std::mt19937_64 rng(test::fresh_seed());
  ScopedStream stream;
  constexpr int E = 8, K = 4;
  constexpr std::int64_t T = 96, H = 2048, N = 128;
  const Weights w = make_weights(rng, E, H, N);
  test::RoutingOptions ro;
  ro.only_expert = 6;  // first choice 6, the rest -1
  const Tensor idx = test::random_topk_idx(rng, T, K, E, ro);
  const Tensor tw = test::random_topk_weights(rng, idx);
  for (ActivationFormat f : {ActivationFormat::standard, ActivationFormat::batched_experts})
    for (DispatchDtype dt : {DispatchDtype::bf16, DispatchDtype::fp8}) {
      LayerCase c;
      c.format = f;
      c.dtype = dt;
      auto layer = make_layer(c);
      run_and_check(*layer, c, w, test::random_bf16(rng, T, H), idx, tw, E, "one expert, " + format_name(c));
    }
  // Batched with slabs exactly as tall as the one busy expert needs.
  LayerCase c;
  c.format = ActivationFormat::batched_experts;
  c.max_tokens = T;
  auto layer = make_layer(c);
  run_and_check(*layer, c, w, test::random_bf16(rng, T, H), idx, tw, E, "one expert, max_tokens = T");
  EXPECT_FALSE(cuda::peek_moe_faults().overflow);
}

TEST(GpuMoELayer, KEqualsOneWithAndWithoutTheWeightOnTheInputAndInt32Ids) {
  std::mt19937_64 rng(test::fresh_seed());
  ScopedStream stream;
  constexpr int E = 8;
  constexpr std::int64_t T = 40, H = 2880, N = 128;
  const Weights w = make_weights(rng, E, H, N);
  for (ActivationFormat f : {ActivationFormat::standard, ActivationFormat::batched_experts})
    for (bool on_input : {false, true}) {
      LayerCase c;
      c.format = f;
      c.weight_on_input = on_input;
      auto layer = make_layer(c);
      const TopkResult r = route_on_gpu(rng, T, E, 1);
      for (std::int64_t t = 0; t < T; ++t) r.topk_weights.ptr<float>()[t] *= 0.75f;  // weights != 1
      run_and_check(*layer, c, w, test::random_bf16(rng, T, H), r.topk_idx, r.topk_weights, E,
                    "K=1 " + std::string(activation_format_name(f)) + (on_input ? " weight on input" : ""));
    }
  // int32 ids, K = 3, with -1 entries.
  for (ActivationFormat f : {ActivationFormat::standard, ActivationFormat::batched_experts}) {
    test::RoutingOptions ro;
    ro.p_minus_one = 0.2;
    const Tensor idx64 = test::random_topk_idx(rng, T, 3, E, ro);
    Tensor idx32 = Tensor::empty(DType::int32, {T, 3});
    for (std::int64_t i = 0; i < idx64.numel(); ++i)
      idx32.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(idx64.ptr<std::int64_t>()[i]);
    LayerCase c;
    c.format = f;
    auto layer = make_layer(c);
    run_and_check(*layer, c, w, test::random_bf16(rng, T, H), idx32, test::random_topk_weights(rng, idx64), E,
                  std::string("int32 ids with -1, ") + std::string(activation_format_name(f)));
  }
}

TEST(GpuMoELayer, BatchedMatchesTheCpuBatchedNoEpPath) {
  // The same no-EP batched prepare/finalize on CPU tensors (blas experts) and on the GPU: both near the
  // float64 reference.
  std::mt19937_64 rng(test::fresh_seed());
  ScopedStream stream;
  constexpr int E = 8, K = 2;
  constexpr std::int64_t T = 20, H = 2048, N = 64;
  const Weights w = make_weights(rng, E, H, N);
  const Tensor x = test::random_bf16(rng, T, H);
  const Tensor idx = test::random_topk_idx(rng, T, K, E);
  const Tensor tw = test::random_topk_weights(rng, idx);
  NoEpOptions no;
  no.format = ActivationFormat::batched_experts;
  ExpertsConfig ec;
  ec.format = ActivationFormat::batched_experts;
  MoELayer cpu(make_no_ep_prepare_finalize({}, no), make_blas_experts(ec));
  MoEForwardArgs a;
  a.hidden = x;
  a.w1 = w.w1;
  a.w2 = w.w2;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.global_num_experts = E;
  const Tensor cpu_out = cpu.forward(a).output;
  const std::vector<double> ref = test::moe_layer_reference(x, w.w1, w.w2, idx, tw, "silu");
  const double cpu_err = test::relative_l2(cpu_out, ref);
  log_error("CPU no-EP batched", cpu_err);
  EXPECT_LE(cpu_err, kTolerance);
  LayerCase c;
  c.format = ActivationFormat::batched_experts;
  auto layer = make_layer(c);
  run_and_check(*layer, c, w, x, idx, tw, E, "GPU no-EP batched");
}

// ---- CUDA graph ------------------------------------------------------------------------------------

// The fixed-shape path: router + batched layer, captured once, replayed with new tokens and logits.
void graph_replays(DispatchDtype dtype) {
  std::mt19937_64 rng(test::fresh_seed());
  clear_faults();
  constexpr int E = 16, K = 4;
  constexpr std::int64_t T = 64, H = 2048, N = 128;
  const Weights w = make_weights(rng, E, H, N);
  LayerCase c;
  c.format = ActivationFormat::batched_experts;
  c.dtype = dtype;
  auto workspaces = std::make_shared<WorkspaceCache>();
  auto layer = make_layer(c, workspaces);
  // Buffers the graph reads and writes; replays refill the inputs in place.
  Tensor logits = to_device(test::random_f32(rng, T, E, -3.0f, 3.0f));
  Tensor x = to_device(test::random_bf16(rng, T, H));
  Tensor idx = Tensor::empty(DType::int64, {T, K}, gputest::gpu());
  Tensor tw = Tensor::empty(DType::fp32, {T, K}, gputest::gpu());
  Tensor out = Tensor::empty(DType::bf16, {T, H}, gputest::gpu());
  router_detail::RoutingProblem rp;
  rp.logits = logits;
  rp.num_tokens = T;
  rp.num_experts = E;
  rp.num_topk = K;
  rp.renormalize = true;
  MoEForwardArgs a;
  a.hidden = x;
  a.w1 = w.d_w1;
  a.w2 = w.d_w2;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.global_num_experts = E;
  a.output = out;

  ScopedStream stream;
  const Stream s{stream.s};
  auto step = [&] {
    router_detail::route_cuda(rp, tw.ptr<float>(), idx.ptr<std::int64_t>(), s);
    layer->forward(a);
  };
  auto check_against_reference = [&](const Tensor& host_x, const std::string& what) {
    const Tensor got = to_host(out);
    const Tensor seen = dtype == DispatchDtype::fp8 ? fp8_seen(host_x, {DispatchDtype::fp8, true, false}) : host_x;
    const std::vector<double> ref = test::moe_layer_reference(seen, w.w1, w.w2, to_host(idx), to_host(tw), "silu");
    const double err = test::relative_l2(got, ref);
    log_error(what, err);
    EXPECT_LE(err, kTolerance) << what;
  };
  // Eager once (cuBLAS handle, workspaces, fault record), checked like any call.
  Tensor host_x = to_host(x);
  gputest::poison(out);
  step();
  stream.sync();
  check_against_reference(host_x, "graph warm-up (eager)");
  const std::size_t ws_bytes = workspaces->bytes();

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string error;
  try {
    step();
  } catch (const std::exception& e) {
    error = e.what();
  }
  ASSERT_EQ(cudaStreamEndCapture(stream.s, &graph), cudaSuccess);
  ASSERT_EQ(error, "");
  EXPECT_EQ(workspaces->bytes(), ws_bytes) << "the capture allocated workspaces";
  std::size_t nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
  EXPECT_GT(nodes, 0u);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (int replay = 0; replay < 4; ++replay) {
    Tensor new_logits = test::random_f32(rng, T, E, -3.0f, 3.0f);
    if (replay == 2)  // every token's first choice is expert 3
      for (std::int64_t t = 0; t < T; ++t) new_logits.ptr<float>()[t * E + 3] = 50.0f;
    host_x = test::random_bf16(rng, T, H);
    ASSERT_EQ(cudaMemcpyAsync(logits.data(), new_logits.data(), new_logits.nbytes(), cudaMemcpyHostToDevice, stream.s),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(x.data(), host_x.data(), host_x.nbytes(), cudaMemcpyHostToDevice, stream.s),
              cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(out.data(), 0xff, out.nbytes(), stream.s), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream.s), cudaSuccess);
    stream.sync();
    check_against_reference(host_x, std::string("graph replay ") + std::to_string(replay) +
                                        (dtype == DispatchDtype::fp8 ? " fp8" : " bf16"));
  }
  EXPECT_FALSE(cuda::peek_moe_faults().invalid_id);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST(GpuMoELayer, BatchedLayerWithRouterCapturedOnceAndReplayedBf16) { graph_replays(DispatchDtype::bf16); }
TEST(GpuMoELayer, BatchedLayerWithRouterCapturedOnceAndReplayedFp8) { graph_replays(DispatchDtype::fp8); }

TEST(GpuMoELayer, CaptureWithoutAnOutputBufferIsRefused) {
  std::mt19937_64 rng(test::fresh_seed());
  constexpr int E = 4, K = 2;
  constexpr std::int64_t T = 8, H = 2048, N = 64;
  const Weights w = make_weights(rng, E, H, N);
  LayerCase c;
  c.format = ActivationFormat::batched_experts;
  auto layer = make_layer(c);
  Tensor x = to_device(test::random_bf16(rng, T, H));
  const Tensor h_idx = test::random_topk_idx(rng, T, K, E);
  Tensor idx = to_device(h_idx), tw = to_device(test::random_topk_weights(rng, h_idx));
  MoEForwardArgs a;
  a.hidden = x;
  a.w1 = w.d_w1;
  a.w2 = w.d_w2;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.global_num_experts = E;
  ScopedStream stream;
  layer->forward(a);  // eager: fine
  stream.sync();
  auto layer2 = make_layer(c);
  layer2->forward(a);
  stream.sync();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string error;
  try {
    layer2->forward(a);
  } catch (const Error& e) {
    error = e.what();
    EXPECT_EQ(e.code(), ErrorCode::unsupported);
  }
  cudaStreamEndCapture(stream.s, &graph);
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
  EXPECT_NE(error.find("output"), std::string::npos) << error;
}

// ---- semantics §11: faults in host-mapped memory ----------------------------------------------------------

TEST(GpuMoELayer, BadIdInAGraphReplayIsFlaggedInHostMappedMemoryAndReported) {
  std::mt19937_64 rng(test::fresh_seed());
  clear_faults();
  constexpr int E = 8, K = 2;
  constexpr std::int64_t T = 32, H = 2048, N = 64;
  const Weights w = make_weights(rng, E, H, N);
  LayerCase c;
  c.format = ActivationFormat::batched_experts;
  auto layer = make_layer(c);
  Tensor h_idx = test::random_topk_idx(rng, T, K, E);
  Tensor h_tw = test::random_topk_weights(rng, h_idx);
  Tensor h_x = test::random_bf16(rng, T, H);
  Tensor x = to_device(h_x), idx = to_device(h_idx), tw = to_device(h_tw);
  Tensor out = Tensor::empty(DType::bf16, {T, H}, gputest::gpu());
  MoEForwardArgs a;
  a.hidden = x;
  a.w1 = w.d_w1;
  a.w2 = w.d_w2;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.global_num_experts = E;
  a.output = out;
  ScopedStream stream;
  layer->forward(a);  // eager warm-up
  stream.sync();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string error;
  try {
    layer->forward(a);
  } catch (const std::exception& e) {
    error = e.what();
  }
  ASSERT_EQ(cudaStreamEndCapture(stream.s, &graph), cudaSuccess);
  ASSERT_EQ(error, "");
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (int replay = 0; replay < 3; ++replay) {
    h_idx = test::random_topk_idx(rng, T, K, E);
    h_tw = test::random_topk_weights(rng, h_idx);
    h_x = test::random_bf16(rng, T, H);
    Tensor sent = h_idx;
    if (replay == 1) {  // one bad id at [5, 1]; the kernels skip it, so the reference drops that choice
      sent = Tensor::empty(DType::int64, {T, K});
      std::memcpy(sent.data(), h_idx.data(), h_idx.nbytes());
      sent.ptr<std::int64_t>()[5 * K + 1] = E + 3;
      h_idx.ptr<std::int64_t>()[5 * K + 1] = -1;
    }
    ASSERT_EQ(cudaMemcpyAsync(idx.data(), sent.data(), sent.nbytes(), cudaMemcpyHostToDevice, stream.s), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(tw.data(), h_tw.data(), h_tw.nbytes(), cudaMemcpyHostToDevice, stream.s), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(x.data(), h_x.data(), h_x.nbytes(), cudaMemcpyHostToDevice, stream.s), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(out.data(), 0xff, out.nbytes(), stream.s), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream.s), cudaSuccess);
    stream.sync();
    // The host reads the mapped record directly: no synchronisation or copy inside peek.
    const cuda::MoEFaults f = cuda::peek_moe_faults();
    EXPECT_EQ(f.invalid_id, replay == 1) << "replay " << replay;
    EXPECT_FALSE(f.overflow);
    const std::vector<double> ref = test::moe_layer_reference(h_x, w.w1, w.w2, h_idx, h_tw, "silu");
    const double err = test::relative_l2(to_host(out), ref);
    log_error("bad-id graph replay " + std::to_string(replay), err);
    EXPECT_LE(err, kTolerance);
    if (replay == 1) {
      try {
        cuda::check_moe_faults(Stream{stream.s});
        ADD_FAILURE() << "check_moe_faults did not throw";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
        EXPECT_NE(std::string(e.what()).find("11 at [5, 1]"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("topk_idx"), std::string::npos) << e.what();
      }
      EXPECT_FALSE(cuda::peek_moe_faults().invalid_id) << "not cleared";
      EXPECT_NO_THROW(cuda::check_invalid_ids(Stream{stream.s}));
    }
    EXPECT_NO_THROW(cuda::check_moe_faults(Stream{stream.s}));
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST(GpuMoELayer, OverflowingSlabIsFlaggedAndReportedWithTheCountNeeded) {
  std::mt19937_64 rng(test::fresh_seed());
  clear_faults();
  constexpr int E = 4;
  constexpr std::int64_t T = 16, H = 2048, N = 64;
  const Weights w = make_weights(rng, E, H, N);
  LayerCase c;
  c.format = ActivationFormat::batched_experts;
  c.max_tokens = 4;
  auto layer = make_layer(c);
  Tensor h_idx = Tensor::empty(DType::int64, {T, 1});
  for (std::int64_t t = 0; t < T; ++t) h_idx.ptr<std::int64_t>()[t] = 2;
  Tensor x = to_device(test::random_bf16(rng, T, H)), idx = to_device(h_idx);
  Tensor tw = to_device(test::random_topk_weights(rng, h_idx));
  MoEForwardArgs a;
  a.hidden = x;
  a.w1 = w.d_w1;
  a.w2 = w.d_w2;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.global_num_experts = E;
  ScopedStream stream;
  layer->forward(a);
  stream.sync();
  const cuda::MoEFaults f = cuda::peek_moe_faults();
  EXPECT_TRUE(f.overflow);
  EXPECT_EQ(f.overflow_expert, 2);
  EXPECT_EQ(f.overflow_count, 16);
  EXPECT_EQ(f.overflow_limit, 4);
  try {
    cuda::check_moe_faults(Stream{stream.s});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
    EXPECT_NE(std::string(e.what()).find("expert 2 received 16"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(cuda::peek_moe_faults().overflow);
}

TEST(GpuMoELayer, StandardBadIdIsRaisedByTheExpertsSyncAndFlagged) {
  std::mt19937_64 rng(test::fresh_seed());
  clear_faults();
  constexpr int E = 4, K = 2;
  constexpr std::int64_t T = 8, H = 2048, N = 64;
  const Weights w = make_weights(rng, E, H, N);
  Tensor h_idx = test::random_topk_idx(rng, T, K, E);
  Tensor h_tw = test::random_topk_weights(rng, h_idx);
  h_idx.ptr<std::int64_t>()[2 * K + 1] = 9;
  Tensor x = to_device(test::random_bf16(rng, T, H)), idx = to_device(h_idx), tw = to_device(h_tw);
  MoEForwardArgs a;
  a.hidden = x;
  a.w1 = w.d_w1;
  a.w2 = w.d_w2;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.global_num_experts = E;
  ScopedStream stream;
  auto layer = make_layer(LayerCase{});
  try {
    layer->forward(a);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("9 at [2, 1]"), std::string::npos) << e.what();
  }
  stream.sync();
  EXPECT_TRUE(cuda::peek_moe_faults().invalid_id);
  try {
    cuda::check_moe_faults(Stream{stream.s});
    ADD_FAILURE() << "check_moe_faults did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("9 at [2, 1]"), std::string::npos) << e.what();
  }
}

TEST(GpuMoELayer, BadArgumentsNameTheArgument) {
  std::mt19937_64 rng(test::fresh_seed());
  constexpr int E = 4, K = 2;
  constexpr std::int64_t T = 8, H = 2048, N = 64;
  const Weights w = make_weights(rng, E, H, N);
  const Tensor h_idx = test::random_topk_idx(rng, T, K, E);
  Tensor x = to_device(test::random_bf16(rng, T, H)), idx = to_device(h_idx);
  Tensor tw = to_device(test::random_topk_weights(rng, h_idx));
  Tensor bad_out = Tensor::empty(DType::bf16, {T, H + 8}, gputest::gpu());
  auto expect = [&](MoEForwardArgs a, const std::string& needle) {
    auto layer = make_layer(LayerCase{});
    try {
      layer->forward(a);
      ADD_FAILURE() << needle << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find("'" + needle + "'"), std::string::npos) << e.what();
    }
  };
  MoEForwardArgs a;
  a.hidden = x;
  a.w1 = w.d_w1;
  a.w2 = w.d_w2;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.global_num_experts = E;
  MoEForwardArgs b = a;
  b.topk_idx = h_idx;  // on the CPU
  expect(b, "topk_idx");
  b = a;
  b.output = bad_out;
  expect(b, "output");
  b = a;
  b.topk_weights = idx;
  expect(b, "topk_weights");
  EXPECT_THROW(make_no_ep_prepare_finalize({}, NoEpOptions{ActivationFormat::standard, 8, nullptr, 0}), Error);
}

// ---- TopKWeightAndReduce on CUDA ---------------------------------------------------------------------

TEST(GpuWeightAndReduce, ContiguousAndNaiveBatchedMatchFloat64AndTheCpuBits) {
  std::mt19937_64 rng(test::fresh_seed());
  constexpr int E = 6, K = 3;
  constexpr std::int64_t M = 50, H = 2880;
  test::RoutingOptions ro;
  ro.p_minus_one = 0.25;
  const Tensor idx = test::random_topk_idx(rng, M, K, E, ro);
  const Tensor tw = test::random_topk_weights(rng, idx);
  // Contiguous: fused [M, K, H].
  Tensor fused = test::random_bf16(rng, M * K, H, 4.0f);
  fused = Tensor::wrap(TensorView(fused.data(), DType::bf16, {M, K, H}), std::make_shared<Tensor>(fused));
  // NaiveBatched: slabs [E, M, H]; slot of (m, k) = its rank among expert e's choices, counted here.
  Tensor slabs = test::random_bf16(rng, E * M, H, 4.0f);
  slabs = Tensor::wrap(TensorView(slabs.data(), DType::bf16, {E, M, H}), std::make_shared<Tensor>(slabs));
  Tensor slot_of = Tensor::empty(DType::int32, {M, K});
  std::vector<int> seen(E, 0);
  for (std::int64_t i = 0; i < M * K; ++i) {
    const std::int64_t e = idx.ptr<std::int64_t>()[i];
    slot_of.ptr<std::int32_t>()[i] =
        e < 0 ? -1 : static_cast<std::int32_t>(e * M + seen[static_cast<std::size_t>(e)]++);
  }
  ScopedStream stream;
  const Stream s{stream.s};
  for (bool batched : {false, true}) {
    const Tensor& f = batched ? slabs : fused;
    Tensor d_f = to_device(f), d_idx = to_device(idx), d_w = to_device(tw), d_slot = to_device(slot_of);
    Tensor d_out = Tensor::empty(DType::bf16, {M, H}, gputest::gpu());
    gputest::poison(d_out);
    if (batched)
      weight_and_reduce_naive_batched_cuda(d_f, d_w, d_slot, d_out, s);
    else
      weight_and_reduce_contiguous_cuda(d_f, d_w, d_idx, d_out, s);
    stream.sync();
    const Tensor got = to_host(d_out);
    // float64 sums, written here from the definition.
    std::vector<double> ref(static_cast<std::size_t>(M * H), 0.0);
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int64_t i = m * K + k;
        if (idx.ptr<std::int64_t>()[i] < 0) continue;
        const std::int64_t row = batched ? slot_of.ptr<std::int32_t>()[i] : i;
        for (std::int64_t h = 0; h < H; ++h)
          ref[static_cast<std::size_t>(m * H + h)] +=
              static_cast<double>(tw.ptr<float>()[i]) * bf16_to_float(f.ptr<bf16_t>()[row * H + h]);
      }
    for (std::int64_t j = 0; j < M * H; ++j) {
      const double g = bf16_to_float(got.ptr<bf16_t>()[j]), r = ref[static_cast<std::size_t>(j)];
      ASSERT_LE(std::abs(g - r), 1e-2 * std::abs(r) + 1e-5)
          << (batched ? "naive_batched" : "contiguous") << " at " << j;
    }
    // The CPU twin gives the same bits (same float32 order, no fused multiply-add).
    Tensor cpu = Tensor::empty(DType::bf16, {M, H});
    if (batched)
      weight_and_reduce_naive_batched(f, tw, idx, 0, cpu);
    else
      weight_and_reduce_contiguous(f, tw, idx, cpu);
    EXPECT_TRUE(gputest::same_bits(cpu, got)) << (batched ? "naive_batched" : "contiguous");
  }
}

}  // namespace
}  // namespace epmoe
