// CPU experts (OpenBLAS path) at the OLMoE shape: H = 2048, N = 1024, E_local = 16, K = 8, silu.
//
//   build/<dir>/bench/bench_experts_cpu [--benchmark_filter=...]
//
// Arg M = tokens. Routing is uniform at random, fresh per run, fixed across iterations:
//   Standard/all_local:  each token picks K = 8 distinct experts among the 16 local ones (M*K slots).
//   Standard/ep4:        K = 8 of E = 64 global experts with an expert_map keeping 16 (a rank of EP=4
//                        on OLMoE; ~M*K/4 slots are local).
//   Batched:             the same M*K rows spread evenly as [16, M*K/16, H] slabs.
//   OneTokenPerExpert:   16 rows, one per expert: the per-call cost that does not scale with tokens
//                        (mostly widening 16 experts' weights from bf16 to float32).
// Counters: GFLOP/s = 2 * local_slots * (2N*H + H*N) / wall time (the two GEMMs; activation and data
// movement not counted), slots = local (token, expert) pairs, GFLOP_per_cpu_s = the same flops per
// second of process CPU time (all threads): on a shared machine, where wall time mostly measures the
// neighbours, this is the figure to compare (with OPENBLAS_NUM_THREADS=1 it is the one-core rate).
#include <benchmark/benchmark.h>

#include <epmoe/experts.hpp>

#include <time.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

namespace {

using namespace epmoe;

constexpr std::int64_t kH = 2048, kN = 1024, kELocal = 16;
constexpr int kTopK = 8;

Tensor random_bf16(std::mt19937_64& rng, Shape shape, float scale) {
  Tensor t = Tensor::empty(DType::bf16, shape);
  std::uniform_real_distribution<float> d(-scale, scale);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<bf16_t>()[i] = float_to_bf16(d(rng));
  return t;
}

struct Problem {
  Tensor x, w1, w2, idx, wts, map, counts;
  std::int64_t slots = 0;  // local (token, expert) pairs
};

// Weights once per process: 16 experts are 200 MB of bf16, too slow to regenerate per benchmark.
const Problem& weights() {
  static const Problem p = [] {
    std::mt19937_64 rng(1234);
    Problem w;
    w.w1 = random_bf16(rng, Shape{kELocal, 2 * kN, kH}, 6.0f / std::sqrt(static_cast<float>(kH)));
    w.w2 = random_bf16(rng, Shape{kELocal, kH, kN}, 3.0f / std::sqrt(static_cast<float>(kN)));
    return w;
  }();
  return p;
}

Problem standard_problem(std::int64_t m, int e_global) {
  std::mt19937_64 rng(std::random_device{}());
  Problem p = weights();
  p.x = random_bf16(rng, Shape{m, kH}, 1.0f);
  p.idx = Tensor::empty(DType::int64, {m, kTopK});
  p.wts = Tensor::empty(DType::fp32, {m, kTopK});
  std::vector<std::int64_t> ids(static_cast<std::size_t>(e_global));
  std::iota(ids.begin(), ids.end(), 0);
  std::uniform_real_distribution<float> wd(0.05f, 1.0f);
  for (std::int64_t t = 0; t < m; ++t) {
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int k = 0; k < kTopK; ++k) {
      p.idx.ptr<std::int64_t>()[t * kTopK + k] = ids[static_cast<std::size_t>(k)];
      p.wts.ptr<float>()[t * kTopK + k] = wd(rng);
      p.slots += ids[static_cast<std::size_t>(k)] < kELocal;  // the map below keeps ids [0, 16)
    }
  }
  if (e_global != kELocal) {
    p.map = Tensor::empty(DType::int32, {e_global});
    for (int g = 0; g < e_global; ++g) p.map.ptr<std::int32_t>()[g] = g < kELocal ? g : -1;
  }
  return p;
}

ExpertsInputs standard_inputs(const Problem& p) {
  ExpertsInputs in;
  in.hidden = p.x;
  in.w1 = p.w1;
  in.w2 = p.w2;
  in.topk_idx = p.idx;
  in.topk_weights = p.wts;
  in.activation = Activation::silu;
  if (p.map.defined()) in.expert_map = p.map;
  return in;
}

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void report(benchmark::State& state, std::int64_t slots, double cpu_seconds) {
  const double flops = 2.0 * static_cast<double>(slots) * static_cast<double>(2 * kN * kH + kH * kN);
  state.counters["slots"] = static_cast<double>(slots);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP_per_cpu_s"] = flops * 1e-9 * static_cast<double>(state.iterations()) / cpu_seconds;
}

void run_standard(benchmark::State& state, int e_global, bool reduce) {
  const Problem p = standard_problem(state.range(0), e_global);
  const auto experts = make_blas_experts({ActivationFormat::standard, reduce});
  const ExpertsInputs in = standard_inputs(p);
  Tensor out = Tensor::empty(DType::bf16, experts->output_shape(in));
  const double cpu0 = process_cpu_seconds();
  for (auto _ : state) {
    experts->apply(in, out);
    benchmark::DoNotOptimize(out.data());
  }
  report(state, p.slots, process_cpu_seconds() - cpu0);
}

void BM_Standard_all_local(benchmark::State& state) { run_standard(state, kELocal, true); }
void BM_Standard_all_local_unreduced(benchmark::State& state) { run_standard(state, kELocal, false); }
void BM_Standard_ep4(benchmark::State& state) { run_standard(state, 4 * kELocal, true); }

void run_batched(benchmark::State& state, std::int64_t rows_per_expert) {
  std::mt19937_64 rng(std::random_device{}());
  Problem p = weights();
  const std::int64_t max_tokens = std::max<std::int64_t>(rows_per_expert, 1);
  p.x = random_bf16(rng, Shape{kELocal, max_tokens, kH}, 1.0f);
  p.counts = Tensor::empty(DType::int32, {kELocal});
  for (std::int64_t e = 0; e < kELocal; ++e)
    p.counts.ptr<std::int32_t>()[e] = static_cast<std::int32_t>(rows_per_expert);
  const auto experts = make_blas_experts({ActivationFormat::batched_experts});
  ExpertsInputs in;
  in.hidden = p.x;
  in.w1 = p.w1;
  in.w2 = p.w2;
  in.expert_num_tokens = p.counts;
  in.activation = Activation::silu;
  Tensor out = Tensor::zeros(DType::bf16, experts->output_shape(in));
  const double cpu0 = process_cpu_seconds();
  for (auto _ : state) {
    experts->apply(in, out);
    benchmark::DoNotOptimize(out.data());
  }
  report(state, rows_per_expert * kELocal, process_cpu_seconds() - cpu0);
}

void BM_Batched(benchmark::State& state) { run_batched(state, state.range(0) * kTopK / kELocal); }
void BM_OneTokenPerExpert(benchmark::State& state) { run_batched(state, 1); }

}  // namespace

BENCHMARK(BM_Standard_all_local)->Arg(256)->Arg(32)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Standard_all_local_unreduced)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Standard_ep4)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Batched)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_OneTokenPerExpert)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
