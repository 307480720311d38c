// Bandwidth of the single-GPU memory-bound stages (layout, permute layout, permute, unpermute, fp8
// quantize) next to a device-to-device copy measured in the same run (semantics §12, PERF.md).
//
// A plain timing harness (not Google Benchmark): every figure is the median of >= 50 runs after warm-up,
// each run timed with CUDA events around the stage's kernels alone (outputs preallocated, the internal
// entry points the public functions call), the L2 flushed before each run by a 256 MiB memset, inputs
// random (seed printed) and never zeros. Bandwidth = the bytes the stage must move (each input read
// once, each output written once) / time; the copy counts read + write.
//
// Usage: bench_gpu_stages [--runs N] [--json PATH]
#include <epmoe/layout.hpp>
#include <epmoe/permute.hpp>
#include <epmoe/quant.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bench_util.hpp"

#include "layout/layout.hpp"
#include "quant/quant.hpp"

namespace {

using namespace epmoe;

void check(cudaError_t e, const char* what) { bench::check_cuda("bench_gpu_stages", e, what); }

struct Result {
  std::string stage, shape;
  double bytes = 0, median_us = 0, min_us = 0, gbps = 0, copy_fraction = 0;
  int runs = 0;
};

struct Timer {
  cudaEvent_t start{}, stop{};
  void* flush = nullptr;
  std::size_t flush_bytes = std::size_t{256} << 20;
  int runs;
  explicit Timer(int n) : runs(n) {
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    check(cudaMalloc(&flush, flush_bytes), "cudaMalloc flush");
  }
  // Median and minimum in microseconds of `fn` over the runs, after 5 warm-up calls.
  std::pair<double, double> time(const std::function<void()>& fn) {
    for (int i = 0; i < 5; ++i) fn();
    check(cudaDeviceSynchronize(), "warm-up");
    std::vector<double> us;
    for (int i = 0; i < runs; ++i) {
      check(cudaMemsetAsync(flush, i & 0xff, flush_bytes, nullptr), "L2 flush");
      check(cudaEventRecord(start, nullptr), "cudaEventRecord");
      fn();
      check(cudaEventRecord(stop, nullptr), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      us.push_back(static_cast<double>(ms) * 1000.0);
    }
    check(cudaGetLastError(), "kernels");
    std::sort(us.begin(), us.end());
    return {us[us.size() / 2], us.front()};
  }
};

using bench::splitmix;

// Random bf16 values in (-4, 4), never zero.
Tensor random_bf16_device(std::uint64_t& seed, std::int64_t rows, std::int64_t cols) {
  Tensor h = Tensor::empty(DType::bf16, {rows, cols});
  auto* p = h.ptr<bf16_t>();
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    const std::uint64_t r = splitmix(seed);
    const float u = (static_cast<float>(r & 0xffffu) + 0.5f) / 16384.0f;
    p[i] = float_to_bf16((r & 0x10000u) ? -u : u);
  }
  Tensor d = Tensor::empty(DType::bf16, {rows, cols}, Device::cuda(0));
  check(cudaMemcpy(d.data(), h.data(), h.nbytes(), cudaMemcpyHostToDevice), "H2D");
  return d;
}

// K distinct random ids in [0, E) per token (uniform routing), int64 on the device.
Tensor random_ids_device(std::uint64_t& seed, std::int64_t T, int K, int E) {
  Tensor h = Tensor::empty(DType::int64, {T, K});
  std::vector<int> ids(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) ids[static_cast<std::size_t>(e)] = e;
    for (int k = 0; k < K; ++k) {
      const int j = k + static_cast<int>(splitmix(seed) % static_cast<std::uint64_t>(E - k));
      std::swap(ids[static_cast<std::size_t>(k)], ids[static_cast<std::size_t>(j)]);
      h.ptr<std::int64_t>()[t * K + k] = ids[static_cast<std::size_t>(k)];
    }
  }
  Tensor d = Tensor::empty(DType::int64, {T, K}, Device::cuda(0));
  check(cudaMemcpy(d.data(), h.data(), h.nbytes(), cudaMemcpyHostToDevice), "H2D");
  return d;
}

Tensor random_weights_device(std::uint64_t& seed, std::int64_t T, int K) {
  Tensor h = Tensor::empty(DType::fp32, {T, K});
  for (std::int64_t i = 0; i < T * K; ++i)
    h.ptr<float>()[i] = 0.05f + static_cast<float>(splitmix(seed) % 1000) / 1000.0f;
  Tensor d = Tensor::empty(DType::fp32, {T, K}, Device::cuda(0));
  check(cudaMemcpy(d.data(), h.data(), h.nbytes(), cudaMemcpyHostToDevice), "H2D");
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 100;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--runs") && i + 1 < argc)
      runs = std::max(50, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc)
      json_path = argv[++i];
    else {
      std::printf("usage: %s [--runs N (>= 50)] [--json PATH]\n", argv[0]);
      return std::strcmp(argv[i], "--help") ? 2 : 0;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_gpu_stages: no CUDA device: skipped\n");
    return 77;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::uint64_t seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  std::printf("bench_gpu_stages: %s, %d SMs, L2 %d MiB, seed %llu, %d runs per figure\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, static_cast<unsigned long long>(seed), runs);

  Timer timer(runs);
  std::vector<Result> results;
  auto record = [&](const std::string& stage, const std::string& shape, double bytes, std::pair<double, double> t) {
    Result r;
    r.stage = stage;
    r.shape = shape;
    r.bytes = bytes;
    r.median_us = t.first;
    r.min_us = t.second;
    r.gbps = bytes / (t.first * 1e-6) / 1e9;
    r.runs = runs;
    results.push_back(r);
    std::printf("  %-22s %-34s %10.1f us  %8.1f GB/s\n", stage.c_str(), shape.c_str(), r.median_us, r.gbps);
    std::fflush(stdout);
  };

  // Ceiling: device-to-device copy of 1 GiB, read + write counted.
  const std::size_t copy_bytes = std::size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  check(cudaMalloc(&a, copy_bytes), "cudaMalloc");
  check(cudaMalloc(&b, copy_bytes), "cudaMalloc");
  check(cudaMemset(a, 0x3c, copy_bytes), "cudaMemset");
  record("d2d_copy", "1 GiB", 2.0 * static_cast<double>(copy_bytes),
         timer.time([&] { check(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, nullptr), "copy"); }));
  const double copy_gbps = results.back().gbps;
  check(cudaFree(a), "cudaFree");
  check(cudaFree(b), "cudaFree");

  const int K = 8, E = 256;
  const std::int64_t H = 7168;
  for (std::int64_t T : {std::int64_t{4096}, std::int64_t{128}}) {
    const std::string shape = "T=" + std::to_string(T) + " H=" + std::to_string(H) + " K=8 E=256";
    const Tensor ids = random_ids_device(seed, T, K, E);

    // get_dispatch_layout for 2 and 8 ranks.
    for (int R : {2, 8}) {
      Tensor counts = Tensor::empty(DType::int32, {R + E}, Device::cuda(0));
      Tensor in_rank = Tensor::empty(DType::boolean, {T, R}, Device::cuda(0));
      const double bytes = static_cast<double>(T * K * 8 + T * R + (R + E) * 4);
      record("layout", shape + " R=" + std::to_string(R), bytes, timer.time([&] {
        layout_detail::dispatch_layout_cuda(ids, E, R, counts.ptr<std::int32_t>(), counts.ptr<std::int32_t>() + R,
                                            in_rank.ptr<bool>(), Stream{});
      }));
    }

    // make_permute_layout (one rank: every id is local, E_local = 256).
    const PermuteLayout l = make_permute_layout(ids, E, 1);
    {
      Tensor ws = Tensor::empty(
          DType::int8, {static_cast<std::int64_t>(layout_detail::permute_layout_workspace_bytes(T * K, E)) + 16},
          Device::cuda(0));
      const layout_detail::PermuteLayoutBuffers buf{
          l.seg_indptr.ptr<std::int64_t>(), l.num_tokens_per_expert.ptr<std::int32_t>(), l.src2dst.ptr<std::int32_t>(),
          l.dst2src.ptr<std::int32_t>(),    l.reorder_topk_ids.ptr<std::int32_t>(),      ws.data()};
      const double bytes = static_cast<double>(T * K * 8 + T * K * 4 + 2 * l.capacity * 4 + (2 * E + 1) * 4);
      record("permute_layout", shape, bytes,
             timer.time([&] { layout_detail::make_permute_layout_cuda(ids, E, 1, l.capacity, buf, Stream{}); }));
    }
    check(cudaDeviceSynchronize(), "layout");
    const double n = static_cast<double>(T * K);  // every entry local

    // permute bf16 rows: read each row once, write it K times.
    const Tensor x = random_bf16_device(seed, T, H);
    Tensor out = Tensor::empty(DType::bf16, {l.capacity, H}, Device::cuda(0));
    {
      const double bytes = static_cast<double>(T * H * 2) + n * static_cast<double>(H * 2) + n * 4;
      record("permute_bf16", shape, bytes,
             timer.time([&] { layout_detail::permute_cuda(x, {}, l, out, {}, Stream{}); }));
    }
    // permute fp8 rows with float32 scales (the fp8 dispatch path).
    {
      Tensor xq = Tensor::empty(DType::fp8_e4m3, {T, H}, Device::cuda(0));
      Tensor xs = Tensor::empty(DType::fp32, {T, H / 128}, Device::cuda(0));
      quantize_fp8_into(x, xq, xs);
      Tensor oq = Tensor::empty(DType::fp8_e4m3, {l.capacity, H}, Device::cuda(0));
      Tensor os = Tensor::empty(DType::fp32, {l.capacity, H / 128}, Device::cuda(0));
      const double row = static_cast<double>(H + H / 128 * 4);
      const double bytes = static_cast<double>(T) * row + n * row + n * 4;
      record("permute_fp8_scales", shape, bytes,
             timer.time([&] { layout_detail::permute_cuda(xq, xs, l, oq, os, Stream{}); }));
    }
    // unpermute: K expert rows per token reduced in float32 into one bf16 row.
    {
      const Tensor y = random_bf16_device(seed, l.capacity, H);
      const Tensor w = random_weights_device(seed, T, K);
      Tensor o = Tensor::empty(DType::bf16, {T, H}, Device::cuda(0));
      const double bytes = n * static_cast<double>(H * 2) + static_cast<double>(T * H * 2) + n * 8;
      record("unpermute_bf16", shape, bytes, timer.time([&] { layout_detail::unpermute_cuda(y, l, w, o, Stream{}); }));
    }
    // fp8 quantization of bf16 rows: float32 scales, and UE8M0 words.
    for (bool ue8m0 : {false, true}) {
      Fp8Options o;
      o.round_scale = ue8m0;
      o.use_ue8m0 = ue8m0;
      const std::int64_t S = ue8m0 ? num_ue8m0_words(H) : num_scale_groups(H);
      Tensor q = Tensor::empty(DType::fp8_e4m3, {T, H}, Device::cuda(0));
      Tensor s = Tensor::empty(ue8m0 ? DType::int32 : DType::fp32, {T, S}, Device::cuda(0));
      const quant_detail::QuantizeProblem p{x, q, s, T, H, o};
      const double bytes = static_cast<double>(T * H * 2 + T * H + T * S * 4);
      record(ue8m0 ? "quantize_fp8_ue8m0" : "quantize_fp8", shape, bytes,
             timer.time([&] { quant_detail::quantize_fp8_cuda(p, Stream{}); }));
      if (!ue8m0)  // the two kernel shapes the size heuristic chooses between
        for (int tasks : {1, 4})
          record("quantize_fp8[" + std::to_string(tasks) + " word/warp]", shape, bytes,
                 timer.time([&] { quant_detail::quantize_fp8_cuda(p, Stream{}, true, tasks); }));
    }
  }
  for (Result& r : results) r.copy_fraction = r.gbps / copy_gbps;

  // Table (last, so it ends the output) and JSON.
  std::printf("\n| stage | shape | median us | GB/s | of d2d copy |\n| --- | --- | --- | --- | --- |\n");
  for (const Result& r : results)
    std::printf("| %s | %s | %.1f | %.0f | %.0f%% |\n", r.stage.c_str(), r.shape.c_str(), r.median_us, r.gbps,
                100.0 * r.copy_fraction);
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) {
      std::perror(json_path.c_str());
      return 1;
    }
    std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"date\": \"%s\",\n  \"seed\": %llu,\n  \"runs\": %d,\n", prop.name,
                 date, static_cast<unsigned long long>(seed), runs);
    std::fprintf(f, "  \"method\": \"median of runs, CUDA events, L2 flushed (256 MiB memset) before each run\",\n");
    std::fprintf(f, "  \"results\": [\n");
    for (std::size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f,
                   "    {\"stage\": \"%s\", \"shape\": \"%s\", \"bytes\": %.0f, \"median_us\": %.3f, \"min_us\": %.3f, "
                   "\"gbps\": %.1f, \"fraction_of_copy\": %.3f}%s\n",
                   r.stage.c_str(), r.shape.c_str(), r.bytes, r.median_us, r.min_us, r.gbps, r.copy_fraction,
                   i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}
