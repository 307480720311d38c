// The all-gather + reduce-scatter prepare/finalize (make_all_gather_prepare_finalize) next to normal mode's
// (make_normal_prepare_finalize over a threads Buffer) on thread ranks, each next to a plain memcpy of the bytes it
// moves, measured in the same run (semantics §12).
//
//   build/<dir>/bench/bench_threads_all_gather [--benchmark_filter=...]
//   EPMOE_BENCH_T=<tokens per rank> overrides T.
//
// Shapes: H = 7168, K = 8, E = 256 (SPEC §12's normal-mode defaults), uniform random routing, T = 1024 tokens per
// rank by default rather than 4096: every all-gather rank holds all R * T rows (gathered, the experts' stand-in output,
// its reduced copy, in bfloat16) and the float32 partials it reduce-scatters, ~10 R T H bytes per rank, plus the memcpy
// floor's buffers: ~8 GB in all at R = 4, T = 4096, more than a small CPU host has. Once the rows outgrow the caches
// (T = 1024 is 58 MB of rows per rank) the ratio to memcpy hardly depends on T.
//
// Rows (each the prepare/finalize's own calls, no experts; the combine gets WeightAndReduce::none of a [M, H] expert
// output so neither side pays a weight-and-reduce):
//   dispatch  -- dispatch_a + dispatch_b. Bytes: what every rank receives, summed over the ranks: all_gather
//                R * T rows of H bfloat16 (+ ids and weights) per rank; normal the rows of its recv_x.
//   combine   -- combine_a + combine_b. Bytes: all_gather the float32 partials each rank reads to sum its block,
//                R * T * H * 4 per rank; normal the rows of its recv_x.
// "vs_memcpy" is the memcpy's time over the op's median: every rank memcpy'ing its share of those bytes at once
// (source and destination faulted in), the median of 5, just before the op's runs.
#include <benchmark/benchmark.h>

#include <epmoe/moe.hpp>

#include "bench_util.hpp"
#include "rank_threads.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace {

using namespace epmoe;
using Clock = std::chrono::steady_clock;

constexpr std::int64_t kHidden = 7168;
constexpr int kTopk = 8, kExperts = 256;

using bench::RankThreads;
using bench::splitmix;

struct Rank {
  std::shared_ptr<Group> group;
  Tensor x, topk_idx, topk_weights;
  std::shared_ptr<PrepareFinalize> pf;
  Tensor fused;  ///< the experts' stand-in output [M, H] (M from the last dispatch)
  Tensor memcpy_src, memcpy_dst;
};

struct World {
  int R = 0;
  std::int64_t T = 0;
  bool all_gather = false;
  std::unique_ptr<ThreadWorld> world;
  std::unique_ptr<RankThreads> threads;
  std::vector<Rank> ranks;
};

std::int64_t tokens() {
  if (const char* s = std::getenv("EPMOE_BENCH_T")) return std::atoll(s);
  return 1024;
}

World& world_for(int R, bool all_gather) {
  static std::unique_ptr<World> w;
  if (w && w->R == R && w->all_gather == all_gather) return *w;
  w.reset();  // free the previous shape first
  w = std::make_unique<World>();
  w->R = R;
  w->T = tokens();
  w->all_gather = all_gather;
  w->world = std::make_unique<ThreadWorld>(R);
  w->threads = std::make_unique<RankThreads>(R);
  w->ranks.resize(static_cast<std::size_t>(R));
  const std::int64_t T = w->T, H = kHidden;
  w->threads->run([&](int r) {  // each rank fills its own inputs (first touch on its thread)
    Rank& k = w->ranks[static_cast<std::size_t>(r)];
    k.group = w->world->group(r);
    k.pf = all_gather ? make_all_gather_prepare_finalize(k.group)
                      : make_normal_prepare_finalize(std::make_shared<Buffer>(k.group));
    std::uint64_t s = 7654321ull * static_cast<std::uint64_t>(r + 1);
    k.x = Tensor::empty(DType::bf16, {T, H});
    for (std::int64_t i = 0; i < T * H; ++i) {  // finite values of moderate magnitude
      const std::uint64_t b = splitmix(s);
      k.x.ptr<bf16_t>()[i] = bf16_t{static_cast<std::uint16_t>((b & 0x807f) | ((120 + (b >> 8) % 12) << 7))};
    }
    k.topk_idx = Tensor::empty(DType::int64, {T, kTopk});
    k.topk_weights = Tensor::empty(DType::fp32, {T, kTopk});
    for (std::int64_t t = 0; t < T; ++t) {
      std::int64_t* row = k.topk_idx.ptr<std::int64_t>() + t * kTopk;
      for (int j = 0; j < kTopk; ++j) {
        std::int64_t e;
        do e = static_cast<std::int64_t>(splitmix(s) % kExperts);
        while (std::find(row, row + j, e) != row + j);
        row[j] = e;
        k.topk_weights.ptr<float>()[t * kTopk + j] = 0.125f;
      }
    }
  });
  return *w;
}

PrepareInputs inputs_of(const Rank& k) { return {k.x, k.topk_idx, k.topk_weights, kExperts, false}; }

/// One dispatch per rank (rows M known after it), then the stand-in expert output and the memcpy buffers of
/// `bytes(rank, M)` bytes. Returns the bytes summed over the ranks.
std::int64_t prepare(World& w, const std::function<std::size_t(const Rank&, std::int64_t M)>& bytes) {
  std::vector<std::int64_t> per(static_cast<std::size_t>(w.R));
  w.threads->run([&](int r) {
    Rank& k = w.ranks[static_cast<std::size_t>(r)];
    k.pf->dispatch_a(inputs_of(k));
    const std::int64_t M = k.pf->dispatch_b().hidden.size(0);
    k.fused = Tensor::empty(DType::bf16, {M, kHidden});
    std::memset(k.fused.data(), 0x3c, k.fused.nbytes());  // 0x3c3c: a finite bf16 (~0.0115)
    k.pf->combine_a(k.fused, WeightAndReduce::none);
    (void)k.pf->combine_b();
    const std::size_t b = bytes(k, M);
    k.memcpy_src = Tensor::empty(DType::int8, {static_cast<std::int64_t>(b)});
    k.memcpy_dst = Tensor::empty(DType::int8, {static_cast<std::int64_t>(b)});
    std::memset(k.memcpy_src.data(), 1, b);  // fault both in
    std::memset(k.memcpy_dst.data(), 2, b);
    per[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(b);
  });
  std::int64_t total = 0;
  for (auto b : per) total += b;
  return total;
}

double memcpy_seconds(World& w) {
  std::vector<double> t;
  for (int i = 0; i < 5; ++i)
    t.push_back(w.threads->run([&](int r) {
      Rank& k = w.ranks[static_cast<std::size_t>(r)];
      std::memcpy(k.memcpy_dst.data(), k.memcpy_src.data(), k.memcpy_src.nbytes());
    }));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void report(benchmark::State& state, const World& w, std::int64_t bytes, double memcpy_s, std::vector<double> times) {
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * bytes);
  state.counters["T"] = static_cast<double>(w.T);
  state.counters["MB"] = static_cast<double>(bytes) / 1e6;
  state.counters["median_ms"] = median * 1e3;
  state.counters["memcpy_ms"] = memcpy_s * 1e3;
  state.counters["vs_memcpy"] = memcpy_s / median;
}

// phase 0: dispatch; 1: combine.
void BM_phase(benchmark::State& state, bool all_gather, int phase) {
  const int R = static_cast<int>(state.range(0));
  World& w = world_for(R, all_gather);
  const std::int64_t bytes = prepare(w, [&](const Rank& k, std::int64_t M) -> std::size_t {
    const auto rows = static_cast<std::size_t>(M), H = static_cast<std::size_t>(kHidden);
    if (!all_gather) return rows * H * 2;  // normal: recv_x, both ways
    if (phase == 1) return rows * H * 4;   // the float32 partials summed into this rank's block
    return rows * (H * 2 + kTopk * 12);    // rows + int64 ids + float32 weights
  });
  const double base = memcpy_seconds(w);
  const std::function<void(int)> dispatch = [&](int r) {
    Rank& k = w.ranks[static_cast<std::size_t>(r)];
    k.pf->dispatch_a(inputs_of(k));
    benchmark::DoNotOptimize(k.pf->dispatch_b().hidden.data());
  };
  const std::function<void(int)> combine = [&](int r) {
    Rank& k = w.ranks[static_cast<std::size_t>(r)];
    k.pf->combine_a(k.fused, WeightAndReduce::none);
    benchmark::DoNotOptimize(k.pf->combine_b().data());
  };
  std::vector<double> times;
  if (phase == 0) {
    w.threads->run(dispatch);  // warm-up
    w.threads->run(combine);
    for (auto _ : state) {
      const double s = w.threads->run(dispatch);
      state.SetIterationTime(s);
      times.push_back(s);
      w.threads->run(combine);  // untimed: back to INITIAL
    }
  } else {
    for (auto _ : state) {
      w.threads->run(dispatch);  // untimed
      const double s = w.threads->run(combine);
      state.SetIterationTime(s);
      times.push_back(s);
    }
  }
  report(state, w, bytes, base, times);
}

void configure(benchmark::internal::Benchmark* b, int R) {
  b->Arg(R)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);
}

}  // namespace

int main(int argc, char** argv) {
  // Grouped by (R, prepare/finalize) so one world's inputs are built once and freed before the next.
  for (int R : {2, 4})
    for (bool ag : {true, false}) {
      configure(benchmark::RegisterBenchmark(ag ? "all_gather_dispatch_bf16" : "normal_dispatch_bf16", BM_phase, ag, 0), R);
      configure(benchmark::RegisterBenchmark(ag ? "all_gather_combine_bf16" : "normal_combine_bf16", BM_phase, ag, 1), R);
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
