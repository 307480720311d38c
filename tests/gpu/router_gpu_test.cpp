// CUDA router against the CPU router on the same inputs, bit for bit: topk_softmax, topk_sigmoid and
// grouped_topk (DeepSeek-V2/V3 settings) over T in {0, 1, 7, 128, 4096}, E in {64, 256}, K in {1, 8, 9},
// float32 and bfloat16 logits, random logits, logits with many ties, and one expert winning every token.
#include <gtest/gtest.h>

#include <epmoe/router.hpp>

#include <random>

#include "gpu/gpu_util.hpp"
#include "router/router.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::same_bits;
using gputest::to_device;
using gputest::to_host;

enum class Pattern { random, ties, one_expert };
const char* name(Pattern p) { return p == Pattern::random ? "random" : p == Pattern::ties ? "ties" : "one_expert"; }

Tensor make_logits(std::mt19937_64& rng, std::int64_t T, int E, DType dtype, Pattern pattern) {
  Tensor f = Tensor::empty(DType::fp32, {T, E});
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::uniform_int_distribution<int> level(-4, 4);
  float* p = f.ptr<float>();
  for (std::int64_t i = 0; i < T * E; ++i) {
    if (pattern == Pattern::ties)
      p[i] = 0.5f * static_cast<float>(level(rng));  // 9 values: many exact ties
    else
      p[i] = u(rng);
    if (pattern == Pattern::one_expert && i % E == 5) p[i] = 30.0f;  // expert 5 wins every token
  }
  if (dtype == DType::fp32) return f;
  Tensor b = Tensor::empty(DType::bf16, {T, E});
  for (std::int64_t i = 0; i < T * E; ++i) b.ptr<bf16_t>()[i] = float_to_bf16(p[i]);
  return b;
}

void expect_same(const TopkResult& cpu, const TopkResult& gpu, const std::string& what) {
  const Tensor w = to_host(gpu.topk_weights), id = to_host(gpu.topk_idx);
  EXPECT_TRUE(same_bits(cpu.topk_idx, id)) << what;
  EXPECT_TRUE(same_bits(cpu.topk_weights, w)) << what;
}

TEST(GpuRouter, TopkSoftmaxAndSigmoidMatchCpuBitForBit) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t T : gputest::token_counts())
    for (int E : {64, 256})
      for (int K : {1, 8, 9})
        for (DType dtype : {DType::fp32, DType::bf16})
          for (Pattern pattern : {Pattern::random, Pattern::ties, Pattern::one_expert}) {
            const Tensor logits = make_logits(rng, T, E, dtype, pattern);
            const Tensor dev = to_device(logits);
            for (bool renormalize : {false, true}) {
              const std::string what = "T=" + std::to_string(T) + " E=" + std::to_string(E) +
                                       " K=" + std::to_string(K) + " " + std::string(dtype_name(dtype)) + " " +
                                       name(pattern) + " renormalize=" + std::to_string(renormalize);
              expect_same(topk_softmax(logits, K, renormalize), topk_softmax(dev, K, renormalize), "softmax " + what);
              expect_same(topk_sigmoid(logits, K, renormalize), topk_sigmoid(dev, K, renormalize), "sigmoid " + what);
              if (HasFailure()) return;
            }
          }
}

TEST(GpuRouter, GroupedTopkMatchesCpuBitForBit) {
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<float> bias_value(-0.3f, 0.3f);
  struct Setting {
    int groups, topk_group;
    ScoringFunc scoring;
    bool bias;
    float scale;
  };
  // DeepSeek-V3 (sigmoid, correction bias, 8 groups keep 4, scale 2.5) and V2-style (softmax, group max).
  const Setting settings[] = {{8, 4, ScoringFunc::sigmoid, true, 2.5f},
                              {8, 3, ScoringFunc::softmax, false, 16.0f},
                              {4, 2, ScoringFunc::softmax, true, 1.0f},
                              {8, 8, ScoringFunc::sigmoid, true, 1.0f}};
  for (std::int64_t T : gputest::token_counts())
    for (int E : {64, 256})
      for (int K : {1, 8, 9})
        for (Pattern pattern : {Pattern::random, Pattern::ties, Pattern::one_expert})
          for (const Setting& s : settings) {
            if (K > s.topk_group * (E / s.groups)) continue;
            const DType dtype = pattern == Pattern::ties ? DType::bf16 : DType::fp32;
            const Tensor logits = make_logits(rng, T, E, dtype, pattern);
            const Tensor dev = to_device(logits);
            Tensor bias = Tensor::empty(DType::fp32, {E});
            for (int e = 0; e < E; ++e)
              bias.ptr<float>()[e] = pattern == Pattern::ties ? 0.125f * static_cast<float>(e % 3) : bias_value(rng);
            const Tensor bias_dev = to_device(bias);
            for (bool renormalize : {false, true}) {
              GroupedTopkOptions o;
              o.num_topk = K;
              o.num_expert_group = s.groups;
              o.topk_group = s.topk_group;
              o.scoring = s.scoring;
              o.renormalize = renormalize;
              o.routed_scaling_factor = s.scale;
              if (s.bias) o.e_score_correction_bias = bias;
              const TopkResult cpu = grouped_topk(logits, o);
              if (s.bias) o.e_score_correction_bias = bias_dev;
              const TopkResult gpu = grouped_topk(dev, o);
              expect_same(cpu, gpu,
                          "grouped T=" + std::to_string(T) + " E=" + std::to_string(E) + " K=" + std::to_string(K) +
                              " groups=" + std::to_string(s.groups) + "/" + std::to_string(s.topk_group) +
                              " bias=" + std::to_string(s.bias) + " " + name(pattern) +
                              " renormalize=" + std::to_string(renormalize));
              if (HasFailure()) return;
            }
          }
}

// The kernel writes every output element: outputs poisoned with 0xff first, through the internal entry.
TEST(GpuRouter, KernelWritesEveryOutputOfPoisonedBuffers) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t T : {std::int64_t{7}, std::int64_t{128}}) {
    const int E = 256, K = 9;
    const Tensor logits = make_logits(rng, T, E, DType::fp32, Pattern::random);
    const Tensor dev = to_device(logits);
    const TopkResult cpu = topk_softmax(logits, K, true);
    Tensor w = Tensor::empty(DType::fp32, {T, K}, gputest::gpu());
    Tensor id = Tensor::empty(DType::int64, {T, K}, gputest::gpu());
    gputest::poison(w);
    gputest::poison(id);
    router_detail::RoutingProblem p;
    p.logits = dev;
    p.num_tokens = T;
    p.num_experts = E;
    p.num_topk = K;
    p.renormalize = true;
    router_detail::route_cuda(p, w.ptr<float>(), id.ptr<std::int64_t>(), Stream{});
    gputest::sync_ok();
    EXPECT_TRUE(same_bits(cpu.topk_weights, to_host(w)));
    EXPECT_TRUE(same_bits(cpu.topk_idx, to_host(id)));
  }
}

TEST(GpuRouter, RunsOnAnExplicitStream) {
  std::mt19937_64 rng(test::fresh_seed());
  cudaStream_t stream = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Tensor logits = make_logits(rng, 128, 64, DType::bf16, Pattern::random);
  const Tensor dev = to_device(logits);
  const TopkResult gpu = topk_sigmoid(dev, 8, true, Stream{stream});
  GPU_CHECK(cudaStreamSynchronize(stream));
  expect_same(topk_sigmoid(logits, 8, true), gpu, "explicit stream");
  EXPECT_EQ(current_stream().handle, nullptr);  // the guard restored the default stream
  GPU_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace epmoe
