// The CUDA experts (make_cuda_experts) at DeepSeek-V3-like shapes next to their roofline, measured in
// the same run (SPEC 12):
//   H = 7168, N = 2048, K = 8, E = 256 experts over 8 ranks -> E_local = 32 on this GPU (2.8 GB of bf16
//   weights), T = 4096 (prefill) and T = 128 (decode) tokens, every token's K choices among the local experts;
//   T = 1024, 512, 256 for the Standard GEMM modes only (where GemmMode::automatic switches).
// Roofline = max(FLOPs / the rate of one dense 8192^3 bf16 cuBLAS GEMM, bytes / the device-to-device copy
// rate), both measured here; bytes = weights + hidden in + output (each read or written once), the copy
// counted as read + write. Every figure is the median of >= 20 runs after warm-up, CUDA events around the
// call, the L2 flushed (256 MiB memset) before each run, inputs random (never zeros).
//
// Rows: each Standard GEMM mode (cuda_experts.hpp), the bare per-expert cuBLAS GEMMs of the same problem
// (no permute, activation or reduction: what the GEMMs alone cost), and the BatchedExperts format with
// max_tokens = the per-expert count (no waste) and twice it, called directly and replayed from a CUDA graph.
//
// Usage: bench_gpu_experts [--runs N] [--json PATH]
#if !defined(EPMOE_HAVE_CUDA)
#include <cstdio>
int main() {
  std::printf("bench_gpu_experts: epmoe was built without CUDA: skipped\n");
  return 77;
}
#else
#include <epmoe/experts.hpp>
#include <epmoe/stream.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "experts/cuda_experts.hpp"

namespace {

using namespace epmoe;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_gpu_experts: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check_blas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_gpu_experts: %s: %s\n", what, cublasGetStatusString(s));
    std::exit(1);
  }
}

struct Timer {
  cudaEvent_t start{}, stop{};
  void* flush = nullptr;
  std::size_t flush_bytes = std::size_t{256} << 20;
  int runs;
  cudaStream_t stream = nullptr;
  explicit Timer(int n) : runs(n) {
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    check(cudaMalloc(&flush, flush_bytes), "cudaMalloc flush");
  }
  // Median and minimum in milliseconds over the runs, after 3 warm-up calls.
  std::pair<double, double> time(const std::function<void()>& fn) {
    for (int i = 0; i < 3; ++i) fn();
    check(cudaDeviceSynchronize(), "warm-up");
    std::vector<double> ms;
    for (int i = 0; i < runs; ++i) {
      check(cudaMemsetAsync(flush, i & 0xff, flush_bytes, stream), "L2 flush");
      check(cudaEventRecord(start, stream), "cudaEventRecord");
      fn();
      check(cudaEventRecord(stop, stream), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float t = 0;
      check(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
      ms.push_back(t);
    }
    check(cudaGetLastError(), "kernels");
    std::sort(ms.begin(), ms.end());
    return {ms[ms.size() / 2], ms.front()};
  }
};

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills `bytes` of device memory with bf16 values uniform in (-scale, scale): a 64 MiB random tile
// (distinct per call) repeated. Repetition does not matter to GEMM or copy speed; zeros would.
void fill_bf16(void* dev, std::size_t elements, float scale, std::uint64_t& seed) {
  const std::size_t tile = std::min<std::size_t>(elements, std::size_t{32} << 20);
  std::vector<bf16_t> host(tile);
  for (std::size_t i = 0; i < tile; ++i) {
    const std::uint64_t r = splitmix(seed);
    const float u = (static_cast<float>(r & 0xffffffu) + 0.5f) / 16777216.0f * 2.0f - 1.0f;
    host[i] = float_to_bf16(u * scale);
  }
  auto* d = static_cast<bf16_t*>(dev);
  check(cudaMemcpy(d, host.data(), tile * sizeof(bf16_t), cudaMemcpyHostToDevice), "fill upload");
  for (std::size_t off = tile; off < elements; off += tile)
    check(cudaMemcpy(d + off, d, std::min(tile, elements - off) * sizeof(bf16_t), cudaMemcpyDeviceToDevice),
          "fill replicate");
}

void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}

struct Row {
  std::string name, shape;
  double median_ms = 0, min_ms = 0, roofline_ms = 0, tflops = 0, gbps = 0;
};

double rel_diff(const std::vector<bf16_t>& a, const std::vector<bf16_t>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_float(a[i]), y = bf16_to_float(b[i]);
    num += (x - y) * (x - y);
    den += x * x;
  }
  return std::sqrt(num / den);
}

std::vector<bf16_t> download(const void* dev, std::size_t n) {
  std::vector<bf16_t> h(n);
  check(cudaMemcpy(h.data(), dev, n * sizeof(bf16_t), cudaMemcpyDeviceToHost), "download");
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 30;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) runs = std::max(20, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else {
      std::printf("usage: %s [--runs N (>= 20)] [--json PATH]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_gpu_experts: no CUDA device: skipped\n");
    return 77;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::uint64_t seed = std::random_device{}();
  std::printf("bench_gpu_experts: %s, %d SMs, L2 %d MiB, seed %llu, median of %d runs\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, static_cast<unsigned long long>(seed), runs);
  Timer timer(runs);
  // A stream of our own: the legacy default stream cannot be captured into a CUDA graph.
  check(cudaStreamCreateWithFlags(&timer.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<Row> rows;

  // ---- ceilings measured in this run ----
  const std::size_t copy_bytes = std::size_t{2} << 30;
  void* ca = device_alloc(copy_bytes);
  void* cb = device_alloc(copy_bytes);
  fill_bf16(ca, copy_bytes / 2, 1.0f, seed);
  const auto [copy_ms, copy_min] = timer.time([&] {
    check(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, timer.stream), "copy");
  });
  const double copy_rate = 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e-3);  // read + write, B/s
  check(cudaFree(ca), "cudaFree");
  check(cudaFree(cb), "cudaFree");

  cublasHandle_t blas = nullptr;
  check_blas(cublasCreate(&blas), "cublasCreate");
  check_blas(cublasSetStream(blas, timer.stream), "cublasSetStream");
  constexpr int kG = 8192;
  void* ga = device_alloc(std::size_t{kG} * kG * 2);
  void* gb = device_alloc(std::size_t{kG} * kG * 2);
  void* gc = device_alloc(std::size_t{kG} * kG * 2);
  fill_bf16(ga, std::size_t{kG} * kG, 1.0f, seed);
  fill_bf16(gb, std::size_t{kG} * kG, 1.0f, seed);
  const float one = 1.0f, zero = 0.0f;
  const auto [gemm_ms, gemm_min] = timer.time([&] {
    check_blas(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, kG, kG, kG, &one, ga, CUDA_R_16BF, kG, gb, CUDA_R_16BF, kG,
                            &zero, gc, CUDA_R_16BF, kG, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "dense gemm");
  });
  const double gemm_rate = 2.0 * kG * static_cast<double>(kG) * kG / (gemm_ms * 1e-3);  // FLOP/s
  check(cudaFree(ga), "cudaFree");
  check(cudaFree(gb), "cudaFree");
  check(cudaFree(gc), "cudaFree");
  std::printf("ceilings: d2d copy %.0f GB/s (read + write, %.3f ms for 2 x %zu MiB); "
              "dense bf16 GEMM 8192^3 %.0f TFLOP/s\n",
              copy_rate * 1e-9, copy_ms, copy_bytes >> 20, gemm_rate * 1e-12);
  std::fflush(stdout);

  // ---- the experts' weights ----
  constexpr std::int64_t H = 7168, N = 2048, K = 8, E = 32, R = 2 * N;
  const std::size_t w1_elems = static_cast<std::size_t>(E * R * H), w2_elems = static_cast<std::size_t>(E * H * N);
  void* w1 = device_alloc(w1_elems * 2);
  void* w2 = device_alloc(w2_elems * 2);
  fill_bf16(w1, w1_elems, 6.0f / std::sqrt(static_cast<float>(H)), seed);
  fill_bf16(w2, w2_elems, 3.0f / std::sqrt(static_cast<float>(N)), seed);
  const double weight_bytes = 2.0 * static_cast<double>(w1_elems + w2_elems);
  const Device gpu = Device::cuda(0);
  StreamGuard stream_guard(Stream{timer.stream});

  for (const std::int64_t T : {std::int64_t{4096}, std::int64_t{1024}, std::int64_t{512}, std::int64_t{256},
                               std::int64_t{128}}) {
    // The brief's two sizes in full; the ones between only for the GEMM modes' crossover.
    const bool full = T == 4096 || T == 128;
    // Routing: K distinct local experts per token, uniform.
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(T));
    std::vector<std::int64_t> idx(static_cast<std::size_t>(T * K));
    std::vector<float> wts(static_cast<std::size_t>(T * K));
    std::vector<std::int64_t> per_expert(E, 0);
    std::vector<int> ids(E);
    for (int e = 0; e < E; ++e) ids[static_cast<std::size_t>(e)] = e;
    std::uniform_real_distribution<float> wd(0.05f, 1.0f);
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t k = 0; k < K; ++k) {
        std::uniform_int_distribution<int> d(static_cast<int>(k), E - 1);
        std::swap(ids[static_cast<std::size_t>(k)], ids[static_cast<std::size_t>(d(rng))]);
        idx[static_cast<std::size_t>(t * K + k)] = ids[static_cast<std::size_t>(k)];
        wts[static_cast<std::size_t>(t * K + k)] = wd(rng);
        ++per_expert[static_cast<std::size_t>(ids[static_cast<std::size_t>(k)])];
      }
    void* x = device_alloc(static_cast<std::size_t>(T * H) * 2);
    fill_bf16(x, static_cast<std::size_t>(T * H), 1.0f, seed);
    void* d_idx = device_alloc(idx.size() * 8);
    void* d_w = device_alloc(wts.size() * 4);
    check(cudaMemcpy(d_idx, idx.data(), idx.size() * 8, cudaMemcpyHostToDevice), "upload idx");
    check(cudaMemcpy(d_w, wts.data(), wts.size() * 4, cudaMemcpyHostToDevice), "upload weights");
    void* out = device_alloc(static_cast<std::size_t>(T * H) * 2);

    ExpertsInputs in;
    in.hidden = TensorView(x, DType::bf16, {T, H}, gpu);
    in.w1 = TensorView(w1, DType::bf16, {E, R, H}, gpu);
    in.w2 = TensorView(w2, DType::bf16, {E, H, N}, gpu);
    in.topk_idx = TensorView(d_idx, DType::int64, {T, K}, gpu);
    in.topk_weights = TensorView(d_w, DType::fp32, {T, K}, gpu);
    in.activation = Activation::silu;
    const TensorView out_view(out, DType::bf16, {T, H}, gpu);

    const double slots = static_cast<double>(T * K);
    const double flops = 2.0 * slots * static_cast<double>(R * H + H * N);
    const double bytes = weight_bytes + 2.0 * 2.0 * static_cast<double>(T * H);
    const double roofline_ms = std::max(flops / gemm_rate, bytes / copy_rate) * 1e3;
    const std::string shape = "T=" + std::to_string(T) + " H=7168 N=2048 K=8 E_local=32";
    std::printf("%s: %.3g TFLOP, %.3g GB -> roofline %.3f ms (%s-bound)\n", shape.c_str(), flops * 1e-12,
                bytes * 1e-9, roofline_ms, flops / gemm_rate > bytes / copy_rate ? "compute" : "memory");
    std::fflush(stdout);
    auto add = [&](const std::string& name, double median, double min) {
      Row r{name, shape, median, min, roofline_ms, flops / (median * 1e-3) * 1e-12, bytes / (median * 1e-3) * 1e-9};
      std::printf("  %-34s median %8.3f ms  min %8.3f ms  %6.1f%% of roofline  %6.0f TFLOP/s  %6.0f GB/s\n",
                  name.c_str(), median, min, 100.0 * roofline_ms / median, r.tflops, r.gbps);
      std::fflush(stdout);
      rows.push_back(r);
    };

    std::vector<std::vector<bf16_t>> outputs;
    for (auto mode : {experts_cuda::GemmMode::loop, experts_cuda::GemmMode::streams, experts_cuda::GemmMode::grouped,
                      experts_cuda::GemmMode::automatic}) {
      if (!full && mode == experts_cuda::GemmMode::streams) continue;
      const auto experts = experts_cuda::make_cuda_experts({}, mode);
      try {
        const auto [med, mn] = timer.time([&] { experts->apply(in, out_view); });
        add(std::string("standard, ") + experts_cuda::gemm_mode_name(mode), med, mn);
        outputs.push_back(download(out, static_cast<std::size_t>(T * H)));
      } catch (const std::exception& e) {
        std::printf("  standard, %s: FAILED: %s\n", experts_cuda::gemm_mode_name(mode), e.what());
        check(cudaDeviceSynchronize(), "after failure");
      }
    }
    for (std::size_t i = 1; i < outputs.size(); ++i)
      std::printf("  output of mode #%zu vs loop: relative L2 difference %.2e\n", i, rel_diff(outputs[0], outputs[i]));

    if (full) {  // The bare GEMMs of the same problem, one cublasGemmEx per expert and layer.
      const std::size_t s = static_cast<std::size_t>(T * K);
      void* xp = device_alloc(s * H * 2);
      void* g = device_alloc(s * R * 2);
      void* a = device_alloc(s * N * 2);
      void* y = device_alloc(s * H * 2);
      fill_bf16(xp, s * H, 1.0f, seed);
      fill_bf16(a, s * N, 1.0f, seed);
      const auto [med, mn] = timer.time([&] {
        check_blas(cublasSetStream(blas, timer.stream), "cublasSetStream");
        std::int64_t r0 = 0;
        for (std::int64_t e = 0; e < E; ++e) {
          const int m = static_cast<int>(per_expert[static_cast<std::size_t>(e)]);
          if (m == 0) continue;
          check_blas(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, R, m, H, &one, static_cast<char*>(w1) + e * R * H * 2,
                                  CUDA_R_16BF, H, static_cast<char*>(xp) + r0 * H * 2, CUDA_R_16BF, H, &zero,
                                  static_cast<char*>(g) + r0 * R * 2, CUDA_R_16BF, R, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT),
                     "gemm1");
          r0 += m;
        }
        r0 = 0;
        for (std::int64_t e = 0; e < E; ++e) {
          const int m = static_cast<int>(per_expert[static_cast<std::size_t>(e)]);
          if (m == 0) continue;
          check_blas(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, H, m, N, &one, static_cast<char*>(w2) + e * H * N * 2,
                                  CUDA_R_16BF, N, static_cast<char*>(a) + r0 * N * 2, CUDA_R_16BF, N, &zero,
                                  static_cast<char*>(y) + r0 * H * 2, CUDA_R_16BF, H, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT),
                     "gemm2");
          r0 += m;
        }
      });
      add("bare cuBLAS GEMMs (loop, no glue)", med, mn);
      for (void* p : {xp, g, a, y}) check(cudaFree(p), "cudaFree");
    }

    // BatchedExperts: every expert gets the mean count (T*K/E), max_tokens = that and twice that.
    const std::int64_t count = T * K / E;
    for (const std::int64_t max_tokens : {count, 2 * count}) {
      if (!full) break;
      const std::size_t n = static_cast<std::size_t>(E * max_tokens * H);
      void* bx = device_alloc(n * 2);
      void* bout = device_alloc(n * 2);
      fill_bf16(bx, n, 1.0f, seed);
      std::vector<std::int32_t> counts(E, static_cast<std::int32_t>(count));
      void* dc = device_alloc(E * 4);
      check(cudaMemcpy(dc, counts.data(), E * 4, cudaMemcpyHostToDevice), "upload counts");
      ExpertsInputs b;
      b.hidden = TensorView(bx, DType::bf16, {E, max_tokens, H}, gpu);
      b.w1 = in.w1;
      b.w2 = in.w2;
      b.expert_num_tokens = TensorView(dc, DType::int32, {E}, gpu);
      b.activation = Activation::silu;
      ExpertsConfig cfg;
      cfg.format = ActivationFormat::batched_experts;
      const auto experts = make_cuda_experts(cfg);
      const TensorView bo(bout, DType::bf16, {E, max_tokens, H}, gpu);
      const std::string tag = "batched, max_tokens=" + std::to_string(max_tokens);
      try {
        const auto [med, mn] = timer.time([&] { experts->apply(b, bo); });
        add(tag, med, mn);
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        check(cudaStreamBeginCapture(timer.stream, cudaStreamCaptureModeGlobal), "begin capture");
        experts->apply(b, bo);
        check(cudaStreamEndCapture(timer.stream, &graph), "end capture");
        check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        const auto [gmed, gmn] = timer.time([&] { check(cudaGraphLaunch(exec, timer.stream), "graph launch"); });
        add(tag + ", graph", gmed, gmn);
        check(cudaGraphExecDestroy(exec), "destroy exec");
        check(cudaGraphDestroy(graph), "destroy graph");
      } catch (const std::exception& e) {
        std::printf("  %s: FAILED: %s\n", tag.c_str(), e.what());
        cudaStreamCaptureStatus st;
        if (cudaStreamIsCapturing(timer.stream, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
          cudaGraph_t g = nullptr;
          cudaStreamEndCapture(timer.stream, &g);
        }
        cudaGetLastError();
      }
      for (void* p : {bx, bout, dc}) check(cudaFree(p), "cudaFree");
    }
    for (void* p : {x, d_idx, d_w, out}) check(cudaFree(p), "cudaFree");
  }

  // ---- summary ----
  std::printf("\nstandard, auto: grouped GEMMs up to %lld rows per expert (mean), else loop\n",
              static_cast<long long>(experts_cuda::kGroupedMaxMeanRows));
  std::printf("\n| shape | variant | median ms | roofline ms | %% of roofline | TFLOP/s |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  for (const Row& r : rows)
    std::printf("| %s | %s | %.3f | %.3f | %.1f | %.0f |\n", r.shape.c_str(), r.name.c_str(), r.median_ms,
                r.roofline_ms, 100.0 * r.roofline_ms / r.median_ms, r.tflops);
  std::printf("\nceilings: d2d copy %.0f GB/s, dense bf16 GEMM %.0f TFLOP/s\n", copy_rate * 1e-9, gemm_rate * 1e-12);
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      std::perror(json_path.c_str());
      return 1;
    }
    std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"runs\": %d,\n  \"copy_gbps\": %.1f,\n  \"gemm_tflops\": %.1f,\n",
                 prop.name, runs, copy_rate * 1e-9, gemm_rate * 1e-12);
    std::fprintf(f, "  \"results\": [\n");
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f,
                   "    {\"shape\": \"%s\", \"variant\": \"%s\", \"median_ms\": %.4f, \"min_ms\": %.4f, "
                   "\"roofline_ms\": %.4f, \"fraction_of_roofline\": %.4f, \"tflops\": %.1f}%s\n",
                   r.shape.c_str(), r.name.c_str(), r.median_ms, r.min_ms, r.roofline_ms, r.roofline_ms / r.median_ms,
                   r.tflops, i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}

#endif  // EPMOE_HAVE_CUDA
