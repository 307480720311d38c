// Normal-mode dispatch (bf16, fp8) and combine on thread ranks, next to a plain memcpy of the same
// bytes measured in the same run (semantics §12, PERF.md).
//
//   build/<dir>/bench/bench_threads_normal [--benchmark_filter=...]
//   EPMOE_BENCH_T=<tokens per rank> overrides T (default 4096; 2048 at R = 8 to bound memory).
//
// Shapes: T tokens per rank, H = 7168, K = 8, E = 256, uniform random routing. Bytes are DeepEP's
// logical bytes: recv_x (plus scales for fp8) summed over ranks for dispatch, the same rows for
// combine. "vs_memcpy" is the op's bandwidth over that of every rank memcpy'ing its own share of those
// bytes at the same time (source and destination already faulted in), measured just before.
// Each iteration is timed from the start of the collective on every rank to its end on every rank,
// after one untimed warm-up call (it fills the buffer's output pool, see cpu/normal_mode.hpp).
#include <benchmark/benchmark.h>

#include <epmoe/buffer.hpp>
#include <epmoe/layout.hpp>
#include <epmoe/quant.hpp>

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
  std::unique_ptr<Buffer> buffer;
  Tensor x_bf16, x_fp8, scales, topk_idx, topk_weights;
  DispatchLayout layout;
  DispatchResult bf16;         ///< last bf16 dispatch: its recv_x is combine's input
  Tensor memcpy_dst;           ///< as large as bf16.recv_x
};

/// Inputs for R ranks, kept while benchmarks of the same R run.
struct World {
  int R = 0;
  std::int64_t T = 0;
  std::unique_ptr<ThreadWorld> world;
  std::unique_ptr<RankThreads> threads;
  std::vector<Rank> ranks;
  std::int64_t bf16_bytes = 0, fp8_bytes = 0;  ///< recv bytes summed over ranks
};

std::int64_t tokens_for(int R) {
  if (const char* s = std::getenv("EPMOE_BENCH_T")) return std::atoll(s);
  return R >= 8 ? 2048 : 4096;
}

World& world_for(int R) {
  static std::unique_ptr<World> w;
  if (w && w->R == R) return *w;
  w.reset();  // free the previous shape first
  w = std::make_unique<World>();
  w->R = R;
  w->T = tokens_for(R);
  w->world = std::make_unique<ThreadWorld>(R);
  w->threads = std::make_unique<RankThreads>(R);
  w->ranks.resize(static_cast<std::size_t>(R));
  const std::int64_t T = w->T, H = kHidden, G = num_scale_groups(H);
  w->threads->run([&](int r) {  // each rank fills its own inputs (first touch on its thread)
    Rank& k = w->ranks[static_cast<std::size_t>(r)];
    k.group = w->world->group(r);
    k.buffer = std::make_unique<Buffer>(k.group);
    std::uint64_t s = 1234567ull * static_cast<std::uint64_t>(r + 1);
    k.x_bf16 = Tensor::empty(DType::bf16, {T, H});
    for (std::int64_t i = 0; i < T * H; ++i) {  // finite values of moderate magnitude
      const std::uint64_t b = splitmix(s);
      k.x_bf16.ptr<bf16_t>()[i] = bf16_t{static_cast<std::uint16_t>((b & 0x807f) | ((120 + (b >> 8) % 12) << 7))};
    }
    k.x_fp8 = Tensor::empty(DType::fp8_e4m3, {T, H});
    for (std::int64_t i = 0; i < T * H; ++i) k.x_fp8.ptr<fp8_e4m3_t>()[i] = fp8_e4m3_t{static_cast<std::uint8_t>(splitmix(s) % 0x7e)};
    k.scales = Tensor::empty(DType::fp32, {T, G});
    for (std::int64_t i = 0; i < T * G; ++i) k.scales.ptr<float>()[i] = 1e-3f * static_cast<float>(1 + splitmix(s) % 1000);
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
    k.layout = get_dispatch_layout(k.topk_idx, kExperts, R);
  });
  return *w;
}

DispatchArgs args_of(const Rank& k, bool fp8) {
  DispatchArgs a;
  a.x = fp8 ? k.x_fp8 : k.x_bf16;
  if (fp8) a.x_scales = k.scales;
  a.topk_idx = k.topk_idx;
  a.topk_weights = k.topk_weights;
  a.num_tokens_per_rank = k.layout.num_tokens_per_rank;
  a.is_token_in_rank = k.layout.is_token_in_rank;
  a.num_tokens_per_expert = k.layout.num_tokens_per_expert;
  return a;
}

/// Makes sure the bf16 dispatch result (combine's input and the memcpy source) exists.
void prepare(World& w) {
  if (w.bf16_bytes) return;
  std::vector<std::int64_t> fp8_bytes(static_cast<std::size_t>(w.R));
  w.threads->run([&](int r) {
    Rank& k = w.ranks[static_cast<std::size_t>(r)];
    k.bf16 = k.buffer->dispatch(args_of(k, false));
    const DispatchResult f = k.buffer->dispatch(args_of(k, true));
    fp8_bytes[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(f.recv_x.nbytes() + f.recv_x_scales.nbytes());
    k.memcpy_dst = Tensor::empty(DType::bf16, k.bf16.recv_x.shape());
    std::memset(k.memcpy_dst.data(), 1, k.memcpy_dst.nbytes());  // fault it in
  });
  for (int r = 0; r < w.R; ++r) {
    w.bf16_bytes += static_cast<std::int64_t>(w.ranks[static_cast<std::size_t>(r)].bf16.recv_x.nbytes());
    w.fp8_bytes += fp8_bytes[static_cast<std::size_t>(r)];
  }
}

/// Median seconds of every rank memcpy'ing `share(rank)` bytes at once.
double memcpy_seconds(World& w, const std::function<std::size_t(int)>& share, int reps = 5) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i)
    t.push_back(w.threads->run([&](int r) {
      Rank& k = w.ranks[static_cast<std::size_t>(r)];
      std::memcpy(k.memcpy_dst.data(), k.bf16.recv_x.data(), share(r));
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
  state.counters["memcpy_GBps"] = static_cast<double>(bytes) / memcpy_s / 1e9;
  state.counters["vs_memcpy"] = memcpy_s / median;
}

void BM_dispatch(benchmark::State& state, bool fp8) {
  World& w = world_for(static_cast<int>(state.range(0)));
  prepare(w);
  const std::int64_t bytes = fp8 ? w.fp8_bytes : w.bf16_bytes;
  const double base = memcpy_seconds(w, [&](int r) {
    const Rank& k = w.ranks[static_cast<std::size_t>(r)];
    return fp8 ? k.bf16.recv_x.nbytes() / 2 + static_cast<std::size_t>(k.bf16.recv_x.size(0) * num_scale_groups(kHidden) * 4)
               : k.bf16.recv_x.nbytes();
  });
  const std::function<void(int)> op = [&](int r) {
    Rank& k = w.ranks[static_cast<std::size_t>(r)];
    DispatchResult res = k.buffer->dispatch(args_of(k, fp8));
    benchmark::DoNotOptimize(res.recv_x.data());
  };
  w.threads->run(op);  // warm-up: the buffer's output pool gets its blocks
  std::vector<double> times;
  for (auto _ : state) {
    const double s = w.threads->run(op);
    state.SetIterationTime(s);
    times.push_back(s);
  }
  report(state, w, bytes, base, times);
}

void BM_combine(benchmark::State& state) {
  World& w = world_for(static_cast<int>(state.range(0)));
  prepare(w);
  const double base = memcpy_seconds(w, [&](int r) { return w.ranks[static_cast<std::size_t>(r)].bf16.recv_x.nbytes(); });
  const std::function<void(int)> op = [&](int r) {
    Rank& k = w.ranks[static_cast<std::size_t>(r)];
    CombineArgs a;
    a.x = k.bf16.recv_x;
    a.handle = &k.bf16.handle;
    CombineResult res = k.buffer->combine(a);
    benchmark::DoNotOptimize(res.combined_x.data());
  };
  w.threads->run(op);  // warm-up
  std::vector<double> times;
  for (auto _ : state) {
    const double s = w.threads->run(op);
    state.SetIterationTime(s);
    times.push_back(s);
  }
  report(state, w, w.bf16_bytes, base, times);
}

void BM_memcpy(benchmark::State& state) {
  World& w = world_for(static_cast<int>(state.range(0)));
  prepare(w);
  std::vector<double> times;
  for (auto _ : state) {
    const double s = memcpy_seconds(w, [&](int r) { return w.ranks[static_cast<std::size_t>(r)].bf16.recv_x.nbytes(); }, 1);
    state.SetIterationTime(s);
    times.push_back(s);
  }
  report(state, w, w.bf16_bytes, times[times.size() / 2], times);
}

void configure(benchmark::internal::Benchmark* b, int R) {
  b->Arg(R)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);
}

}  // namespace

int main(int argc, char** argv) {
  // Registered rank count by rank count so one shape's inputs are built once and freed before the next.
  for (int R : {2, 4, 8}) {
    configure(benchmark::RegisterBenchmark("dispatch_bf16", BM_dispatch, false), R);
    configure(benchmark::RegisterBenchmark("dispatch_fp8", BM_dispatch, true), R);
    configure(benchmark::RegisterBenchmark("combine_bf16", BM_combine), R);
    configure(benchmark::RegisterBenchmark("memcpy_bf16_bytes", BM_memcpy), R);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
