// The CUDA experts (make_cuda_experts) at DeepSeek-V3-like shapes next to their roofline, measured in
// the same run (semantics §12):
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
// fp8 rows (ExpertsQuant::fp8_block, DeepSeek-V3's format: fp8 weights with 128x128 block scales, 1x128 activation
// groups) at T = 4096 and 128: the Standard format with an fp8 input (+ scales, as a normal-mode fp8 dispatch
// delivers it) and with a bf16 input the experts quantize, the bare per-expert block-scaled cuBLASLt GEMMs, and
// the BatchedExperts format (fp8 input) direct and from a CUDA graph. Their roofline = max(FLOPs / the rate of one
// dense 8192^3 block-scaled fp8 cuBLASLt GEMM, bytes of fp8 weights + scales + input + bf16 output / the copy
// rate), both measured in the same run.
//
// Usage: bench_gpu_experts [--runs N] [--json PATH] [--fp8-only]
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

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "bench_util.hpp"

#include "experts/experts.hpp"

namespace {

using namespace epmoe;

void check(cudaError_t e, const char* what) { bench::check_cuda("bench_gpu_experts", e, what); }
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

using bench::splitmix;

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


// ---- fp8 block-scaled experts (ExpertsQuant::fp8_block) ------------------------------------------------------
//
// Roofline = max(FLOPs / the rate of one dense 8192^3 block-scaled fp8 cuBLASLt GEMM (A 128x128 blocks, B 1x128
// groups, bf16 out: the engine the experts use), bytes / the d2d copy rate); bytes = fp8 weights + their scales
// + the input as given (fp8 + scales, or bf16) + bf16 output.

double g_fp8_gemm_rate = 0;  // FLOP/s, measured by run_fp8

void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_gpu_experts: %s: %s\n", what, cublasGetStatusString(s));
    std::exit(1);
  }
}

// One block-scaled fp8 GEMM shape: row-major C[n, m] = X[n, k] @ W[m, k]^T as cuBLASLt's "TN" GEMM.
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

LtPlan lt_plan(cublasLtHandle_t h, std::int64_t m, std::int64_t n, std::int64_t k, const float* as, const float* bs,
               std::size_t ws_bytes) {
  LtPlan p;
  check_lt(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t), "transa");
  check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn), "transb");
  const cublasLtMatmulMatrixScale_t am = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const cublasLtMatmulMatrixScale_t bm = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am), "a mode");
  check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm), "b mode");
  check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &as, sizeof as), "a scale");
  check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bs, sizeof bs), "b scale");
  check_lt(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, k, m, k), "layout a");
  check_lt(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, k, n, k), "layout b");
  check_lt(cublasLtMatrixLayoutCreate(&p.d, CUDA_R_16BF, m, n, m), "layout d");
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "pref");
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                sizeof ws_bytes),
           "pref ws");
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(h, p.desc, p.a, p.b, p.d, p.d, pref, 1, &r, &found), "heuristic");
  cublasLtMatmulPreferenceDestroy(pref);
  if (found == 0) {
    std::fprintf(stderr, "bench_gpu_experts: no block-scaled fp8 cuBLASLt GEMM for m=%lld n=%lld k=%lld\n",
                 static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k));
    std::exit(1);
  }
  p.algo = r.algo;
  return p;
}

void lt_run(cublasLtHandle_t h, const LtPlan& p, const void* w, const float* ws, const void* x, const float* xs,
            void* c, void* work, std::size_t work_bytes, cudaStream_t s) {
  check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof ws), "a scale");
  check_lt(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs, sizeof xs), "b scale");
  const float one = 1.0f, zero = 0.0f;
  check_lt(cublasLtMatmul(h, p.desc, &one, w, p.a, x, p.b, &zero, c, p.d, c, p.d, &p.algo, work, work_bytes, s),
           "cublasLtMatmul");
}

// fp8 codes of values uniform in (-448, 448) (finite: never the NaN codes), a random tile repeated.
void fill_fp8(void* dev, std::size_t n, std::uint64_t& seed) {
  const std::size_t tile = std::min<std::size_t>(n, std::size_t{64} << 20);
  std::vector<fp8_e4m3_t> host(tile);
  for (std::size_t i = 0; i < tile; ++i) {
    const std::uint64_t r = splitmix(seed);
    host[i] = float_to_fp8_e4m3(((static_cast<float>(r & 0xffffffu) + 0.5f) / 16777216.0f * 2.0f - 1.0f) * 448.0f);
  }
  auto* d = static_cast<char*>(dev);
  check(cudaMemcpy(d, host.data(), tile, cudaMemcpyHostToDevice), "fill fp8");
  for (std::size_t off = tile; off < n; off += tile)
    check(cudaMemcpy(d + off, d, std::min(tile, n - off), cudaMemcpyDeviceToDevice), "fill fp8 replicate");
}

// float32 scales uniform in [0.5, 1.5] * base.
void fill_scales(void* dev, std::size_t n, float base, std::uint64_t& seed) {
  std::vector<float> host(n);
  for (auto& v : host) v = base * (0.5f + static_cast<float>(splitmix(seed) & 0xffffffu) / 16777216.0f);
  check(cudaMemcpy(dev, host.data(), n * 4, cudaMemcpyHostToDevice), "fill scales");
}

void run_fp8(Timer& timer, double copy_rate, std::uint64_t& seed, std::vector<Row>& rows) {
  constexpr std::int64_t H = 7168, N = 2048, K = 8, E = 32, R = 2 * N;
  constexpr std::size_t kWork = std::size_t{32} << 20;
  const Device gpu = Device::cuda(0);
  cublasLtHandle_t lt = nullptr;
  check_lt(cublasLtCreate(&lt), "cublasLtCreate");
  void* work = device_alloc(kWork);

  // Ceiling: one dense block-scaled fp8 GEMM, 8192^3.
  constexpr std::int64_t kG = 8192, kGb = kG / 128;
  void* ga = device_alloc(std::size_t{kG} * kG);
  void* gb = device_alloc(std::size_t{kG} * kG);
  void* gc = device_alloc(std::size_t{kG} * kG * 2);
  void* gas = device_alloc(std::size_t{kGb} * kGb * 4);
  void* gbs = device_alloc(std::size_t{kGb} * kG * 4);
  fill_fp8(ga, std::size_t{kG} * kG, seed);
  fill_fp8(gb, std::size_t{kG} * kG, seed);
  fill_scales(gas, std::size_t{kGb} * kGb, 1.0f / 448, seed);
  fill_scales(gbs, std::size_t{kGb} * kG, 1.0f / 448, seed);
  {
    const LtPlan p = lt_plan(lt, kG, kG, kG, static_cast<float*>(gas), static_cast<float*>(gbs), kWork);
    const auto [ms, mn] = timer.time([&] {
      lt_run(lt, p, ga, static_cast<float*>(gas), gb, static_cast<float*>(gbs), gc, work, kWork, timer.stream);
    });
    g_fp8_gemm_rate = 2.0 * kG * static_cast<double>(kG) * kG / (ms * 1e-3);
    std::printf("\nceiling: dense fp8 block-scaled cuBLASLt GEMM 8192^3 (A 128x128, B 1x128, bf16 out) %.0f TFLOP/s "
                "(%.3f ms)\n", g_fp8_gemm_rate * 1e-12, ms);
  }
  for (void* p : {ga, gb, gc, gas, gbs}) check(cudaFree(p), "cudaFree");

  // Weights in DeepSeek-V3's format.
  const std::int64_t nb1 = R / 128, kb1 = H / 128, nb2 = H / 128, kb2 = N / 128;
  const std::size_t w1n = static_cast<std::size_t>(E * R * H), w2n = static_cast<std::size_t>(E * H * N);
  void* w1 = device_alloc(w1n);
  void* w2 = device_alloc(w2n);
  void* w1s = device_alloc(static_cast<std::size_t>(E * nb1 * kb1) * 4);
  void* w2s = device_alloc(static_cast<std::size_t>(E * nb2 * kb2) * 4);
  fill_fp8(w1, w1n, seed);
  fill_fp8(w2, w2n, seed);
  fill_scales(w1s, static_cast<std::size_t>(E * nb1 * kb1), 6.0f / std::sqrt(static_cast<float>(H)) / 448, seed);
  fill_scales(w2s, static_cast<std::size_t>(E * nb2 * kb2), 3.0f / std::sqrt(static_cast<float>(N)) / 448, seed);
  const double weight_bytes = static_cast<double>(w1n + w2n) + 4.0 * static_cast<double>(E * (nb1 * kb1 + nb2 * kb2));
  const ExpertsConfig std_cfg{ActivationFormat::standard, true, ExpertsQuant::fp8_block};
  const ExpertsConfig bat_cfg{ActivationFormat::batched_experts, true, ExpertsQuant::fp8_block};
  const auto experts = make_cuda_experts(std_cfg);
  const auto batched = make_cuda_experts(bat_cfg);

  for (const std::int64_t T : {std::int64_t{4096}, std::int64_t{128}}) {
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(T) * 7);
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
    const std::int64_t G = H / 128;
    void* x = device_alloc(static_cast<std::size_t>(T * H) * 2);
    void* xq = device_alloc(static_cast<std::size_t>(T * H));
    void* xs = device_alloc(static_cast<std::size_t>(T * G) * 4);
    fill_bf16(x, static_cast<std::size_t>(T * H), 1.0f, seed);
    fill_fp8(xq, static_cast<std::size_t>(T * H), seed);
    fill_scales(xs, static_cast<std::size_t>(T * G), 1.0f / 448, seed);
    void* d_idx = device_alloc(idx.size() * 8);
    void* d_w = device_alloc(wts.size() * 4);
    check(cudaMemcpy(d_idx, idx.data(), idx.size() * 8, cudaMemcpyHostToDevice), "upload idx");
    check(cudaMemcpy(d_w, wts.data(), wts.size() * 4, cudaMemcpyHostToDevice), "upload weights");
    void* out = device_alloc(static_cast<std::size_t>(T * H) * 2);

    ExpertsInputs in;
    in.w1 = TensorView(w1, DType::fp8_e4m3, {E, R, H}, gpu);
    in.w1_scales = TensorView(w1s, DType::fp32, {E, nb1, kb1}, gpu);
    in.w2 = TensorView(w2, DType::fp8_e4m3, {E, H, N}, gpu);
    in.w2_scales = TensorView(w2s, DType::fp32, {E, nb2, kb2}, gpu);
    in.topk_idx = TensorView(d_idx, DType::int64, {T, K}, gpu);
    in.topk_weights = TensorView(d_w, DType::fp32, {T, K}, gpu);
    in.activation = Activation::silu;
    const TensorView out_view(out, DType::bf16, {T, H}, gpu);

    const double flops = 2.0 * static_cast<double>(T * K) * static_cast<double>(R * H + H * N);
    const std::string shape = "fp8 T=" + std::to_string(T) + " H=7168 N=2048 K=8 E_local=32";
    auto add = [&](const std::string& name, double in_bytes, double median, double min) {
      const double bytes = weight_bytes + in_bytes + 2.0 * static_cast<double>(T * H);
      const double roofline_ms = std::max(flops / g_fp8_gemm_rate, bytes / copy_rate) * 1e3;
      Row r{name, shape, median, min, roofline_ms, flops / (median * 1e-3) * 1e-12, bytes / (median * 1e-3) * 1e-9};
      std::printf("  %-40s median %8.3f ms  min %8.3f ms  roofline %7.3f ms (%s)  %6.1f%% of roofline  "
                  "%6.0f TFLOP/s\n",
                  name.c_str(), median, min, roofline_ms,
                  flops / g_fp8_gemm_rate > bytes / copy_rate ? "compute" : "memory",
                  100.0 * roofline_ms / median, r.tflops);
      std::fflush(stdout);
      rows.push_back(r);
    };
    std::printf("%s: %.3g TFLOP, %.3g GB of fp8 weights\n", shape.c_str(), flops * 1e-12, weight_bytes * 1e-9);
    const double fp8_in = static_cast<double>(T * H) + 4.0 * static_cast<double>(T * G), bf16_in = 2.0 * T * H;
    try {
      ExpertsInputs a = in;
      a.hidden = TensorView(xq, DType::fp8_e4m3, {T, H}, gpu);
      a.hidden_scales = TensorView(xs, DType::fp32, {T, G}, gpu);
      const auto [med, mn] = timer.time([&] { experts->apply(a, out_view); });
      add("standard, fp8 input", fp8_in, med, mn);
      for (int streams : {1, 4}) {  // the default picks one of these by the mean rows per expert
        const auto e = experts_cuda_fp8::make_cuda_experts_fp8(std_cfg, streams);
        const auto [m1, n1] = timer.time([&] { e->apply(a, out_view); });
        add("standard, fp8 input, " + std::to_string(streams) + " stream(s)", fp8_in, m1, n1);
      }
      ExpertsInputs b = in;
      b.hidden = TensorView(x, DType::bf16, {T, H}, gpu);
      const auto [med2, mn2] = timer.time([&] { experts->apply(b, out_view); });
      add("standard, bf16 input (quantized here)", bf16_in, med2, mn2);
    } catch (const std::exception& e) {
      std::printf("  standard fp8: FAILED: %s\n", e.what());
      check(cudaDeviceSynchronize(), "after failure");
    }

    {  // The bare block-scaled GEMMs of the same problem (rows per expert rounded up to 4), no glue.
      std::vector<std::int64_t> m(E);
      std::int64_t total = 0;
      for (std::int64_t e = 0; e < E; ++e) total += m[static_cast<std::size_t>(e)] =
                                                    (per_expert[static_cast<std::size_t>(e)] + 3) / 4 * 4;
      void* xp = device_alloc(static_cast<std::size_t>(total * H));
      void* xps = device_alloc(static_cast<std::size_t>(total * G) * 4);
      void* g = device_alloc(static_cast<std::size_t>(total * R) * 2);
      void* a = device_alloc(static_cast<std::size_t>(total * N));
      void* as = device_alloc(static_cast<std::size_t>(total * (N / 128)) * 4);
      void* y = device_alloc(static_cast<std::size_t>(total * H) * 2);
      fill_fp8(xp, static_cast<std::size_t>(total * H), seed);
      fill_fp8(a, static_cast<std::size_t>(total * N), seed);
      fill_scales(xps, static_cast<std::size_t>(total * G), 1.0f / 448, seed);
      fill_scales(as, static_cast<std::size_t>(total * (N / 128)), 1.0f / 448, seed);
      std::vector<LtPlan> p1, p2;
      for (std::int64_t e = 0; e < E; ++e) {
        const std::int64_t n = m[static_cast<std::size_t>(e)];
        if (n == 0) continue;
        p1.push_back(lt_plan(lt, R, n, H, static_cast<float*>(w1s), static_cast<float*>(xps), kWork));
        p2.push_back(lt_plan(lt, H, n, N, static_cast<float*>(w2s), static_cast<float*>(as), kWork));
      }
      const auto [med, mn] = timer.time([&] {
        std::int64_t r0 = 0;
        std::size_t i = 0;
        for (std::int64_t e = 0; e < E; ++e) {
          const std::int64_t n = m[static_cast<std::size_t>(e)];
          if (n == 0) continue;
          lt_run(lt, p1[i++], static_cast<char*>(w1) + e * R * H, static_cast<float*>(w1s) + e * nb1 * kb1,
                 static_cast<char*>(xp) + r0 * H, static_cast<float*>(xps) + r0 * G, static_cast<char*>(g) + r0 * R * 2,
                 work, kWork, timer.stream);
          r0 += n;
        }
        r0 = 0;
        i = 0;
        for (std::int64_t e = 0; e < E; ++e) {
          const std::int64_t n = m[static_cast<std::size_t>(e)];
          if (n == 0) continue;
          lt_run(lt, p2[i++], static_cast<char*>(w2) + e * H * N, static_cast<float*>(w2s) + e * nb2 * kb2,
                 static_cast<char*>(a) + r0 * N, static_cast<float*>(as) + r0 * (N / 128),
                 static_cast<char*>(y) + r0 * H * 2, work, kWork, timer.stream);
          r0 += n;
        }
      });
      add("bare cuBLASLt fp8 GEMMs (loop, no glue)", fp8_in, med, mn);
      for (auto& p : p1) cublasLtMatmulDescDestroy(p.desc);
      for (auto& p : p2) cublasLtMatmulDescDestroy(p.desc);
      for (void* ptr : {xp, xps, g, a, as, y}) check(cudaFree(ptr), "cudaFree");
    }

    {  // BatchedExperts, fp8 input: every expert gets the mean count, max_tokens = that count.
      const std::int64_t count = T * K / E, n = E * count * H;
      void* bx = device_alloc(static_cast<std::size_t>(n));
      void* bxs = device_alloc(static_cast<std::size_t>(E * count * G) * 4);
      void* bout = device_alloc(static_cast<std::size_t>(n) * 2);
      fill_fp8(bx, static_cast<std::size_t>(n), seed);
      fill_scales(bxs, static_cast<std::size_t>(E * count * G), 1.0f / 448, seed);
      std::vector<std::int32_t> counts(E, static_cast<std::int32_t>(count));
      void* dc = device_alloc(E * 4);
      check(cudaMemcpy(dc, counts.data(), E * 4, cudaMemcpyHostToDevice), "upload counts");
      ExpertsInputs b = in;
      b.topk_idx = {};
      b.topk_weights = {};
      b.hidden = TensorView(bx, DType::fp8_e4m3, {E, count, H}, gpu);
      b.hidden_scales = TensorView(bxs, DType::fp32, {E, count, G}, gpu);
      b.expert_num_tokens = TensorView(dc, DType::int32, {E}, gpu);
      const TensorView bo(bout, DType::bf16, {E, count, H}, gpu);
      const std::string tag = "batched fp8 input, max_tokens=" + std::to_string(count);
      try {
        const double in_bytes = static_cast<double>(n) + 4.0 * static_cast<double>(E * count * G);
        const auto [med, mn] = timer.time([&] { batched->apply(b, bo); });
        add(tag, in_bytes, med, mn);
        for (int streams : {1, 4}) {
          const auto e = experts_cuda_fp8::make_cuda_experts_fp8(bat_cfg, streams);
          const auto [m1, n1] = timer.time([&] { e->apply(b, bo); });
          add(tag + ", " + std::to_string(streams) + " stream(s)", in_bytes, m1, n1);
        }
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        check(cudaStreamBeginCapture(timer.stream, cudaStreamCaptureModeGlobal), "begin capture");
        batched->apply(b, bo);
        check(cudaStreamEndCapture(timer.stream, &graph), "end capture");
        check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        const auto [gmed, gmn] = timer.time([&] { check(cudaGraphLaunch(exec, timer.stream), "graph launch"); });
        add(tag + ", graph", in_bytes, gmed, gmn);
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
      for (void* p : {bx, bxs, bout, dc}) check(cudaFree(p), "cudaFree");
    }
    for (void* p : {x, xq, xs, d_idx, d_w, out}) check(cudaFree(p), "cudaFree");
  }
  for (void* p : {w1, w2, w1s, w2s, work}) check(cudaFree(p), "cudaFree");
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 30;
  std::string json_path;
  bool fp8_only = false;  // only the fp8 block-scaled cases (and their ceilings)
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) runs = std::max(20, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--fp8-only")) fp8_only = true;
    else {
      std::printf("usage: %s [--runs N (>= 20)] [--json PATH] [--fp8-only]\n", argv[0]);
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
    if (fp8_only) break;
    // The two decode/prefill sizes (T = 128, 4096) in full; the ones between only for the GEMM modes' crossover.
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

  check(cudaFree(w1), "cudaFree");
  check(cudaFree(w2), "cudaFree");
  run_fp8(timer, copy_rate, seed, rows);

  // ---- summary ----
  std::printf("\nstandard, auto: grouped GEMMs up to %lld rows per expert (mean), else loop\n",
              static_cast<long long>(experts_cuda::kGroupedMaxMeanRows));
  std::printf("\n| shape | variant | median ms | roofline ms | %% of roofline | TFLOP/s |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  for (const Row& r : rows)
    std::printf("| %s | %s | %.3f | %.3f | %.1f | %.0f |\n", r.shape.c_str(), r.name.c_str(), r.median_ms,
                r.roofline_ms, 100.0 * r.roofline_ms / r.median_ms, r.tflops);
  std::printf("\nceilings: d2d copy %.0f GB/s, dense bf16 GEMM %.0f TFLOP/s, "
              "dense fp8 block-scaled GEMM %.0f TFLOP/s\n",
              copy_rate * 1e-9, gemm_rate * 1e-12, g_fp8_gemm_rate * 1e-12);
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      std::perror(json_path.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\n  \"device\": \"%s\",\n  \"runs\": %d,\n  \"copy_gbps\": %.1f,\n  \"gemm_tflops\": %.1f,\n"
                 "  \"fp8_block_gemm_tflops\": %.1f,\n",
                 prop.name, runs, copy_rate * 1e-9, gemm_rate * 1e-12, g_fp8_gemm_rate * 1e-12);
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
