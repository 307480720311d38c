// Low-latency dispatch (fp8, bf16) and combine on thread ranks, next to a memcpy of the same bytes by
// the same threads in the same run (semantics §12 shapes: T = 128 per rank, H = 7168, K = 8, E = 256).
//
// Each benchmark runs R rank threads, each with its own Buffer. Per iteration every rank meets the
// others at a barrier, then runs the operation; the iteration time is the latest end minus the
// earliest start over the ranks, and the reported time is the median over the iterations. The
// memcpy floor copies, on every rank at once, the logical bytes that rank receives (DeepEP's
// convention: the packed recv rows for dispatch, the same rows for combine).
// Counters: op_us, memcpy_us, ratio = op / memcpy, logical_GBps (all ranks), remote_MB (bytes that
// cross between ranks per iteration: one record per (token, destination rank) for dispatch, one bf16
// row per (token, k) for combine, self excluded).
#include <benchmark/benchmark.h>

#include <epmoe/buffer.hpp>
#include <epmoe/group.hpp>
#include <epmoe/quant.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace {

using namespace epmoe;
using Clock = std::chrono::steady_clock;

constexpr int kT = 128, kK = 8, kE = 256;
constexpr std::int64_t kH = 7168;
constexpr int kSets = 4;  // input sets rotated over the iterations
constexpr int kWarmup = 5, kIters = 40;

enum class Op { dispatch_fp8, dispatch_bf16, combine };

struct RankInput {
  Tensor x, idx, w;
};

RankInput make_input(std::mt19937_64& rng) {
  RankInput in;
  in.x = Tensor::empty(DType::bf16, {kT, kH});
  std::uniform_real_distribution<float> val(-2.0f, 2.0f);
  for (std::int64_t i = 0; i < in.x.numel(); ++i) in.x.ptr<bf16_t>()[i] = float_to_bf16(val(rng));
  in.idx = Tensor::empty(DType::int64, {kT, kK});
  in.w = Tensor::empty(DType::fp32, {kT, kK});
  std::vector<std::int64_t> ids(kE);
  std::iota(ids.begin(), ids.end(), 0);
  std::uniform_real_distribution<float> wd(0.05f, 1.0f);
  for (int t = 0; t < kT; ++t)
    for (int k = 0; k < kK; ++k) {
      std::swap(ids[static_cast<std::size_t>(k)],
                ids[std::uniform_int_distribution<std::size_t>(static_cast<std::size_t>(k), kE - 1)(rng)]);
      in.idx.ptr<std::int64_t>()[t * kK + k] = ids[static_cast<std::size_t>(k)];
      in.w.ptr<float>()[t * kK + k] = wd(rng);
    }
  return in;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void BM_LowLatency(benchmark::State& state, Op op, int R) {
  std::mt19937_64 rng(20261101 + static_cast<std::uint64_t>(R));
  std::vector<std::vector<RankInput>> in(kSets);
  for (auto& set : in)
    for (int r = 0; r < R; ++r) set.push_back(make_input(rng));
  const int El = kE / R;
  const std::int64_t G = num_scale_groups(kH);
  const std::int64_t row_bytes = op == Op::dispatch_fp8 ? kH + 4 * G : 2 * kH;

  // Bytes per (set, rank): logical = received packed rows * row bytes; remote = what leaves a rank
  // for other ranks (dispatch: a token once per destination rank; combine: one row per (token, k)).
  std::vector<std::vector<std::int64_t>> logical(kSets, std::vector<std::int64_t>(static_cast<std::size_t>(R), 0));
  std::int64_t remote_total = 0;
  for (int s = 0; s < kSets; ++s)
    for (int r = 0; r < R; ++r) {
      const auto* idx = in[static_cast<std::size_t>(s)][static_cast<std::size_t>(r)].idx.ptr<std::int64_t>();
      for (int t = 0; t < kT; ++t) {
        std::vector<bool> to_rank(static_cast<std::size_t>(R), false);
        for (int k = 0; k < kK; ++k) {
          const int d = static_cast<int>(idx[t * kK + k] / El);
          logical[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)] += row_bytes;
          if (op == Op::combine && d != r) remote_total += 2 * kH;
          to_rank[static_cast<std::size_t>(d)] = true;
        }
        if (op != Op::combine)
          for (int d = 0; d < R; ++d)
            if (to_rank[static_cast<std::size_t>(d)] && d != r) remote_total += row_bytes;
      }
    }
  const double remote_per_iter = static_cast<double>(remote_total) / kSets;
  double logical_per_iter = 0;
  for (const auto& s : logical)
    for (auto b : s) logical_per_iter += static_cast<double>(b) / kSets;

  const int total = kWarmup + kIters;
  std::vector<std::vector<Clock::time_point>> start(static_cast<std::size_t>(total),
                                                    std::vector<Clock::time_point>(static_cast<std::size_t>(R)));
  auto end = start;
  auto cstart = start, cend = start;
  std::vector<std::string> errors(static_cast<std::size_t>(R));

  for (auto _ : state) {
    ThreadWorld world(R);
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r)
      threads.emplace_back([&, r] {
        try {
          auto g = world.group(r);
          Buffer buffer(g);
          std::int64_t max_bytes = 0;
          for (int s = 0; s < kSets; ++s)
            max_bytes = std::max(max_bytes, logical[static_cast<std::size_t>(s)][static_cast<std::size_t>(r)]);
          std::vector<std::byte> src(static_cast<std::size_t>(max_bytes), std::byte{0x5a}), dst(src.size());
          for (int it = 0; it < total; ++it) {
            const RankInput& mine = in[static_cast<std::size_t>(it % kSets)][static_cast<std::size_t>(r)];
            LowLatencyDispatchArgs a;
            a.x = mine.x;
            a.topk_idx = mine.idx;
            a.topk_weights = mine.w;
            a.num_max_dispatch_tokens_per_rank = kT;
            a.num_experts = kE;
            a.use_fp8 = op == Op::dispatch_fp8;
            if (op == Op::combine) {
              g->barrier("bench: dispatch");
              const auto d = buffer.low_latency_dispatch(a);
              LowLatencyCombineArgs ca;
              ca.x = d.packed_recv_x;  // the identity expert: outputs = inputs, in the window
              ca.topk_idx = mine.idx;
              ca.topk_weights = mine.w;
              ca.handle = &d.handle;
              g->barrier("bench: combine");
              start[static_cast<std::size_t>(it)][static_cast<std::size_t>(r)] = Clock::now();
              benchmark::DoNotOptimize(buffer.low_latency_combine(ca));
              end[static_cast<std::size_t>(it)][static_cast<std::size_t>(r)] = Clock::now();
            } else {
              g->barrier("bench: dispatch");
              start[static_cast<std::size_t>(it)][static_cast<std::size_t>(r)] = Clock::now();
              benchmark::DoNotOptimize(buffer.low_latency_dispatch(a));
              end[static_cast<std::size_t>(it)][static_cast<std::size_t>(r)] = Clock::now();
            }
          }
          for (int it = 0; it < total; ++it) {
            const auto bytes =
                static_cast<std::size_t>(logical[static_cast<std::size_t>(it % kSets)][static_cast<std::size_t>(r)]);
            g->barrier("bench: memcpy");
            cstart[static_cast<std::size_t>(it)][static_cast<std::size_t>(r)] = Clock::now();
            std::memcpy(dst.data(), src.data(), bytes);
            benchmark::ClobberMemory();
            cend[static_cast<std::size_t>(it)][static_cast<std::size_t>(r)] = Clock::now();
          }
          g->barrier("bench: done");
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (const auto& e : errors)
      if (!e.empty()) {
        state.SkipWithError(e.c_str());
        return;
      }
    std::vector<double> op_s, cp_s;
    for (int it = kWarmup; it < total; ++it) {
      const auto& s = start[static_cast<std::size_t>(it)];
      const auto& e = end[static_cast<std::size_t>(it)];
      op_s.push_back(
          std::chrono::duration<double>(*std::max_element(e.begin(), e.end()) - *std::min_element(s.begin(), s.end()))
              .count());
      const auto& cs = cstart[static_cast<std::size_t>(it)];
      const auto& ce = cend[static_cast<std::size_t>(it)];
      cp_s.push_back(std::chrono::duration<double>(*std::max_element(ce.begin(), ce.end()) -
                                                   *std::min_element(cs.begin(), cs.end()))
                         .count());
    }
    const double op = median(op_s), cp = median(cp_s);
    state.SetIterationTime(op);
    state.counters["op_us"] = op * 1e6;
    state.counters["memcpy_us"] = cp * 1e6;
    state.counters["ratio"] = op / cp;
    state.counters["logical_GBps"] = logical_per_iter / op / 1e9;
    state.counters["memcpy_GBps"] = logical_per_iter / cp / 1e9;
    state.counters["logical_MB"] = logical_per_iter / 1e6;
    state.counters["remote_MB"] = remote_per_iter / 1e6;
  }
}

const bool registered = [] {
  for (int R : {2, 4, 8}) {
    benchmark::RegisterBenchmark(("ll_dispatch_fp8/R" + std::to_string(R)).c_str(), BM_LowLatency, Op::dispatch_fp8, R)
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("ll_dispatch_bf16/R" + std::to_string(R)).c_str(), BM_LowLatency, Op::dispatch_bf16,
                                 R)
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("ll_combine_bf16/R" + std::to_string(R)).c_str(), BM_LowLatency, Op::combine, R)
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
