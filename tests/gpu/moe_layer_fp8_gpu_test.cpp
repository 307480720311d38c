// fp8 block-scaled experts through the MoE layer on one GPU (semantics §8; ExpertsQuant::fp8_block):
// MoEForwardArgs::w1_scale / w2_scale reach make_cuda_experts' fp8 path for the no-EP (standard and batched),
// normal and low-latency prepare/finalize (one-rank cuda_ipc Buffer), bf16 dispatch. Expected against the naive
// float64 model of tests/support/experts_fp8_reference (weights dequantized per 128x128 block, the activations
// quantized per 1x128 group as the GEMMs see them), relative L2 <= 1e-2 (semantics §13), outputs poisoned first, at
// H = 2048 and H = 2880 (a partial last block), two forwards each. Also the GPU-side argument errors (fp8 weights
// without scales, scales on the CPU, bf16 weights) named before any communication, the layer staying usable.
#include <gtest/gtest.h>

#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/group.hpp>
#include <epmoe/moe.hpp>
#include <epmoe/stream.hpp>

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "experts/experts_fp8_test_util.hpp"
#include "gpu/gpu_util.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::cuda_ok;
using gputest::to_device;
using gputest::to_host;

constexpr double kTolerance = 1e-2;  // semantics §13

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
  std::int64_t T = 48, H = 2048, N = 256;
  test::Fp8Weights w;  // host
  std::vector<Tensor> x, idx, tw;  // host, per forward
};

Problem make_problem(std::uint64_t seed, std::int64_t H, int forwards) {
  std::mt19937_64 rng(seed);
  Problem p;
  p.H = H;
  p.w = test::random_fp8_weights(rng, p.E, p.N, p.H, Activation::silu);
  for (int f = 0; f < forwards; ++f) {
    p.x.push_back(test::random_bf16(rng, p.T, p.H));
    p.idx.push_back(test::random_topk_idx(rng, p.T, p.K, p.E));
    p.tw.push_back(test::random_topk_weights(rng, p.idx.back()));
  }
  return p;
}

std::unique_ptr<MoELayer> make_layer(Mode mode, const Problem& p, Group& g) {
  ExpertsConfig ec;
  ec.quant = ExpertsQuant::fp8_block;
  const bool batched = mode == Mode::no_ep_batched || mode == Mode::low_latency;
  ec.format = batched ? ActivationFormat::batched_experts : ActivationFormat::standard;
  std::shared_ptr<PrepareFinalize> pf;
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
  return std::make_unique<MoELayer>(pf, std::shared_ptr<Experts>(make_cuda_experts(ec)));
}

struct DeviceWeights {
  Tensor w1, w1s, w2, w2s;
};
DeviceWeights upload(const test::Fp8Weights& w) {
  return {to_device(w.w1), to_device(w.w1_scales), to_device(w.w2), to_device(w.w2_scales)};
}

MoEForwardArgs args_of(const DeviceWeights& dw, const Tensor& x, const Tensor& idx, const Tensor& tw, int E) {
  MoEForwardArgs a;
  a.hidden = x;
  a.w1 = dw.w1;
  a.w2 = dw.w2;
  a.w1_scale = dw.w1s;
  a.w2_scale = dw.w2s;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.global_num_experts = E;
  return a;
}

double error_of(const Problem& p, int f, const Tensor& got_host) {
  const auto fu = static_cast<std::size_t>(f);
  const std::vector<double> want =
      test::naive_fp8_experts_standard(p.x[fu], {}, p.w.w1, p.w.w1_scales, p.w.w2, p.w.w2_scales, p.tw[fu], p.idx[fu],
                                       Activation::silu, {}, false, true);
  return test::relative_l2(want, got_host.view());
}

void check_mode(Mode mode) {
  if (gputest::gpu_count() < 1) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  std::uint64_t i = 0;
  for (std::int64_t H : {std::int64_t{2048}, std::int64_t{2880}}) {
    const Problem p = make_problem(seed + i++, H, 2);
    run_thread_ranks(1, [&](Group& g) {
      cuda_ok(cudaSetDevice(0), "cudaSetDevice");
      auto layer = make_layer(mode, p, g);
      const DeviceWeights dw = upload(p.w);
      for (int f = 0; f < 2; ++f) {
        const auto fu = static_cast<std::size_t>(f);
        const Tensor x = to_device(p.x[fu]), idx = to_device(p.idx[fu]), tw = to_device(p.tw[fu]);
        Tensor out = Tensor::empty(DType::bf16, {p.T, p.H}, gputest::gpu());
        gputest::poison(out);
        MoEForwardArgs a = args_of(dw, x, idx, tw, p.E);
        if (f == 0) a.output = out;  // forward 1: the layer allocates the output
        const MoEForwardResult r = layer->forward(a);
        cuda_ok(cudaDeviceSynchronize(), "sync");
        const std::string what = std::string(mode_name(mode)) + " fp8 weights H=" + std::to_string(H) + " forward " +
                                 std::to_string(f) + " seed " + std::to_string(seed);
        if (f == 0) EXPECT_EQ(r.output.data(), out.data()) << what << ": not written into the given output";
        const double err = error_of(p, f, to_host(r.output));
        std::printf("[ rel_l2   ] %-72s %.3e\n", what.c_str(), err);
        EXPECT_LE(err, kTolerance) << what;
      }
    });
  }
}

TEST(GpuMoELayerFp8, NoEpStandardMatchesTheFloat64Model) { check_mode(Mode::no_ep_standard); }
TEST(GpuMoELayerFp8, NoEpBatchedMatchesTheFloat64Model) { check_mode(Mode::no_ep_batched); }
TEST(GpuMoELayerFp8, NormalMatchesTheFloat64Model) { check_mode(Mode::normal); }
TEST(GpuMoELayerFp8, LowLatencyMatchesTheFloat64Model) { check_mode(Mode::low_latency); }

// Refused calls name the argument, leave the stage INITIAL, and a good call afterwards still matches.
TEST(GpuMoELayerFp8, BadScalesAreNamedBeforeAnyCommunication) {
  if (gputest::gpu_count() < 1) GTEST_SKIP() << "no GPU";
  const std::uint64_t seed = test::fresh_seed();
  const Problem p = make_problem(seed, 2048, 1);
  for (Mode mode : {Mode::normal, Mode::low_latency})
    run_thread_ranks(1, [&](Group& g) {
      cuda_ok(cudaSetDevice(0), "cudaSetDevice");
      auto layer = make_layer(mode, p, g);
      const DeviceWeights dw = upload(p.w);
      const Tensor x = to_device(p.x[0]), idx = to_device(p.idx[0]), tw = to_device(p.tw[0]);
      const Tensor bf16_w1 = to_device(Tensor::zeros(DType::bf16, dw.w1.shape()));
      auto expect_error = [&](MoEForwardArgs a, const char* name, const char* part) {
        try {
          layer->forward(a);
          ADD_FAILURE() << mode_name(mode) << ": no error for a bad '" << name << "'";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
          EXPECT_NE(std::string(e.what()).find(std::string("'") + name + "'"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
        }
        EXPECT_EQ(layer->prepare_finalize().stage(), Stage::initial);
      };
      MoEForwardArgs a = args_of(dw, x, idx, tw, p.E);
      a.w1_scale = TensorView();
      expect_error(a, "w1_scale", "None");
      a = args_of(dw, x, idx, tw, p.E);
      a.w2_scale = p.w.w2_scales;  // on the CPU
      expect_error(a, "w2_scale", "cpu");
      a = args_of(dw, x, idx, tw, p.E);
      a.w1 = bf16_w1;
      expect_error(a, "w1", "float8_e4m3fn");
      const MoEForwardResult r = layer->forward(args_of(dw, x, idx, tw, p.E));
      cuda_ok(cudaDeviceSynchronize(), "sync");
      const double err = error_of(p, 0, to_host(r.output));
      const std::string what = std::string(mode_name(mode)) + " after the refused calls";
      std::printf("[ rel_l2   ] %-72s %.3e\n", what.c_str(), err);
      EXPECT_LE(err, kTolerance) << mode_name(mode) << " seed " << seed;
    });
}

}  // namespace
}  // namespace epmoe
