// Helpers shared by the benchmarks: seeded random bits (every bench), and for the GPU ones (bench/gpu_*.cpp) the
// CUDA error exit, the run seed, medians over runs, uniform top-K routing. Header-only: every bench/<name>.cpp is an executable of its own
// (bench/CMakeLists.txt) and the benches share no library beyond epmoe.
#pragma once

#include <cstdint>
#include <cstdio>

namespace epmoe::bench {

/// SplitMix64 (Steele, Lea, Flood 2014): advances `s` and returns the next 64 random bits.
inline std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// A GPU benchmark's main in a CPU-only build: says so and returns 77 (skipped).
inline int cpu_only_build(const char* program) {
  std::printf("%s: CPU-only build, nothing to measure\n", program);
  return 77;
}

}  // namespace epmoe::bench

// The rest needs the CUDA headers (present in every CUDA build; gpu_stages and gpu_experts include them in any).
#if __has_include(<cuda_runtime.h>)

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
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

/// Per run, the slowest rank's time: `per_rank[r]` holds rank r's runs, all the same runs.
inline std::vector<double> slowest_of(const std::vector<std::vector<double> >& per_rank) {
  std::vector<double> slow = per_rank.empty() ? std::vector<double>{} : per_rank[0];
  for (const auto& v : per_rank)
    for (std::size_t i = 0; i < slow.size() && i < v.size(); ++i) slow[i] = std::max(slow[i], v[i]);
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

/// The options of the 2-GPU op benchmarks (gpu_normal_mode, gpu_low_latency): --runs N (at least 50),
/// --tokens T, --hidden H, --topk K, --experts E, --json PATH.
struct OpOptions {
  int runs = 100;
  std::int64_t T = 0, H = 7168;
  int K = 8, E = 256;
  std::string json_path;
};

/// When argv[i] is one of OpOptions' flags: stores its value (the next argument; i advances past it) and returns
/// true; else false.
inline bool parse_op_option(int argc, char** argv, int& i, OpOptions& o) {
  auto next = [&] { return i + 1 < argc ? argv[++i] : argv[i]; };
  if (!std::strcmp(argv[i], "--runs"))
    o.runs = std::max(50, std::atoi(next()));
  else if (!std::strcmp(argv[i], "--tokens"))
    o.T = std::atoll(next());
  else if (!std::strcmp(argv[i], "--hidden"))
    o.H = std::atoll(next());
  else if (!std::strcmp(argv[i], "--topk"))
    o.K = std::atoi(next());
  else if (!std::strcmp(argv[i], "--experts"))
    o.E = std::atoi(next());
  else if (!std::strcmp(argv[i], "--json"))
    o.json_path = next();
  else
    return false;
  return true;
}

/// Whether at least `n` GPUs are visible; else prints "<program>: needs n GPUs, found m: skipped".
inline bool have_gpus(const char* program, int n) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < n) {
    std::printf("%s: needs %d GPUs, found %d: skipped\n", program, n, devices);
    return false;
  }
  return true;
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
  /// Waits until the device is idle (a run without the flush).
  void idle() { check_cuda(program_, cudaDeviceSynchronize(), "sync"); }
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

#endif  // __has_include(<cuda_runtime.h>)
