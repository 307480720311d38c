// CUDA experts (make_cuda_experts) against the float64 CPU reference (reference_experts_f64), semantics §13's
// relative L2 <= 1e-2: every activation in both formats, reduced and unreduced Standard output, an
// expert_map with int32 ids, apply_router_weight_on_input with float32 hidden, H in {2048, 2880, 7168},
// one expert taking every token, no local token, zero tokens (nothing enqueued: checked by capturing the
// call into a CUDA graph that must stay empty), every GEMM mode, bad ids, and the batched format captured
// once in a CUDA graph and replayed with new inputs and new counts. Outputs are poisoned (0xff) first;
// batched rows past each count must keep the poison.
#include <gtest/gtest.h>

#include <epmoe/experts.hpp>
#include <epmoe/stream.hpp>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "experts/experts.hpp"
#include "experts/experts_test_util.hpp"
#include "gpu/gpu_util.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using experts_cuda::GemmMode;
using gputest::to_device;
using gputest::to_host;

constexpr double kTolerance = 1e-2;  // semantics §13

// Device copies of a case's tensors and the ExpertsInputs that point at them.
struct DeviceCase {
  Tensor x, w1, w2, idx, weights, map, counts;
  ExpertsInputs in;
};

DeviceCase upload(const ExpertsInputs& h) {
  DeviceCase d;
  d.in = h;
  auto up = [](const TensorView& t, Tensor& keep) {
    if (!t.defined()) return TensorView{};
    keep = to_device(t);
    return keep.view();
  };
  d.in.hidden = up(h.hidden, d.x);
  d.in.w1 = up(h.w1, d.w1);
  d.in.w2 = up(h.w2, d.w2);
  d.in.topk_idx = up(h.topk_idx, d.idx);
  d.in.topk_weights = up(h.topk_weights, d.weights);
  d.in.expert_map = up(h.expert_map, d.map);
  d.in.expert_num_tokens = up(h.expert_num_tokens, d.counts);
  return d;
}

// Relative L2 over all elements, NaN when any output is not finite (so a poisoned element fails).
double rel_l2_all(const std::vector<double>& ref, const Tensor& got) {
  double num = 0, den = 0;
  const auto* g = got.ptr<bf16_t>();
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double v = bf16_to_float(g[i]);
    if (!std::isfinite(v)) return std::nan("");
    num += (v - ref[i]) * (v - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

void log_error(const std::string& what, double err) { std::printf("[ rel_l2   ] %-60s %.3e\n", what.c_str(), err); }

// Runs a Standard case on the GPU into a poisoned output and checks it against the float64 reference.
void check_standard(const test::StandardCase& c, bool reduce, GemmMode mode, const std::string& what) {
  ExpertsConfig cfg;
  cfg.reduce = reduce;
  const ExpertsInputs host_in = c.inputs();
  const std::vector<double> ref = reference_experts_f64(host_in, cfg);
  DeviceCase d = upload(host_in);
  const auto experts = experts_cuda::make_cuda_experts(cfg, mode);
  EXPECT_EQ(experts->name(), "cuda");
  const Shape shape = experts->output_shape(d.in);
  Tensor out = Tensor::empty(DType::bf16, shape, gputest::gpu());
  gputest::poison(out);
  experts->apply(d.in, out.view());
  gputest::sync_ok();
  const Tensor got = to_host(out);
  ASSERT_EQ(static_cast<std::size_t>(got.numel()), ref.size()) << what;
  const double err = rel_l2_all(ref, got);
  log_error(what, err);
  EXPECT_LE(err, kTolerance) << what;  // NaN fails too
  if (!reduce) {  // slots without a local expert are exact zeros
    const std::int64_t H = shape[2];
    for (std::int64_t slot = 0; slot < shape[0] * shape[1]; ++slot) {
      bool zero_ref = true;
      for (std::int64_t i = 0; i < H && zero_ref; ++i) zero_ref = ref[static_cast<std::size_t>(slot * H + i)] == 0.0;
      if (!zero_ref) continue;
      for (std::int64_t i = 0; i < H; ++i)
        ASSERT_EQ(got.ptr<bf16_t>()[slot * H + i].bits, 0) << what << ": slot " << slot << " element " << i;
    }
  }
}

// Runs a batched case into a poisoned output; rows < count must match, rows past it keep the poison.
void expect_batched_matches(const ExpertsInputs& host_in, const Tensor& got, const std::string& what) {
  ExpertsConfig cfg;
  cfg.format = ActivationFormat::batched_experts;
  const std::vector<double> ref = reference_experts_f64(host_in, cfg);
  const std::int64_t E = host_in.hidden.size(0), T = host_in.hidden.size(1), H = host_in.hidden.size(2);
  const auto* counts = static_cast<const std::int32_t*>(host_in.expert_num_tokens.data);
  const auto* g = got.ptr<bf16_t>();
  double num = 0, den = 0;
  std::int64_t untouched_bad = 0;
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t i = 0; i < H; ++i) {
        const std::int64_t at = (e * T + t) * H + i;
        if (t < counts[e]) {
          const double v = bf16_to_float(g[at]), r = ref[static_cast<std::size_t>(at)];
          num += std::isfinite(v) ? (v - r) * (v - r) : INFINITY;
          den += r * r;
        } else if (g[at].bits != 0xffff) {
          ++untouched_bad;
        }
      }
  const double err = std::sqrt(num / den);
  log_error(what, err);
  EXPECT_LE(err, kTolerance) << what;
  EXPECT_EQ(untouched_bad, 0) << what << ": elements past the counts were written";
}

void check_batched(const test::BatchedCase& c, const std::string& what) {
  ExpertsConfig cfg;
  cfg.format = ActivationFormat::batched_experts;
  const ExpertsInputs host_in = c.inputs();
  DeviceCase d = upload(host_in);
  const auto experts = make_cuda_experts(cfg);
  Tensor out = Tensor::empty(DType::bf16, experts->output_shape(d.in), gputest::gpu());
  gputest::poison(out);
  experts->apply(d.in, out.view());
  gputest::sync_ok();
  expect_batched_matches(host_in, to_host(out), what);
}

std::vector<std::int32_t> random_counts(std::mt19937_64& rng, int e_local, int max_tokens) {
  std::uniform_int_distribution<int> d(0, max_tokens);
  std::vector<std::int32_t> counts(static_cast<std::size_t>(e_local));
  for (auto& c : counts) c = d(rng);
  counts[0] = 0;  // an empty expert and a full one every time
  counts[static_cast<std::size_t>(e_local - 1)] = max_tokens;
  return counts;
}

std::string act_name(Activation a) { return std::string(activation_name(a)); }

// ---- Standard format -----------------------------------------------------------------------------

TEST(GpuExperts, StandardEveryActivationReducedMatchesFloat64Reference) {
  std::mt19937_64 rng(test::fresh_seed());
  for (Activation act : test::all_activations()) {
    test::StandardOptions o;
    o.m = 64, o.h = 2048, o.n = 256, o.k = 4, o.e_local = 8;
    o.wide = act == Activation::swigluoai;  // visit the clamps at +-7
    check_standard(test::make_standard(rng, act, o), true, GemmMode::loop, "standard reduce " + act_name(act));
  }
}

TEST(GpuExperts, StandardEveryActivationUnreducedHasZeroSlotsForMissingExperts) {
  std::mt19937_64 rng(test::fresh_seed());
  for (Activation act : test::all_activations()) {
    test::StandardOptions o;
    o.m = 48, o.h = 2048, o.n = 128, o.k = 3, o.e_local = 8, o.p_minus_one = 0.3;
    check_standard(test::make_standard(rng, act, o), false, GemmMode::loop, "standard unreduced " + act_name(act));
  }
}

TEST(GpuExperts, StandardExpertMapWithInt32Ids) {
  std::mt19937_64 rng(test::fresh_seed());
  test::StandardOptions o;
  o.m = 96, o.h = 2048, o.n = 128, o.k = 6, o.e_local = 8, o.e_global = 32, o.idx_int32 = true;
  check_standard(test::make_standard(rng, Activation::silu, o), true, GemmMode::loop, "expert_map int32 ids reduce");
  check_standard(test::make_standard(rng, Activation::gelu, o), false, GemmMode::loop,
                 "expert_map int32 ids unreduced");
}

TEST(GpuExperts, StandardRouterWeightOnInputWithFloat32Hidden) {
  std::mt19937_64 rng(test::fresh_seed());
  for (bool fp32 : {false, true}) {
    test::StandardOptions o;
    o.m = 80, o.h = 2048, o.n = 128, o.k = 1, o.e_local = 4, o.hidden_fp32 = fp32;
    test::StandardCase c = test::make_standard(rng, Activation::silu, o);
    c.weight_on_input = true;
    check_standard(c, true, GemmMode::loop, std::string("weight on input, hidden ") + (fp32 ? "fp32" : "bf16"));
    check_standard(c, false, GemmMode::loop,
                   std::string("weight on input unreduced, hidden ") + (fp32 ? "fp32" : "bf16"));
  }
  test::StandardOptions o;  // float32 hidden without the weight on the input
  o.m = 40, o.h = 2048, o.n = 128, o.k = 4, o.e_local = 8, o.hidden_fp32 = true;
  check_standard(test::make_standard(rng, Activation::gelu, o), true, GemmMode::loop, "hidden fp32, K = 4");
}

TEST(GpuExperts, StandardAndBatchedAtEveryHiddenSize) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t h : gputest::hidden_sizes()) {
    test::StandardOptions o;
    o.m = 32, o.h = h, o.n = 128, o.k = 4, o.e_local = 8;
    check_standard(test::make_standard(rng, Activation::silu, o), true, GemmMode::loop,
                   "standard H=" + std::to_string(h));
    check_batched(test::make_batched(rng, Activation::swigluoai, random_counts(rng, 4, 24), 24, h, 128),
                  "batched swigluoai H=" + std::to_string(h));
  }
}

TEST(GpuExperts, StandardEveryGemmMode) {
  std::mt19937_64 rng(test::fresh_seed());
  for (GemmMode mode : {GemmMode::loop, GemmMode::streams, GemmMode::grouped, GemmMode::automatic}) {
    test::StandardOptions o;
    o.m = 64, o.h = 2048, o.n = 128, o.k = 8, o.e_local = 16, o.p_minus_one = 0.05;
    const std::string m = experts_cuda::gemm_mode_name(mode);
    check_standard(test::make_standard(rng, Activation::silu, o), true, mode, "mode " + m + " silu reduce");
    check_standard(test::make_standard(rng, Activation::swigluoai, o), false, mode,
                   "mode " + m + " swigluoai unreduced");
  }
}

TEST(GpuExperts, StandardOneExpertTakesEveryToken) {
  std::mt19937_64 rng(test::fresh_seed());
  test::StandardOptions o;
  o.m = 512, o.h = 2048, o.n = 128, o.k = 4, o.e_local = 8;
  test::StandardCase c = test::make_standard(rng, Activation::gelu, o);
  auto* idx = c.topk_idx.ptr<std::int64_t>();
  auto* w = c.topk_weights.ptr<float>();
  for (std::int64_t i = 0; i < o.m * o.k; ++i) {
    idx[i] = i % o.k == 0 ? 5 : -1;
    if (idx[i] < 0) w[i] = 0.0f;
  }
  for (GemmMode mode : {GemmMode::loop, GemmMode::grouped})
    check_standard(c, true, mode, std::string("one expert takes every token, ") + experts_cuda::gemm_mode_name(mode));
}

TEST(GpuExperts, StandardWithoutLocalExpertsWritesZeros) {
  std::mt19937_64 rng(test::fresh_seed());
  test::StandardOptions o;
  o.m = 16, o.h = 2048, o.n = 64, o.k = 2, o.e_local = 4;
  test::StandardCase c = test::make_standard(rng, Activation::silu, o);
  auto* idx = c.topk_idx.ptr<std::int64_t>();
  for (std::int64_t i = 0; i < o.m * o.k; ++i) idx[i] = -1;
  DeviceCase d = upload(c.inputs());
  const auto experts = make_cuda_experts();
  Tensor out = Tensor::empty(DType::bf16, {o.m, o.h}, gputest::gpu());
  gputest::poison(out);
  experts->apply(d.in, out.view());
  gputest::sync_ok();
  const Tensor got = to_host(out);
  for (std::int64_t i = 0; i < got.numel(); ++i) ASSERT_EQ(got.ptr<bf16_t>()[i].bits, 0) << "element " << i;
}

// ---- zero tokens: nothing is enqueued -------------------------------------------------------------

std::size_t captured_nodes(const std::function<void()>& fn) {
  cudaStream_t s = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  StreamGuard guard(Stream{s});
  EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::string error;
  try {
    fn();
  } catch (const std::exception& e) {
    error = e.what();
  }
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  EXPECT_EQ(error, "");
  std::size_t nodes = 0;
  if (graph != nullptr) {
    EXPECT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(s);
  return nodes;
}

TEST(GpuExperts, ZeroTokensEnqueueNothing) {
  std::mt19937_64 rng(test::fresh_seed());
  test::StandardOptions o;
  o.m = 0, o.h = 2048, o.n = 64, o.k = 4, o.e_local = 4;
  const test::StandardCase c = test::make_standard(rng, Activation::silu, o);
  DeviceCase d = upload(c.inputs());
  for (bool reduce : {true, false}) {
    ExpertsConfig cfg;
    cfg.reduce = reduce;
    const auto experts = make_cuda_experts(cfg);
    const Shape shape = experts->output_shape(d.in);
    EXPECT_EQ(shape.numel(), 0);
    Tensor out = Tensor::empty(DType::bf16, shape, gputest::gpu());
    EXPECT_EQ(captured_nodes([&] { experts->apply(d.in, out.view()); }), 0u) << "reduce " << reduce;
  }
  // Batched with max_tokens == 0.
  const test::BatchedCase b = test::make_batched(rng, Activation::silu, {0, 0, 0}, 0, 2048, 64);
  DeviceCase db = upload(b.inputs());
  ExpertsConfig cfg;
  cfg.format = ActivationFormat::batched_experts;
  const auto experts = make_cuda_experts(cfg);
  Tensor out = Tensor::empty(DType::bf16, {3, 0, 2048}, gputest::gpu());
  EXPECT_EQ(captured_nodes([&] { experts->apply(db.in, out.view()); }), 0u) << "batched";
  gputest::sync_ok();
}

// ---- errors ---------------------------------------------------------------------------------------

template <class F>
void expect_invalid(F fn, const std::string& needle, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << what << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
  }
}

TEST(GpuExperts, BadArgumentsAreRejectedLikeTheCpu) {
  std::mt19937_64 rng(test::fresh_seed());
  test::StandardOptions o;
  o.m = 8, o.h = 2048, o.n = 64, o.k = 2, o.e_local = 4;
  test::StandardCase c = test::make_standard(rng, Activation::silu, o);
  const auto experts = make_cuda_experts();
  Tensor out = Tensor::empty(DType::bf16, {o.m, o.h}, gputest::gpu());
  {
    DeviceCase d = upload(c.inputs());
    ExpertsInputs cpu_hidden = d.in;
    cpu_hidden.hidden = c.x.view();
    expect_invalid([&] { experts->apply(cpu_hidden, out.view()); }, "hidden", "CPU hidden");
    expect_invalid([&] { experts->apply(d.in, c.x.view()); }, "out", "CPU out");
  }
  {
    c.topk_idx.ptr<std::int64_t>()[5] = 7;  // [2, 1], outside [-1, 4)
    DeviceCase d = upload(c.inputs());
    expect_invalid([&] { experts->apply(d.in, out.view()); }, "7 at [2, 1]", "id out of range");
    gputest::sync_ok();
  }
  {
    test::StandardOptions om = o;
    om.e_global = 16;
    test::StandardCase cm = test::make_standard(rng, Activation::silu, om);
    cm.expert_map.ptr<std::int32_t>()[3] = 9;  // outside [-1, 4)
    DeviceCase d = upload(cm.inputs());
    expect_invalid([&] { experts->apply(d.in, out.view()); }, "9 at 3", "bad expert_map entry");
    gputest::sync_ok();
  }
}

// ---- BatchedExperts format --------------------------------------------------------------------------

TEST(GpuExperts, BatchedEveryActivationLeavesRowsPastCountsUntouched) {
  std::mt19937_64 rng(test::fresh_seed());
  for (Activation act : test::all_activations()) {
    test::BatchedCase c = test::make_batched(rng, act, random_counts(rng, 6, 40), 40, 2048, 256);
    check_batched(c, "batched " + act_name(act));
  }
  // float32 hidden.
  test::BatchedCase c = test::make_batched(rng, Activation::gelu, random_counts(rng, 4, 16), 16, 2048, 128);
  c.x = test::random_f32(rng, 4 * 16, 2048);
  c.x = Tensor::wrap(TensorView(c.x.data(), DType::fp32, {4, 16, 2048}),
                     std::shared_ptr<void>(c.x.data(), [k = c.x](void*) {}));
  check_batched(c, "batched gelu fp32 hidden");
}

TEST(GpuExperts, BatchedOneCudaGraphReplayedWithNewInputsAndCounts) {
  std::mt19937_64 rng(test::fresh_seed());
  constexpr int E = 8, T = 64;
  constexpr std::int64_t H = 2048, N = 128;
  ExpertsConfig cfg;
  cfg.format = ActivationFormat::batched_experts;
  const auto experts = make_cuda_experts(cfg);
  test::BatchedCase c = test::make_batched(rng, Activation::silu, random_counts(rng, E, T), T, H, N);
  DeviceCase d = upload(c.inputs());  // the graph reads these buffers; replays refill them
  Tensor out = Tensor::empty(DType::bf16, {E, T, H}, gputest::gpu());

  cudaStream_t s = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  StreamGuard guard(Stream{s});
  // Once outside the capture (creates this thread's cuBLAS handle), checked like any call.
  GPU_CHECK(cudaMemsetAsync(out.data(), 0xff, out.nbytes(), s));
  experts->apply(d.in, out.view());
  GPU_CHECK(cudaStreamSynchronize(s));
  expect_batched_matches(c.inputs(), to_host(out), "graph warm-up");

  cudaGraph_t graph = nullptr;
  GPU_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  std::string error;
  try {
    experts->apply(d.in, out.view());
  } catch (const std::exception& e) {
    error = e.what();
  }
  GPU_CHECK(cudaStreamEndCapture(s, &graph));
  ASSERT_EQ(error, "");
  cudaGraphExec_t exec = nullptr;
  GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 4; ++replay) {
    // New activations and counts (weights stay: they are the layer's parameters).
    std::vector<std::int32_t> counts = random_counts(rng, E, T);
    if (replay == 3) counts.assign(E, 0);  // nothing to do: everything stays poisoned
    test::BatchedCase n = test::make_batched(rng, Activation::silu, counts, T, H, N);
    n.w = c.w;
    GPU_CHECK(cudaMemcpyAsync(d.x.data(), n.x.data(), n.x.nbytes(), cudaMemcpyHostToDevice, s));
    GPU_CHECK(cudaMemcpyAsync(d.counts.data(), n.counts.data(), n.counts.nbytes(), cudaMemcpyHostToDevice, s));
    GPU_CHECK(cudaMemsetAsync(out.data(), 0xff, out.nbytes(), s));
    GPU_CHECK(cudaGraphLaunch(exec, s));
    GPU_CHECK(cudaStreamSynchronize(s));
    const Tensor got = to_host(out);
    if (replay == 3) {
      std::int64_t written = 0;
      for (std::int64_t i = 0; i < got.numel(); ++i) written += got.ptr<bf16_t>()[i].bits != 0xffff;
      EXPECT_EQ(written, 0) << "replay with all counts 0";
    } else {
      expect_batched_matches(n.inputs(), got, "graph replay " + std::to_string(replay));
    }
  }
  GPU_CHECK(cudaGraphExecDestroy(exec));
  GPU_CHECK(cudaGraphDestroy(graph));
  GPU_CHECK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace epmoe
