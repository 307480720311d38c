// Helpers shared by the GPU benchmarks (bench/gpu_*.cpp): the CUDA error exit, seeded random bits, the run seed,
// medians over runs, uniform top-K routing. Header-only: every bench/<name>.cpp is an executable of its own
// (bench/CMakeLists.txt) and the benches share no library beyond epmoe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <ctime>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

namespace epmoe::bench {

/// Unless `e` is cudaSuccess: prints "<program>: <what>: <CUDA error>" to stderr and exits with status 1.
inline void check_cuda(const char* program, cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s: %s\n", program, what, cudaGetErrorString(e));
    std::exit(1);
  }
}

/// SplitMix64 (Steele, Lea, Flood 2014): advances `s` and returns the next 64 random bits.
inline std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// A fresh seed per run (the benches print it).
inline std::uint64_t run_seed() {
  return std::random_device{}() ^ (static_cast<std::uint64_t>(std::time(nullptr)) << 20);
}

/// The upper median (0 for no values).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// Per run, the slower of two ranks' times (the run's time): `a` and `b` hold the same runs.
inline std::vector<double> slower_of(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> slow(a.size());
  for (std::size_t i = 0; i < slow.size(); ++i) slow[i] = std::max(a[i], b[i]);
  return slow;
}

/// Uniform random top-K of E experts, distinct per token (a partial Fisher-Yates shuffle per token drawn from
/// std::mt19937_64(seed)): int64 ids [T, K], row-major, on the host.
inline std::vector<std::int64_t> random_topk_ids(std::int64_t T, int K, int E, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int64_t> h(static_cast<std::size_t>(T * K));
  std::vector<int> ids(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int k = 0; k < K; ++k) {
      std::uniform_int_distribution<int> pick(k, E - 1);
      std::swap(ids[static_cast<std::size_t>(k)], ids[static_cast<std::size_t>(pick(rng))]);
      h[static_cast<std::size_t>(t * K + k)] = ids[static_cast<std::size_t>(k)];
    }
  }
  return h;
}

/// One rank's run timing in the multi-GPU benchmarks, on the current device and the legacy default stream: the L2
/// flush (a 256 MiB memset) before a run, and CUDA events around the timed call. Errors exit as check_cuda.
class RankTimer {
 public:
  explicit RankTimer(const char* program) : program_(program) {
    check_cuda(program_, cudaMalloc(&flush_, kFlushBytes), "cudaMalloc flush");
    check_cuda(program_, cudaEventCreate(&start_), "cudaEventCreate");
    check_cuda(program_, cudaEventCreate(&stop_), "cudaEventCreate");
  }
  ~RankTimer() {
    cudaEventDestroy(stop_);
    cudaEventDestroy(start_);
    cudaFree(flush_);
  }
  RankTimer(const RankTimer&) = delete;
  RankTimer& operator=(const RankTimer&) = delete;

  /// Overwrites the L2 (bytes of run `i`), then waits until the device is idle.
  void flush_l2(int i) {
    check_cuda(program_, cudaMemsetAsync(flush_, i & 0xff, kFlushBytes, nullptr), "flush");
    check_cuda(program_, cudaDeviceSynchronize(), "sync");
  }
  /// Microseconds between events recorded before and after `fn` on the legacy default stream.
  double time_us(const std::function<void()>& fn) {
    check_cuda(program_, cudaEventRecord(start_, nullptr), "record");
    fn();
    check_cuda(program_, cudaEventRecord(stop_, nullptr), "record");
    check_cuda(program_, cudaEventSynchronize(stop_), "sync");
    float ms = 0;
    check_cuda(program_, cudaEventElapsedTime(&ms, start_, stop_), "elapsed");
    return ms * 1000.0;
  }

 private:
  static constexpr std::size_t kFlushBytes = std::size_t{256} << 20;
  const char* program_;
  void* flush_ = nullptr;
  cudaEvent_t start_{}, stop_{};
};

}  // namespace epmoe::bench
