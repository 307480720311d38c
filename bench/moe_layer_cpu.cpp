// The MoE layer's phases on CPU thread ranks, next to the same expert work on one rank with no
// dispatch, in one run (OLMoE-1B-7B shapes by default: H=2048, E=64, K=8, N=1024).
//   bench_moe_layer_cpu [--benchmark_...]   (EPMOE_BENCH_TOKENS=T per rank, default 128)
#include <benchmark/benchmark.h>
#include <epmoe/moe.hpp>
#include <epmoe/router.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>

namespace {

using namespace epmoe;
using Clock = std::chrono::steady_clock;
constexpr std::int64_t H = 2048, N = 1024;
constexpr int E = 64, K = 8;

std::int64_t tokens_per_rank() {
  const char* s = std::getenv("EPMOE_BENCH_TOKENS");
  return s ? std::atoll(s) : 128;
}

Tensor random_bf16(std::mt19937_64& rng, Shape s, float scale) {
  Tensor t = Tensor::empty(DType::bf16, s);
  std::uniform_real_distribution<float> d(-scale, scale);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<bf16_t>()[i] = float_to_bf16(d(rng));
  return t;
}

struct Weights {
  Tensor w1, w2;
};
const Weights& weights() {
  static const Weights w = [] {
    std::mt19937_64 rng(7);
    return Weights{random_bf16(rng, {E, 2 * N, H}, 0.02f), random_bf16(rng, {E, H, N}, 0.03f)};
  }();
  return w;
}

struct Inputs {
  Tensor x;
  TopkResult routing;
};
Inputs make_inputs(std::int64_t T, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Tensor logits = Tensor::empty(DType::fp32, {T, E});
  std::normal_distribution<float> d;
  for (std::int64_t i = 0; i < logits.numel(); ++i) logits.ptr<float>()[i] = d(rng);
  return {random_bf16(rng, {T, H}, 1.0f), topk_softmax(logits, K, true)};
}

// R thread ranks, normal or low-latency mode: per-phase times (slowest rank) as counters.
void BM_LayerOnThreadRanks(benchmark::State& state) {
  const int R = static_cast<int>(state.range(0));
  const bool low_latency = state.range(1) != 0;
  const std::int64_t T = tokens_per_rank();
  double dispatch_s = 0, experts_s = 0, combine_s = 0;
  std::int64_t iterations = 0;
  for (auto _ : state) {
    std::vector<double> d(static_cast<std::size_t>(R)), x(static_cast<std::size_t>(R)), c(static_cast<std::size_t>(R));
    run_thread_ranks(R, [&](Group& g) {
      std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
      const int r = g.rank(), E_local = E / R;
      auto buffer = std::make_shared<Buffer>(group);
      auto pf = low_latency ? make_low_latency_prepare_finalize(buffer, static_cast<int>(T))
                            : make_normal_prepare_finalize(buffer);
      ExpertsConfig ec;
      ec.format = low_latency ? ActivationFormat::batched_experts : ActivationFormat::standard;
      std::shared_ptr<Experts> experts(make_blas_experts(ec));
      MoELayer layer(pf, experts);
      const Inputs in = make_inputs(T, 100 + static_cast<std::uint64_t>(r));
      MoEForwardArgs a;
      a.hidden = in.x;
      a.w1 = weights().w1.view().slice_rows(r * E_local, (r + 1) * E_local);
      a.w2 = weights().w2.view().slice_rows(r * E_local, (r + 1) * E_local);
      a.topk_idx = in.routing.topk_idx;
      a.topk_weights = in.routing.topk_weights;
      a.global_num_experts = E;
      g.barrier("bench");
      auto t0 = Clock::now();
      pf->dispatch_a({a.hidden, a.topk_idx, a.topk_weights, E, false});
      const PrepareOutput p = pf->dispatch_b();
      auto t1 = Clock::now();
      const Tensor fused = layer.run_experts(p, a);
      auto t2 = Clock::now();
      g.barrier("bench.combine");
      auto t3 = Clock::now();
      pf->combine_a(fused, experts->weight_and_reduce());
      pf->combine_b();
      auto t4 = Clock::now();
      d[static_cast<std::size_t>(r)] = std::chrono::duration<double>(t1 - t0).count();
      x[static_cast<std::size_t>(r)] = std::chrono::duration<double>(t2 - t1).count();
      c[static_cast<std::size_t>(r)] = std::chrono::duration<double>(t4 - t3).count();
    });
    dispatch_s += *std::max_element(d.begin(), d.end());
    experts_s += *std::max_element(x.begin(), x.end());
    combine_s += *std::max_element(c.begin(), c.end());
    ++iterations;
  }
  state.counters["dispatch_ms"] = dispatch_s / static_cast<double>(iterations) * 1e3;
  state.counters["experts_ms"] = experts_s / static_cast<double>(iterations) * 1e3;
  state.counters["combine_ms"] = combine_s / static_cast<double>(iterations) * 1e3;
  state.counters["tokens_per_rank"] = static_cast<double>(T);
}

// The same expert work (all R*T tokens, all E experts) on one rank, no dispatch.
void BM_ExpertsOneRankNoDispatch(benchmark::State& state) {
  const int R = static_cast<int>(state.range(0));
  const std::int64_t T = tokens_per_rank() * R;
  const Inputs in = make_inputs(T, 100);
  std::shared_ptr<Experts> experts(make_blas_experts());
  MoELayer layer(make_no_ep_prepare_finalize(), experts);
  MoEForwardArgs a;
  a.hidden = in.x;
  a.w1 = weights().w1;
  a.w2 = weights().w2;
  a.topk_idx = in.routing.topk_idx;
  a.topk_weights = in.routing.topk_weights;
  a.global_num_experts = E;
  for (auto _ : state) benchmark::DoNotOptimize(layer.forward(a).output.data());
  state.counters["tokens"] = static_cast<double>(T);
  state.counters["GFLOP/s"] = benchmark::Counter(static_cast<double>(T) * K * 2.0 * 3.0 * N * H / 1e9 *
                                                     static_cast<double>(state.iterations()),
                                                 benchmark::Counter::kIsRate);
}

BENCHMARK(BM_LayerOnThreadRanks)->ArgsProduct({{4}, {0, 1}})->ArgNames({"ranks", "low_latency"})->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK(BM_ExpertsOneRankNoDispatch)->Arg(4)->ArgName("ranks_equivalent")->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
